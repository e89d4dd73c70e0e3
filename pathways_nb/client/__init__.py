"""The user's process: ``connect``, ``Session``, the JAX plugin, reading the cluster's state and events."""
