"""Scenarios and the measurement around them.

A *chain* is a sequence of steps on one set of fresh replicas (one directory per host,
never reused): e.g. `large` = initial sync of the 512 MiB file, then the delta change.
Steps that are measured but were not asked for (a prerequisite of a selected step) are
recorded with "prereq": true and left out of the tables.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from . import datasets, tree
from .netns import HOSTS, ns_of
from .util import (CLIENT_PIDS, BenchError, back_memory, descendants, drop_caches, loadavg, log,
                   proc_status, sh, tail)

SCENARIOS = {
    # name: (chain, description)
    "initial-small": ("small", "initial sync, {small}"),
    "initial-large": ("large", "initial sync, {big}"),
    "delta": ("large", "4 KiB overwritten in the middle of the {big_mib} MiB file + 1 KiB appended"),
    "initial-mixed": ("mixed", "initial sync, {mixed}"),
    "initial-tree": ("tree", "initial sync, {tree}"),
    # The same initial syncs with the source's pages in memory (read just before the clock):
    # a user's first sync of files they just worked on.
    "initial-small-warm": ("small-w", "initial sync, {small}, page cache warm"),
    "initial-large-warm": ("large-w", "initial sync, {big}, page cache warm"),
    "initial-mixed-warm": ("mixed-w", "initial sync, {mixed}, page cache warm"),
    "initial-tree-warm": ("tree-w", "initial sync, {tree}, page cache warm"),
    "rename": ("rename", "rename of a directory holding {rename_mib} MiB ({rename_files} files)"),
    "nochange": ("scan", "no-change re-sync / restart, {scan} (already in sync)"),
    "latency": ("latency", "small new file written on A until its content is readable on B"),
    "write-small": ("write", "{small} copied into A (`cp -a`, timed) until all readable on B"),
    "write-large": ("write-l", "{big} copied into A (`cp -a`, timed) until readable on B"),
    # A set made beside A (same filesystem, untimed, flushed) and moved in with `mv` (timed):
    # issue #46's "a file moved into the folder until the peer holds it", capture included.
    "move-small": ("move", "{small} moved into A (`mv`, timed) until all readable on B"),
    "move-large": ("move-l", "{big} moved into A (`mv`, timed) until readable on B"),
    "fanout": ("fanout", "fan-out to 3 peers: initial sync A -> B, C and D, {rename}"),
    "fanout-warm": ("fan-w", "fan-out to 3 peers: initial sync A -> B, C and D, {rename}, "
                             "page cache warm"),
}
CHAINS = {
    "small": {"dataset": "small", "hosts": 2, "steps": ["initial-small"]},
    "large": {"dataset": "big", "hosts": 2, "steps": ["initial-large", "delta"]},
    "mixed": {"dataset": "mixed", "hosts": 2, "steps": ["initial-mixed"]},
    "tree": {"dataset": "tree", "hosts": 2, "steps": ["initial-tree"]},
    "small-w": {"dataset": "small", "hosts": 2, "steps": ["initial-small-warm"]},
    "large-w": {"dataset": "big", "hosts": 2, "steps": ["initial-large-warm"]},
    "mixed-w": {"dataset": "mixed", "hosts": 2, "steps": ["initial-mixed-warm"]},
    "tree-w": {"dataset": "tree", "hosts": 2, "steps": ["initial-tree-warm"]},
    "rename": {"dataset": "rename", "hosts": 2, "steps": ["initial-rename", "rename"]},
    "scan": {"dataset": "scan", "hosts": 2, "steps": ["seed-scan", "nochange"]},
    "latency": {"dataset": None, "hosts": 2, "steps": ["seed-latency", "latency"]},
    "fanout": {"dataset": "rename", "hosts": 4, "steps": ["fanout"]},
    "fan-w": {"dataset": "rename", "hosts": 4, "steps": ["fanout-warm"]},
    # A starts empty: the dataset is written into A while the tool runs.
    "write": {"dataset": "small", "hosts": 2, "steps": ["seed-write", "write-small"],
              "empty": True},
    "write-l": {"dataset": "big", "hosts": 2, "steps": ["seed-write", "write-large"],
                "empty": True},
    "move": {"dataset": "small", "hosts": 2, "steps": ["seed-move", "move-small"],
             "empty": True},
    "move-l": {"dataset": "big", "hosts": 2, "steps": ["seed-move", "move-large"],
               "empty": True},
}
# A chain's name is part of its replicas' paths, which hold the daemons' control sockets: kept
# short (a Unix socket address is at most 107 bytes), hence "-w" for the warm variants
# ("fan-w" for the fan-out's).
CHAIN_ORDER = ["small", "small-w", "large", "large-w", "mixed", "mixed-w", "tree", "tree-w",
               "rename", "fanout", "fan-w", "scan", "write", "write-l", "move", "move-l",
               "latency"]
# Syncthing with a shorter watcher delay only differs where the watcher matters.
WATCHER_ONLY = {"delta", "rename", "latency", "write-small", "write-large", "move-small",
                "move-large"}
# Through mounts on both sides: initial sync, files written in mount A, a directory renamed in
# mount A, and the latency from a write in mount A to the content readable in mount B.
MOUNT_SCENARIOS = {"initial-small", "write-small", "rename", "latency"}


def eligible(tool_name, scenario):
    if tool_name.startswith("syncthing-"):
        return scenario in WATCHER_ONLY
    if tool_name == "meshfs-mount":
        return scenario in MOUNT_SCENARIOS
    if tool_name.startswith("wire-copy"):  # a plain copy: first syncs only
        return scenario.startswith(("initial-", "fanout"))
    return True


def pctl(values, p):
    """Nearest-rank percentile."""
    v = sorted(values)
    if not v:
        return None
    return v[max(0, math.ceil(p / 100 * len(v)) - 1)]


class Meter:
    """Wire bytes, CPU and peak RSS of one tool over one measured interval."""

    def __init__(self, ctx, tool):
        self.ctx, self.tool = ctx, tool
        self.sampler = None

    def begin(self):
        topo = self.ctx.topo
        self.c0 = topo.counters()
        self.f0 = topo.fwd_stats()
        self.cpu0 = self.tool.cpu_snapshot()
        self.tool.reset_peaks()
        self.la0 = loadavg()
        if not self.tool.continuous:
            self.sampler = _HostRss({h: p.pid for h, p in self.tool.daemon_procs()})
            self.sampler.start()
        self.t0 = time.monotonic()
        return self.t0

    def end(self, client=None):
        """Call after the measured interval, while daemons still run."""
        if self.sampler:
            self.sampler.stop()
        self.tool.settle()
        topo = self.ctx.topo
        c1 = topo.counters()
        f1 = topo.fwd_stats()
        cpu1 = self.tool.cpu_snapshot()
        out = {"loadavg": [self.la0, loadavg()]}
        net = {h: {k: c1[h][k] - self.c0[h][k] for k in ("tx_bytes", "rx_bytes", "tx_packets")}
               for h in HOSTS}
        out["wire_bytes"] = sum(n["tx_bytes"] for n in net.values())
        out["net"] = net
        if self.f0 and f1:
            out["fwd"] = {
                "wire_bytes": sum(f1["hosts"][n]["wire_bytes"] - self.f0["hosts"][n]["wire_bytes"]
                                  for n in f1["hosts"]),
                "queue_drops": sum(f1["hosts"][n]["drop_queue"] - self.f0["hosts"][n]["drop_queue"]
                                   for n in f1["hosts"]),
                # Wire bytes tail-dropped at the bottleneck: what the tool has to send again.
                # (A forwarder from before this counter reports none.)
                "queue_drop_wire_bytes": sum(
                    f1["hosts"][n].get("drop_queue_wire_bytes", 0)
                    - self.f0["hosts"][n].get("drop_queue_wire_bytes", 0)
                    for n in f1["hosts"]),
                "max_late_us": max(f1["hosts"][n]["max_late_us"] for n in f1["hosts"])}
        cpu_by_host = {}
        for k, v in cpu1.items():
            h = k.split(":")[0]
            cpu_by_host[h] = cpu_by_host.get(h, 0.0) + v - self.cpu0.get(k, 0.0)
        if client:
            cpu_by_host["A"] = cpu_by_host.get("A", 0.0) + (client.get("client_cpu_s") or 0.0)
        out["cpu_by_host"] = {h: round(v, 3) for h, v in cpu_by_host.items()}
        out["cpu_s"] = round(sum(cpu_by_host.values()), 3)
        rss = {h: v for h, v in self.tool.peaks().items() if v}
        if self.sampler:
            rss = {h: v for h, v in self.sampler.peaks.items() if v}
        out["rss_by_host_kb"] = rss
        out["peak_rss_kb"] = max(rss.values()) if rss else None
        return out


class _HostRss:
    """Peak VmHWM, sampled 10 times a second, of one-shot tool processes: on the source
    host the running client commands (util.CLIENT_PIDS and their children), on the other
    hosts the session processes forked by the per-host servers (sshd, rsyncd)."""

    def __init__(self, roots):
        self.roots = roots
        self.peaks = {h: 0 for h in list(roots) + ["A"]}
        self.ev = threading.Event()
        self.th = threading.Thread(target=self._run, daemon=True)

    def _sample(self, host, pids):
        for d in pids:
            v = proc_status(d, "VmHWM") or 0
            if v > self.peaks[host]:
                self.peaks[host] = v

    def _run(self):
        while not self.ev.is_set():
            for h, pid in self.roots.items():
                self._sample(h, descendants([pid]))
            clients = set(CLIENT_PIDS)
            if clients:
                self._sample("A", sorted(clients) + descendants(clients))
            self.ev.wait(0.1)

    def start(self):
        self.th.start()

    def stop(self):
        self.ev.set()
        self.th.join(5)


# ---------------------------------------------------------------------------------------


class ChainRun:
    def __init__(self, ctx, tool, chain, run, selected):
        self.ctx, self.tool, self.chain, self.run = ctx, tool, chain, run
        spec = CHAINS[chain]
        self.spec = spec
        self.hosts = HOSTS[:spec["hosts"]]
        self.dsts = self.hosts[1:]
        self.base = ctx.rep / ctx.profile / tool.dir_name / f"{chain}-r{run}"
        self.roots = {h: str(self.base / h) for h in self.hosts}
        self.ds = ctx.dataset(spec["dataset"]) if spec["dataset"] else None
        self.selected = selected
        self.timeout = ctx.step_timeout
        # Where the scenario writes and reads on each host (a mount, for a tool that serves
        # its replicas through one); set once the tool is configured.
        self.views = dict(self.roots)

    # -- records -------------------------------------------------------------------
    def record(self, scenario, **kw):
        rec = {"ts": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "kind": "measurement", "profile": self.ctx.profile, "tool": self.tool.name,
               "scenario": scenario, "run": self.run,
               "prereq": scenario not in self.selected or not eligible(self.tool.name, scenario),
               "note": self.tool.note}
        if self.ds is not None:
            info = self.ds.info
            rec["dataset"] = {"name": info["name"], "files": info["files"],
                              "bytes": info["bytes"], "description": info["description"]}
        rec.update(kw)
        rec.setdefault("ok", rec.get("error") is None)
        self.ctx.emit(rec)
        return rec

    # -- replicas ------------------------------------------------------------------
    def prepare(self, copy_dst=False):
        if self.base.exists():  # never reuse: move an old one aside
            self.base.rename(self.base.with_name(self.base.name + f".old{time.time_ns()}"))
        self.base.mkdir(parents=True)
        src = self.roots["A"]
        if self.ds is not None and not self.spec.get("empty"):
            # A: a hard-link farm of the cached dataset (read-only use); files that a step
            # modifies in place get a private copy (copy_files).
            sh(["cp", "-al", str(self.ds.data), src], timeout=600)
            for rel in self.copy_files():
                p = Path(src, rel)
                tmp = p.with_name(p.name + ".copy")
                sh(["cp", "--preserve=all", str(p), str(tmp)], timeout=600)
                os.replace(tmp, p)
        else:
            Path(src).mkdir()
        for d in self.dsts:
            if copy_dst and self.ds is not None:
                sh(["cp", "-a", str(self.ds.data), self.roots[d]], timeout=900)
            else:
                Path(self.roots[d]).mkdir()

    def copy_files(self):
        return ["big.bin"] if self.chain == "large" else []

    # -- helpers -------------------------------------------------------------------
    def verify(self, expected=None):
        """Compare every destination with the source (content) — expected defaults to a
        fresh manifest of A."""
        src = expected if expected is not None else tree.manifest(self.views["A"])
        out, ok = {}, True
        for d in self.dsts:
            c = tree.compare(src, tree.manifest(self.views[d]))
            out[d] = c
            ok = ok and c["content_diffs"] == 0
        return ok, out

    def wait_converged(self, pred, timeout, since=None, t0=None):
        """Continuous tools: wait for the tool's own in-sync signal, as its user would
        (`meshfs status --wait-synced`, Syncthing's REST completion), then check the
        destination content once. Returns (content_time, synced_time): when the content was
        first seen right, and when the tool said it was in sync with the content right. On
        the usual path both are the moment of the signal, the check having passed right
        after it.

        The content is not polled while the tool works. A walk of the 10,000-file set costs
        ~110 ms of CPU in Python; polled at three times its cost, it took a quarter of a core
        from the tools under test (on a two-core machine where both daemons are CPU-bound)
        and saw completion up to ~0.4 s late, while one-shot tools are timed by their exit
        with no such walk. Only a tool that says it is in sync before its content is right
        (a wrong signal, or a change it has not noticed yet) gets the content polled: from
        then on, as before, until the content is right and the tool says so again."""
        tool = self.tool
        deadline = time.monotonic() + timeout
        trust_signal = True
        t_content = None
        interval = 0.05  # between `synced()` calls that said no (cheap: no walk)
        while True:
            alive = tool.daemon_procs()
            if len(alive) < len(self.hosts):
                dead = [h for h in self.hosts if h not in dict(alive)]
                raise BenchError(f"daemon on {','.join(dead)} exited: "
                                 + tail(tool.logf(f"{tool.name.split('-')[0]}-{dead[0]}"), 6)
                                 .replace("\n", " | "))
            remaining = max(1, deadline - time.monotonic())
            if trust_signal:
                try:
                    synced = tool.synced(since=since, timeout=remaining)
                except BenchError as e:
                    log(f"    synced? {e}")
                    synced = False
                if synced:
                    t_synced = time.monotonic()
                    if pred():
                        return t_synced, t_synced
                    log("    the tool said it was in sync before the content was right: "
                        "polling the content from here")
                    trust_signal = False
            else:
                if t_content is None:
                    c0 = time.monotonic()
                    if pred():
                        t_content = time.monotonic()
                    cost = time.monotonic() - c0
                    interval = max(0.02, min(1.0, 3 * cost))
                if t_content is not None:
                    try:
                        if tool.synced(since=since, timeout=remaining):
                            return t_content, time.monotonic()
                    except BenchError as e:
                        log(f"    synced? {e}")
            if time.monotonic() > deadline:
                if trust_signal:
                    raise BenchError(f"timeout after {timeout:.0f}s: the tool never reported "
                                     "in sync")
                if t_content is None:
                    raise BenchError(f"timeout after {timeout:.0f}s: destination content "
                                     "never matched")
                raise BenchError(f"timeout after {timeout:.0f}s: content matched after "
                                 f"{t_content - (t0 or t_content):.1f}s but the tool never "
                                 "reported in sync")
            time.sleep(interval)

    def make_durable(self, t1):
        """Flushes the destinations' filesystems (`sync -f`: syncfs(2)) and returns when
        their data is on disk. A tool's step is timed twice: until the destinations are
        readable (the tool says it is done), and until they are also durable (right after,
        this). meshfs makes every file durable before it reports a batch applied; rsync
        leaves its writes in the page cache. Returns t1 plus the flush's time."""
        t = time.monotonic()
        for root in sorted({str(self.roots[d]) for d in self.dsts}):
            subprocess.run(["sync", "-f", root], timeout=600, check=False)
        return t1 + (time.monotonic() - t)

    def sizes_pred(self, expected, under=None):
        def pred():
            return all(tree.sizes(self.views[d], under) == expected for d in self.dsts)
        return pred

    # -- generic transfer step -----------------------------------------------------
    def transfer(self, scenario, pred, mutate=None, expected_manifest=None, drop=False,
                 since_wall=False, timeout=None, quick_verify=None, extra=None):
        """Measure one propagation: for one-shot tools mutate (untimed) then run the tool;
        for continuous tools start the clock, mutate (or start the daemons), wait.
        quick_verify: an expected {path: size} used instead of hashing (repeated no-change
        runs; the last run is always verified by content)."""
        tool, ctx = self.tool, self.ctx
        timeout = timeout or self.timeout
        if drop and ctx.drop_caches:
            drop_caches()
        back_memory()
        meter = Meter(ctx, tool)
        client = None
        t_content = None
        if not tool.continuous:
            if mutate:
                mutate()
            t0 = meter.begin()
            client = tool.sync("A", self.dsts, timeout)
            t1 = time.monotonic()
            if client.get("error"):
                raise StepFailed(client["error"], meter.end(client), t1 - t0)
        else:
            since = time.time() if since_wall else None
            t0 = meter.begin()
            if mutate:
                mutate()
            try:
                t_content, t1 = self.wait_converged(pred, timeout, since=since, t0=t0)
            except BenchError as e:
                raise StepFailed(str(e), meter.end(), time.monotonic() - t0)
        # Right away, before the meter reads its counters: the flush's time adds to t1.
        t_durable = self.make_durable(t1)
        m = meter.end(client)
        if quick_verify is not None:
            ver = {}
            for d in self.dsts:
                got = tree.sizes(self.views[d])
                bad = sorted(k for k in set(got) | set(quick_verify)
                             if got.get(k) != quick_verify.get(k))
                ver[d] = {"content_diffs": len(bad), "content_examples": bad[:5],
                          "meta_diffs": 0, "mode": "paths+sizes"}
            ok = all(v["content_diffs"] == 0 for v in ver.values())
        else:
            ok, ver = self.verify(expected_manifest)
        rec = dict(m, wall_s=round(t1 - t0, 3), durable_s=round(t_durable - t0, 3),
                   verified=ok, verify=ver,
                   dropped_caches=bool(drop and ctx.drop_caches), **(extra or {}))
        if t_content is not None:
            rec["content_s"] = round(t_content - t0, 3)
        if not ok:
            rec["error"] = "destination differs from source: " + "; ".join(
                f"{d}: {v['content_examples'][:3]}" for d, v in ver.items() if v["content_diffs"])
        return self.record(scenario, **rec)


class StepFailed(Exception):
    def __init__(self, msg, meter_out=None, wall=None):
        super().__init__(msg)
        self.meter_out = meter_out or {}
        self.wall = wall


# ---------------------------------------------------------------------------------------
# Chains


def run_chain(ctx, tool, chain, run, selected):
    """Run one chain for one tool; every step produces a record (or a failure record)."""
    cr = ChainRun(ctx, tool, chain, run, selected)
    steps = list(cr.spec["steps"])
    done = []
    try:
        cr.prepare(copy_dst=(chain == "scan"))
        tool.configure(ctx.topo, cr.roots, cr.base / "state")
        cr.views = tool.views()
        fn = globals()[f"chain_{chain.replace('-', '_')}"]
        fn(cr, done)
    except Exception as e:  # noqa: BLE001 - a tool failure must not abort the suite
        msg = str(e) or e.__class__.__name__
        if not isinstance(e, (BenchError, StepFailed)):
            import traceback
            log(traceback.format_exc())
        log(f"  !! {tool.name} {chain} r{run}: {msg}")
        cur = _current(steps, done)
        for s in steps:
            if s in done:
                continue
            extra = {}
            if isinstance(e, StepFailed) and s == cur:
                extra = dict(e.meter_out, wall_s=round(e.wall, 3) if e.wall else None)
            cr.record(s, ok=False, error=msg if s == cur else
                      f"not run: earlier step failed ({msg[:200]})", **extra)
            done.append(s)
        return False
    finally:
        try:
            tool.stop()
        except Exception as e:  # noqa: BLE001
            log(f"  stop {tool.name}: {e}")
    return True


def _current(steps, done):
    for s in steps:
        if s not in done:
            return s
    return None


def _initial(cr, done, scenario, drop=True):
    exp = tree.sizes(cr.roots["A"])
    if not drop:
        _read_all(cr.roots["A"])
    expected_manifest = _dataset_manifest(cr)
    cr.transfer(scenario, cr.sizes_pred(exp),
                mutate=cr.tool.start if cr.tool.continuous else None,
                expected_manifest=expected_manifest, drop=drop)
    done.append(scenario)


def _dataset_manifest(cr):
    """The manifest of an unmodified source replica is the dataset's (saves hashing A)."""
    return {k: v for k, v in cr.ds.manifest.items() if not tree.is_internal(k)}


def _read_all(root):
    """Reads every file under root once, untimed: its pages are in memory for a warm run."""
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            if os.path.islink(p):
                continue
            with open(p, "rb") as fh:
                while fh.read(1 << 20):
                    pass


def chain_small(cr, done):
    _initial(cr, done, "initial-small")


def chain_small_w(cr, done):
    _initial(cr, done, "initial-small-warm", drop=False)


def chain_large_w(cr, done):
    _initial(cr, done, "initial-large-warm", drop=False)


def chain_mixed_w(cr, done):
    _initial(cr, done, "initial-mixed-warm", drop=False)


def chain_tree_w(cr, done):
    _initial(cr, done, "initial-tree-warm", drop=False)


def chain_mixed(cr, done):
    _initial(cr, done, "initial-mixed")


def chain_tree(cr, done):
    _initial(cr, done, "initial-tree")


def chain_fanout(cr, done):
    _initial(cr, done, "fanout")


def chain_fan_w(cr, done):
    _initial(cr, done, "fanout-warm", drop=False)


def chain_large(cr, done):
    _initial(cr, done, "initial-large")
    if not eligible(cr.tool.name, "delta"):  # wire-copy would copy the whole file again
        return
    path = Path(cr.views["A"], "big.bin")
    size = path.stat().st_size
    off = (size // 2) // 4096 * 4096
    rng = random.Random(1000 + cr.run)
    mid, tail_bytes = rng.randbytes(4096), rng.randbytes(1024)

    def mutate():
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, mid, off)
            os.pwrite(fd, tail_bytes, size)
        finally:
            os.close(fd)

    def pred():
        for d in cr.dsts:
            p = Path(cr.views[d], "big.bin")
            try:
                if p.stat().st_size != size + 1024:
                    return False
                with open(p, "rb") as f:
                    f.seek(off)
                    if f.read(4096) != mid:
                        return False
                    f.seek(size)
                    if f.read(1024) != tail_bytes:
                        return False
            except OSError:
                return False
        return True

    time.sleep(cr.ctx.quiet_s)
    cr.transfer("delta", pred, mutate=mutate)
    done.append("delta")


def chain_rename(cr, done):
    _initial(cr, done, "initial-rename")
    old, new = "mv100", f"mv100-renamed-r{cr.run}"
    exp = {k.replace(old, new, 1): v for k, v in tree.sizes(cr.views["A"], old).items()}
    exp[new] = "d"
    exp_sub = {k: v for k, v in exp.items() if k != new}

    def mutate():
        os.rename(Path(cr.views["A"], old), Path(cr.views["A"], new))

    def pred():
        for d in cr.dsts:
            if Path(cr.views[d], old).exists():
                return False
            if tree.sizes(cr.views[d], new) != exp_sub:
                return False
        return True

    time.sleep(cr.ctx.quiet_s)
    cr.transfer("rename", pred, mutate=mutate)
    done.append("rename")


def chain_scan(cr, done):
    """No-change re-sync of the 100k-file tree. Both sides start with identical copies;
    a seed sync (recorded as prereq) builds the tool's state; then each run re-syncs:
    one-shot tools run again, continuous tools are restarted and must report in sync."""
    tool = cr.tool
    exp = tree.sizes(cr.roots["A"])
    pred = cr.sizes_pred(exp)
    expected_manifest = _dataset_manifest(cr)
    # seed (not in the tables)
    cr.transfer("seed-scan", pred, mutate=tool.start if tool.continuous else None,
                expected_manifest=expected_manifest,
                timeout=min(cr.timeout, cr.ctx.seed_timeout))
    done.append("seed-scan")
    for r in range(1, cr.ctx.runs + 1):
        cr.run = r
        if tool.continuous:
            tool.stop()
            time.sleep(0.5)
        last = r == cr.ctx.runs
        cr.transfer("nochange", pred, mutate=tool.start if tool.continuous else None,
                    expected_manifest=expected_manifest, drop=True, since_wall=True,
                    quick_verify=None if last else exp)
    done.append("nochange")


def chain_latency(cr, done):
    tool, ctx = cr.tool, cr.ctx
    if tool.name == "unison":
        cr.record("latency", ok=None, na="n/a: Debian's unison 2.52 ships no unison-fsmonitor, "
                  "so `-repeat watch` is unavailable (a one-shot tool has no propagation "
                  "latency of its own)")
        done.extend(["seed-latency", "latency"])
        return
    # Made before the daemons start, in the replica; the samples go through the views.
    Path(cr.roots["A"], "lat").mkdir()
    Path(cr.roots["A"], "lat", "seed.txt").write_text("seed\n")
    lat = Path(cr.views["A"], "lat")
    exp = tree.sizes(cr.roots["A"])
    cr.transfer("seed-latency", cr.sizes_pred(exp),
                mutate=tool.start if tool.continuous else None)
    done.append("seed-latency")
    time.sleep(ctx.quiet_s)
    n = ctx.latency_samples
    rng = random.Random(77)
    poller = subprocess.Popen(tool.probe_argv("B", [sys.executable, "-m", "harness.poller"]),
                              cwd=str(ctx.bench_dir), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    import queue
    lines = queue.Queue()

    def reader():
        for line in poller.stdout:
            lines.put(line.strip())
        lines.put(None)

    threading.Thread(target=reader, daemon=True).start()

    def readline(timeout):
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            raise BenchError("latency poller did not answer") from None
        if line is None:
            raise BenchError("latency poller exited")
        return line

    samples, errors, starts = [], [], []
    client = {"client_cpu_s": 0.0}
    meter = Meter(ctx, tool)
    try:
        if readline(30) != "ready":
            raise BenchError("latency poller did not start")
        t_begin = meter.begin()
        for i in range(n):
            data = (f"sample {i} " + rng.randbytes(480).hex()).encode()[:1024]
            name = f"f{i:03d}.txt"
            dst = Path(cr.views["B"], "lat", name)
            poller.stdin.write(f"{dst} {len(data)} {hashlib.sha256(data).hexdigest()} "
                               f"{ctx.latency_timeout}\n")
            poller.stdin.flush()
            time.sleep(0.05)  # let the poller enter its loop
            t0 = time.monotonic_ns()
            starts.append(time.time())
            with open(lat / name, "wb") as f:
                f.write(data)
            if not tool.continuous:
                r = tool.sync("A", cr.dsts, 120)
                client["client_cpu_s"] += r.get("client_cpu_s") or 0.0
                if r.get("error"):
                    errors.append(r["error"])
            ans = readline(ctx.latency_timeout + 30).split()
            if ans[:1] == ["ok"]:
                samples.append((int(ans[1]) - t0) / 1e6)
            else:
                errors.append(f"sample {i}: not seen within {ctx.latency_timeout}s")
                if len(errors) >= 3:
                    break
            time.sleep(ctx.latency_gap_s)
        t_end = time.monotonic()
    finally:
        try:
            poller.stdin.close()
        except OSError:
            pass
        try:
            poller.wait(5)
        except subprocess.TimeoutExpired:
            poller.kill()
    m = meter.end(client if not tool.continuous else None)
    ok_v, ver = cr.verify()
    # Each sample's start in wall-clock time, to line it up with the daemons' logs
    # (MESHFS_BENCH_LOG=debug timestamps every step of a change's path).
    rec = dict(m, wall_s=round(t_end - t_begin, 3), samples_ms=[round(s, 2) for s in samples],
               starts_unix_s=[round(t, 6) for t in starts],
               n_samples=len(samples), p50_ms=pctl(samples, 50), p90_ms=pctl(samples, 90),
               verified=ok_v, verify=ver)
    if not tool.continuous:
        rec["na_note"] = "one-shot tool invoked right after each write (lower bound for " \
                         "an inotify-triggered setup)"
    if errors:
        rec["error"] = "; ".join(errors[:3])
    elif not ok_v:
        rec["error"] = "destination differs after latency samples"
    cr.record("latency", **rec)
    done.append("latency")


def chain_write(cr, done):
    """The small set written into A while the tool runs (A starts empty): `cp -a` of the
    dataset into A's view (a mount, for meshfs-mount), until every file is on B. For the
    continuous tools the clock covers the copy itself (its time is `write_s`); one-shot tools
    copy first (untimed) and are timed by their run, as everywhere."""
    write_into_a(cr, done, "write-small")


def chain_write_l(cr, done):
    """`chain_write` with the big set: one 512 MiB file copied into A until B holds it."""
    write_into_a(cr, done, "write-large")


def chain_move(cr, done):
    """The small set moved into A while the tool runs (A starts empty): the set is copied
    beside A (the same filesystem, outside the replica) and flushed, untimed; then `mv` of its
    entries into A starts the clock, until every file is on B. One-shot tools move first
    (untimed) and are timed by their run."""
    move_into_a(cr, done, "move-small")


def chain_move_l(cr, done):
    """`chain_move` with the big set: one 512 MiB file moved into A until B holds it."""
    move_into_a(cr, done, "move-large")


def move_into_a(cr, done, scenario):
    incoming = cr.base / "incoming"
    sh(["cp", "-a", "--", f"{cr.ds.data}/.", str(incoming)], timeout=cr.timeout)
    subprocess.run(["sync", "-f", str(incoming)], timeout=600, check=False)

    def place():
        entries = sorted(os.listdir(incoming))
        sh(["mv", "-t", cr.views["A"], "--"] + [str(incoming / e) for e in entries],
           timeout=cr.timeout)

    into_a(cr, done, scenario, "seed-move", place)


def write_into_a(cr, done, scenario):
    def place():
        sh(["cp", "-a", "--", f"{cr.ds.data}/.", cr.views["A"]], timeout=cr.timeout)

    into_a(cr, done, scenario, "seed-write", place)


def into_a(cr, done, scenario, seed, place):
    """A seed sync of the empty A (untimed for the tables), then `place()` puts the dataset into
    A: the step is timed from it (for one-shot tools, from their run after it) until B holds
    the set; `write_s` is what `place()` took."""
    tool = cr.tool
    cr.transfer(seed, cr.sizes_pred({}), mutate=tool.start if tool.continuous else None)
    done.append(seed)
    time.sleep(cr.ctx.quiet_s)
    exp = {k: v for k, v in cr.ds.manifest.items() if not tree.is_internal(k)}
    sizes = tree.sizes(str(cr.ds.data))
    extra = {}

    def mutate():
        t = time.monotonic()
        place()
        extra["write_s"] = round(time.monotonic() - t, 3)

    cr.transfer(scenario, cr.sizes_pred(sizes), mutate=mutate, expected_manifest=exp,
                extra=extra)
    done.append(scenario)
