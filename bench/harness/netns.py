"""Benchmark network: hosts A, B, C, D as network namespaces on 198.18.0.0/24 (RFC 2544).

Every profile sets up all four; a chain uses the first N (2, or 4 for the fan-out), and a
host it does not use runs nothing.

lan: each host has a veth `eth0` whose peer is a port of bridge `br0` in a hub namespace;
     no shaping.
wan: each host has a TUN `tun0`; bench/netdelay moves packets between the TUNs with a
     45 ms one-way delay (90 ms RTT) and a 1 Gbit/s egress link per host.

No namespace has a default route or any link to the outside world.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from .util import PROCS, BenchError, log, port_listening, sh, wait_until

PREFIX = "mfsb"
HOSTS = ["A", "B", "C", "D"]
TCP_MEM = "4096 131072 33554432"  # 32 MiB autotuning max (1 Gbit/s x 90 ms = 11 MB)


def ip_of(host):
    return f"198.18.0.{HOSTS.index(host) + 1}"


def ns_of(host):
    return f"{PREFIX}-{host.lower()}"


def cleanup_stale():
    """Delete namespaces left by an earlier, killed run."""
    r = sh(["ip", "netns", "list"], check=False)
    for line in (r.stdout or "").splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX + "-"):
            sh(["ip", "netns", "del", name], check=False)


class Topology:
    def __init__(self, profile, workdir: Path, netdelay_bin: Path, delay_ms=45.0,
                 rate_mbit=1000.0):
        assert profile in ("lan", "wan")
        self.profile = profile
        self.workdir = workdir
        self.netdelay_bin = netdelay_bin
        self.delay_ms = delay_ms
        self.rate_mbit = rate_mbit
        self.fwd = None
        self.fwd_stats_path = workdir / "netdelay.stats"
        self.ifname = "eth0" if profile == "lan" else "tun0"
        self.hub = f"{PREFIX}-hub"
        self.info = {}

    # -- setup / teardown -------------------------------------------------------------
    def setup(self):
        cleanup_stale()
        for h in HOSTS:
            ns = ns_of(h)
            sh(["ip", "netns", "add", ns])
            sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            sh(["ip", "netns", "exec", ns, "sysctl", "-qw",
                "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1",
                f"net.ipv4.tcp_rmem={TCP_MEM}", f"net.ipv4.tcp_wmem={TCP_MEM}"])
        if self.profile == "lan":
            sh(["ip", "netns", "add", self.hub])
            sh(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
            sh(["ip", "-n", self.hub, "link", "set", "br0", "up"])
            for h in HOSTS:
                ns, port = ns_of(h), f"p{h.lower()}"
                sh(["ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name",
                    port, "netns", self.hub])
                sh(["ip", "-n", self.hub, "link", "set", port, "master", "br0", "up"])
                sh(["ip", "-n", ns, "addr", "add", f"{ip_of(h)}/24", "dev", "eth0"])
                sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
        else:
            ready = self.workdir / "netdelay.ready"
            ready.unlink(missing_ok=True)
            argv = [str(self.netdelay_bin), "--delay-ms", str(self.delay_ms),
                    "--rate-mbit", str(self.rate_mbit), "--stats", str(self.fwd_stats_path),
                    "--ready", str(ready)]
            for h in HOSTS:
                argv += ["--host", f"{ns_of(h)}={ip_of(h)}"]
            self.fwd = PROCS.start("netdelay", argv, self.workdir / "netdelay.log")
            wait_until(lambda: ready.exists() or self.fwd.poll() is not None, 10,
                       what="netdelay ready")
            if self.fwd.poll() is not None:
                raise BenchError("netdelay exited: " +
                                 (self.workdir / "netdelay.log").read_text()[-1000:])
            for h in HOSTS:
                ns = ns_of(h)
                sh(["ip", "-n", ns, "addr", "add", f"{ip_of(h)}/24", "dev", "tun0"])
                sh(["ip", "-n", ns, "link", "set", "tun0", "txqueuelen", "20000", "up"])
        # wait until every host reaches every other (bridge ports, TUNs up)
        for h in HOSTS:
            for o in HOSTS:
                if o != h:
                    wait_until(lambda: sh(["ip", "netns", "exec", ns_of(h), "ping", "-c", "1",
                                           "-W", "1", ip_of(o)], check=False).returncode == 0,
                               15, interval=0.2, what=f"ping {h}->{o}")
        log(f"topology {self.profile} up: " +
            ", ".join(f"{h}={ns_of(h)}/{ip_of(h)}" for h in HOSTS))

    def teardown(self):
        if self.fwd is not None:
            PROCS.stop(self.fwd, timeout=5)
            self.fwd = None
        for h in HOSTS:
            sh(["ip", "netns", "del", ns_of(h)], check=False)
        sh(["ip", "netns", "del", self.hub], check=False)

    # -- helpers ----------------------------------------------------------------------
    def exec_argv(self, host, argv):
        return ["ip", "netns", "exec", ns_of(host)] + list(argv)

    def exec_net_argv(self, host, argv):
        """Like exec_argv, but only the network namespace: `ip netns exec` also gives the
        process a private mount namespace (the root filesystem here is mounted `private`), so
        a FUSE mount made inside it would be invisible to every other process."""
        return ["nsenter", f"--net=/run/netns/{ns_of(host)}", "--"] + list(argv)

    def counters(self):
        """{host: {tx_bytes, rx_bytes, tx_packets, rx_packets, tx_dropped}} of the host's
        network interface. Bytes are IP bytes as the kernel hands them to the device (a GSO
        super-packet is counted once, with one set of headers)."""
        out = {}
        for h in HOSTS:
            r = sh(["ip", "-n", ns_of(h), "-s", "-j", "link", "show", self.ifname])
            st = json.loads(r.stdout)[0]["stats64"]
            out[h] = {"tx_bytes": st["tx"]["bytes"], "rx_bytes": st["rx"]["bytes"],
                      "tx_packets": st["tx"]["packets"], "rx_packets": st["rx"]["packets"],
                      "tx_dropped": st["tx"]["dropped"], "rx_dropped": st["rx"]["dropped"]}
        return out

    def fwd_stats(self):
        """Counters of the delay forwarder (wan only), fetched via SIGUSR1."""
        if self.fwd is None or self.fwd.poll() is not None:
            return None
        prev = -1
        try:
            prev = json.loads(self.fwd_stats_path.read_text())["seq"]
        except (OSError, ValueError, KeyError):
            pass
        os.kill(self.fwd.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                d = json.loads(self.fwd_stats_path.read_text())
                if d["seq"] != prev:
                    return d
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.01)
        return None

    # -- network verification ---------------------------------------------------------
    def verify(self, seconds=10):
        """ping RTT, iperf3 TCP throughput (default congestion control and cubic) and UDP
        loss under load, A -> B. Returns a dict that goes into the results."""
        res = {"profile": self.profile}
        r = sh(self.exec_argv("A", ["ping", "-c", "20", "-i", "0.1", "-q", ip_of("B")]),
               check=False, timeout=60)
        m = re.search(r"= ([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+) ms", r.stdout or "")
        if m:
            res["ping_ms"] = {"min": float(m.group(1)), "avg": float(m.group(2)),
                              "max": float(m.group(3)), "mdev": float(m.group(4))}
        cc = sh(self.exec_argv("A", ["sysctl", "-n", "net.ipv4.tcp_congestion_control"]),
                check=False).stdout.strip()
        res["tcp_cc_default"] = cc
        for label, extra in ((f"tcp_{cc}", []), ("tcp_cubic", ["-C", "cubic"])):
            if label == "tcp_cubic" and cc == "cubic":
                continue
            res[label] = self._iperf(["-t", str(seconds), "-O", "2"] + extra, seconds)
        for rate in ("500M", "900M"):
            res[f"udp_{rate}"] = self._iperf(["-u", "-b", rate, "-w", "4M", "-t",
                                              str(seconds)], seconds)
        return res

    def _iperf(self, args, seconds):
        port = "5201"
        srv = PROCS.start("iperf3-server",
                          self.exec_argv("B", ["iperf3", "-s", "-1", "-B", ip_of("B"), "-p",
                                               port]),
                          self.workdir / "iperf3-server.log")
        try:
            wait_until(lambda: port_listening(ns_of("B"), port), 10,
                       interval=0.1, what="iperf3 server")
            f0 = self.fwd_stats()
            c0 = self.counters()
            r = sh(self.exec_argv("A", ["iperf3", "-c", ip_of("B"), "-p", port, "-J"] + args),
                   check=False, timeout=seconds + 40)
            c1 = self.counters()
            f1 = self.fwd_stats()
            d = json.loads(r.stdout)
            end = d.get("end", {})
            out = {"args": " ".join(args)}
            if "-u" in args:
                s = end.get("sum", {})
                out.update({"mbit_s": round(s.get("bits_per_second", 0) / 1e6, 1),
                            "lost_percent": round(s.get("lost_percent", 0), 3),
                            "lost_packets": s.get("lost_packets"),
                            "packets": s.get("packets")})
                snd = end.get("sum_sent") or {}
                if snd:
                    out["sender_mbit_s"] = round(snd.get("bits_per_second", 0) / 1e6, 1)
            else:
                out.update({
                    "mbit_s": round(end.get("sum_received", {}).get("bits_per_second", 0) / 1e6, 1),
                    "retransmits": end.get("sum_sent", {}).get("retransmits")})
            if "error" in d:
                out["error"] = d["error"]
            out["tun_or_veth_tx_dropped"] = sum(c1[h]["tx_dropped"] - c0[h]["tx_dropped"]
                                                for h in HOSTS)
            if f0 and f1:
                out["forwarder"] = {
                    "queue_drops": sum(f1["hosts"][n]["drop_queue"] - f0["hosts"][n]["drop_queue"]
                                       for n in f1["hosts"]),
                    "write_errors": sum(f1["hosts"][n]["write_errs"] - f0["hosts"][n]["write_errs"]
                                        for n in f1["hosts"]),
                    "max_late_us": max(f1["hosts"][n]["max_late_us"] for n in f1["hosts"]),
                    "max_queue_us": max(f1["hosts"][n]["max_queue_us"] for n in f1["hosts"]),
                    "uso": f1.get("uso")}
            return out
        except Exception as e:  # noqa: BLE001
            return {"error": str(e)}
        finally:
            PROCS.stop(srv, timeout=3)
