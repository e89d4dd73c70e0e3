"""Each worker (one per host): devices, arrays, programs, transfers."""
