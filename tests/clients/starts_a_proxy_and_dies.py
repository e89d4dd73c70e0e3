"""Starts ``pathways-nb`` with the arguments argv[2:] (a server) as a child, writes its pid to the file
argv[1], and dies at once without stopping it (``os._exit``), as a launcher killed by SIGKILL would.
"""

import os
import sys

from pathways_nb.launch.processes import ChildServer

server = ChildServer("proxy", sys.argv[2:])
server.start()
with open(sys.argv[1], "w") as pid_file:
    pid_file.write(str(server.process.pid))
os._exit(9)
