"""Connects to the cluster at argv[1] as tenant argv[2] at priority argv[3], with a time-out of 3 s (the stock
client tries again until then), and prints why the connection was refused (nothing if it was not)."""

import sys

import pathways_nb

try:
    pathways_nb.connect(sys.argv[1], tenant=sys.argv[2], priority=int(sys.argv[3]), timeout_s=3)
except pathways_nb.ConnectionFailed as error:
    print(error)
