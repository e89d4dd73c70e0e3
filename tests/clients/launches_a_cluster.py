"""Starts a LocalCluster of one device, prints the pids of its processes, and sleeps until killed."""

import time

from pathways_nb.launch.local_cluster import LocalCluster

cluster = LocalCluster(islands=1, devices_per_host=1)
print(" ".join(str(c.process.pid) for c in cluster.processes()), flush=True)
time.sleep(600)
