"""Runs one command with the benchmark network up: `python3 -m harness.within PROFILE WORKDIR
NETDELAY_BIN -- CMD ARGS...` (from bench/). It sets up the hosts of `netns.Topology` (lan or
wan), runs CMD on this host with, for each host H of A–D, `MFSB_NET_H` (a command prefix that
enters only H's network namespace, so a FUSE mount made by a daemon started with it is
visible to every process) and `MFSB_IP_H` (its address) in the environment, then tears the
network down, whatever CMD did. Exits with CMD's status.

Used by the scripts that measure one thing over a profile (`bench/on-demand --profile wan`).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .netns import HOSTS, Topology, ip_of, ns_of
from .util import PROCS


def main(argv):
    if len(argv) < 5 or argv[3] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    profile, work, netdelay = argv[0], Path(argv[1]), Path(argv[2])
    work.mkdir(parents=True, exist_ok=True)
    topo = Topology(profile, work, netdelay)
    env = dict(os.environ)
    try:
        topo.setup()
        for h in HOSTS:
            env[f"MFSB_NET_{h}"] = " ".join(topo.exec_net_argv(h, []))
            env[f"MFSB_IP_{h}"] = ip_of(h)
        env["MFSB_NS_A"], env["MFSB_NS_B"] = ns_of("A"), ns_of("B")
        return subprocess.run(argv[4:], env=env, check=False).returncode
    finally:
        topo.teardown()
        PROCS.stop_all()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
