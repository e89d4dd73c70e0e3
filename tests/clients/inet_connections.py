"""Prints JSON: the internet sockets of process argv[1] (local address and port, remote address and
port, status), as this process's network namespace sees them (psutil reads the caller's /proc/net).
"""

import json
import sys

import psutil

print(
    json.dumps(
        [
            [c.laddr.ip, c.laddr.port, c.raddr.ip if c.raddr else "", c.raddr.port if c.raddr else 0, c.status]
            for c in psutil.Process(int(sys.argv[1])).net_connections(kind="inet")
        ]
    )
)
