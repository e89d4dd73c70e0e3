"""Starting a cluster on one machine: ``LocalCluster`` and the supervision of its child processes."""
