"""meshfs benchmark suite driver (normally started by bench/run).

    python3 -m harness [--quick] [--profile lan|wan|all] [--tools a,b] [--scenarios x,y]
                       [--runs N] [--work DIR] ...
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from . import datasets, report, scenarios, tools, util
from .netns import Topology, cleanup_stale
from .scenarios import CHAIN_ORDER, CHAINS, SCENARIOS, eligible
from .util import PROCS, BenchError, log, sh

BENCH_DIR = Path(__file__).resolve().parent.parent
REPO = BENCH_DIR.parent


class Ctx:
    pass


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="bench/run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="1 run each, small datasets, 5 latency samples (smoke test)")
    ap.add_argument("--profile", default="all", choices=["lan", "wan", "all"])
    ap.add_argument("--tools", default=",".join(tools.ALL_TOOLS))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help="comma list of: " + ", ".join(SCENARIOS))
    ap.add_argument("--runs", type=int, default=None, help="runs per measurement (default 3, "
                    "--quick: 1)")
    ap.add_argument("--work", default=os.environ.get("MESHFS_BENCH_WORK", "/var/tmp/meshfs-bench"),
                    help="datasets cache, replicas, keys (default /var/tmp/meshfs-bench)")
    ap.add_argument("--results", default=str(BENCH_DIR / "results"))
    ap.add_argument("--meshfs-bin", default=None)
    ap.add_argument("--wire-bin", default=None,
                    help="wire_copy (tool wire-copy; default: the release example beside meshfs)")
    ap.add_argument("--netdelay-bin", default=str(BENCH_DIR / "netdelay/target/release/netdelay"))
    ap.add_argument("--timeout", type=float, default=None,
                    help="per-step timeout in seconds (default 600, --quick: 180)")
    ap.add_argument("--latency-samples", type=int, default=None, help="default 20 (--quick: 5)")
    ap.add_argument("--seed-timeout", type=float, default=300.0,
                    help="timeout of the (untimed) seed sync of the no-change scenario (300 s)")
    ap.add_argument("--no-drop-caches", action="store_true")
    ap.add_argument("--keep-replicas", action="store_true")
    ap.add_argument("--cooldown", type=float, default=60.0,
                    help="seconds to wait after deleting replicas mid-run (ext4 discard)")
    ap.add_argument("--min-free-gb", type=float, default=None)
    ap.add_argument("--net-seconds", type=int, default=None,
                    help="iperf3 duration for the network check (default 10, --quick: 3)")
    a = ap.parse_args(argv)
    a.tools = [t for t in a.tools.split(",") if t]
    a.scenarios = [s for s in a.scenarios.split(",") if s]
    for s in a.scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s}")
    for t in a.tools:
        try:
            tools.make(t, _dummy_ctx())
        except BenchError as e:
            ap.error(str(e))
    return a


def _dummy_ctx():
    c = Ctx()
    c.meshfs_bin = "meshfs"
    c.wire_bin = "wire_copy"
    c.versions = {}
    c.work = Path("/nonexistent")
    return c


def versions(meshfs_bin):
    def first(cmd):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
            return ((r.stdout or "") + (r.stderr or "")).strip().splitlines()[0]
        except Exception as e:  # noqa: BLE001
            return f"unavailable ({e})"
    v = {
        "rsync": first(["rsync", "--version"]),
        "ssh": first(["ssh", "-V"]),
        "syncthing": first(["syncthing", "--version"]),
        "unison": first(["unison", "-version"]),
        "iperf3": first(["iperf3", "--version"]),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "meshfs": first([str(meshfs_bin), "--version"]) if Path(meshfs_bin).exists()
        else "not built",
        "meshfs_built": time.strftime("%Y-%m-%d %H:%M", time.localtime(
            Path(meshfs_bin).stat().st_mtime)) if Path(meshfs_bin).exists() else None,
        "meshfs_commit": _git_head(),
    }
    try:
        cpu = [l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
               if l.startswith("model name")]
        v["cpu"] = f"{cpu[0]} x{len(cpu)}" if cpu else "?"
    except OSError:
        pass
    try:
        v["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    try:
        v["os"] = [l.split("=", 1)[1].strip('"') for l in
                   Path("/etc/os-release").read_text().splitlines()
                   if l.startswith("PRETTY_NAME=")][0]
    except (OSError, IndexError):
        pass
    v["syncthing_short"] = v["syncthing"].split()[1] if v["syncthing"].startswith("syncthing") \
        else v["syncthing"]
    return v


def _git_head():
    try:
        r = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %s"],
                           capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return (r.stdout.strip() or "no commit") + (" (+ uncommitted changes)" if dirty else "")
    except Exception:  # noqa: BLE001
        return None


def find_meshfs(arg, rel="meshfs"):
    """--meshfs-bin, or `rel` under the release directory of the shared target dir."""
    if arg:
        return Path(arg)
    target = os.environ.get("CARGO_TARGET_DIR")
    if not target:
        try:
            r = subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"],
                               cwd=REPO, capture_output=True, text=True, timeout=60)
            target = json.loads(r.stdout)["target_directory"]
        except Exception:  # noqa: BLE001
            target = str(REPO / "target")
    return Path(target) / "release" / rel


def snapshot_meshfs(path: Path, bindir: Path, stamp: str, name="meshfs") -> Path:
    """Copy the meshfs binary aside for this run: the shared target dir is rebuilt by other
    work all the time, and a binary swapped between two steps (e.g. seed and restart)
    would measure two different builds."""
    if not path.exists():
        return path
    bindir.mkdir(parents=True, exist_ok=True)
    for old in bindir.glob(f"{name}-*"):
        try:
            old.unlink()
        except OSError:
            pass
    dst = bindir / f"{name}-{stamp}"
    shutil.copy2(path, dst)
    return dst


def main(argv=None):
    a = parse_args(argv if argv is not None else sys.argv[1:])
    if os.geteuid() != 0:
        sys.exit("bench: must run as root (network namespaces, drop_caches)")
    ctx = Ctx()
    ctx.bench_dir = BENCH_DIR
    ctx.quick = a.quick
    ctx.runs = a.runs or (1 if a.quick else 3)
    ctx.step_timeout = a.timeout or (180 if a.quick else 600)
    ctx.latency_samples = a.latency_samples or (5 if a.quick else 20)
    ctx.latency_timeout = 60
    ctx.latency_gap_s = 0.5
    ctx.quiet_s = 1.0 if a.quick else 2.0
    ctx.seed_timeout = a.seed_timeout
    ctx.drop_caches = not a.no_drop_caches
    ctx.cooldown = a.cooldown
    ctx.work = Path(a.work)
    ctx.work.mkdir(parents=True, exist_ok=True)
    # One suite at a time: namespaces, ports and the pid file are fixed names. bench/run
    # takes this lock itself (before installing its cleanup trap) and says so.
    if os.environ.get("MESHFS_BENCH_LOCKED") != "1":
        import fcntl
        lockf = open(ctx.work / "bench.lock", "w")
        try:
            fcntl.flock(lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            sys.exit(f"bench: another benchmark run holds {ctx.work / 'bench.lock'}")
        ctx._lock = lockf
    stamp = datetime.now().strftime("%Y-%m-%d_%H%M%S") + ("_quick" if a.quick else "")
    ctx.results_dir = Path(a.results) / stamp
    ctx.results_dir.mkdir(parents=True, exist_ok=True)
    ctx.rep = ctx.work / "replicas" / stamp
    ctx.rep.mkdir(parents=True, exist_ok=True)
    ctx.min_free = (a.min_free_gb if a.min_free_gb is not None else (5 if a.quick else 25)) * 2**30
    ctx.meshfs_bin = snapshot_meshfs(find_meshfs(a.meshfs_bin), ctx.work / "bin", stamp)
    ctx.versions = versions(ctx.meshfs_bin)
    ctx.wire_bin = snapshot_meshfs(find_meshfs(a.wire_bin, "examples/wire_copy"),
                                   ctx.work / "bin", stamp, "wire_copy")
    util.LOG_FILE = open(ctx.results_dir / "bench.log", "a")
    PROCS.pidfile = ctx.work / "bench.pids"
    results_path = ctx.results_dir / "results.jsonl"
    out = open(results_path, "a")

    def emit(rec):
        rec.setdefault("date", stamp)
        out.write(json.dumps(rec) + "\n")
        out.flush()
        if rec.get("kind") == "measurement":
            if rec.get("na"):
                status = "n/a"
            elif rec.get("ok"):
                status = "ok"
            else:
                status = "FAIL " + str(rec.get("error"))[:300]
            extra = ""
            if rec.get("p50_ms") is not None:
                extra = f" p50 {rec['p50_ms']:.0f} ms p90 {rec['p90_ms']:.0f} ms"
            wb = rec.get("wire_bytes")
            log(f"  = {rec['profile']} {rec['tool']} {rec['scenario']} r{rec['run']}: "
                f"{rec.get('wall_s')} s{extra}, wire {wb / 1e6 if wb else 0:.1f} MB, "
                f"cpu {rec.get('cpu_s')} s, rss {rec.get('peak_rss_kb')} kB, {status}")

    ctx.emit = emit
    ds_cache = {}

    def dataset(name):
        if name not in ds_cache:
            ds_cache[name] = datasets.get(ctx.work, ctx.quick, name)
        return ds_cache[name]

    ctx.dataset = dataset

    def cleanup(*_):
        PROCS.stop_all()
        cleanup_stale()
        try:
            subprocess.run(["ip", "netns", "del", "mfsb-hub"], capture_output=True, timeout=10)
        except Exception:  # noqa: BLE001
            pass

    atexit.register(cleanup)

    def on_signal(signum, _frame):
        log(f"signal {signum}: cleaning up")
        cleanup()
        os._exit(130)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    meta = {"date": stamp, "args": vars(a), "versions": ctx.versions, "runs": ctx.runs,
            "quick": ctx.quick, "drop_caches": ctx.drop_caches,
            "step_timeout_s": ctx.step_timeout, "latency_samples": ctx.latency_samples,
            "hostname": platform.node()}
    selected = set(a.scenarios)
    chains = [c for c in CHAIN_ORDER if any(s in selected for s in CHAINS[c]["steps"])]
    log(f"bench {stamp}: tools {a.tools}, scenarios {sorted(selected)}, runs {ctx.runs}, "
        f"profile {a.profile}; results in {ctx.results_dir}")
    log(f"versions: {json.dumps(ctx.versions)}")
    # datasets first (cached)
    for c in chains:
        if CHAINS[c]["dataset"]:
            dataset(CHAINS[c]["dataset"])
    meta["datasets"] = {n: d.info for n, d in ds_cache.items()}
    (ctx.results_dir / "meta.json").write_text(json.dumps(meta, indent=2))

    profiles = ["lan", "wan"] if a.profile == "all" else [a.profile]
    t_start = time.monotonic()
    try:
        for prof in profiles:
            run_profile(ctx, prof, a, chains, selected)
    finally:
        PROCS.stop_all()
        cleanup_stale()
        out.close()
        meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
        (ctx.results_dir / "meta.json").write_text(json.dumps(meta, indent=2))
        md = report.write_report(ctx.results_dir)
        print(md, flush=True)
        log(f"results: {results_path}")
        log(f"report:  {ctx.results_dir / 'report.md'} (+ charts *.png)")
        if not a.keep_replicas:
            log(f"deleting replicas under {ctx.rep} (this can take a few minutes)")
            shutil.rmtree(ctx.rep, ignore_errors=True)
            shutil.rmtree(ctx.work / "trash", ignore_errors=True)


def run_profile(ctx, prof, a, chains, selected):
    ctx.profile = prof
    topo = Topology(prof, ctx.work, Path(a.netdelay_bin))
    ctx.topo = topo
    timeouts = {}
    try:
        topo.setup()
        secs = a.net_seconds or (3 if ctx.quick else 10)
        log(f"[{prof}] network check (ping, iperf3 TCP/UDP {secs}s each)")
        net = topo.verify(seconds=secs)
        ctx.emit({"kind": "network", **net})
        log(f"[{prof}] network: {json.dumps(net)}")
        for chain in chains:
            steps = CHAINS[chain]["steps"]
            chain_tools = [t for t in a.tools
                           if any(s in selected and eligible(t, s) for s in steps)]
            if not chain_tools:
                continue
            once = chain in ("scan", "latency")
            runs = [1] if once else list(range(1, ctx.runs + 1))
            skip_chain = set()
            for run in runs:
                for tname in chain_tools:
                    tool = tools.make(tname, ctx)
                    if timeouts.get(tname, 0) >= 2 or tname in skip_chain:
                        why = ("skipped: the tool timed out twice in this profile"
                               if timeouts.get(tname, 0) >= 2 else
                               "skipped: run 1 of this scenario timed out")
                        for s in steps:
                            if s in selected and eligible(tname, s):
                                ctx.emit({"kind": "measurement", "profile": prof, "tool": tname,
                                          "scenario": s, "run": run, "ok": False, "error": why,
                                          "prereq": False, "skipped": True})
                        continue
                    maybe_purge(ctx)
                    log(f"[{prof}] {tname}: {chain} run {run}/{len(runs) if not once else ctx.runs}")
                    n_before = _count_timeouts(ctx, prof, tname)
                    scenarios.run_chain(ctx, tool, chain, run, selected)
                    if _count_timeouts(ctx, prof, tname) > n_before:
                        timeouts[tname] = timeouts.get(tname, 0) + 1
                        skip_chain.add(tname)
    finally:
        topo.teardown()


def _count_timeouts(ctx, prof, tname):
    n = 0
    try:
        for line in open(ctx.results_dir / "results.jsonl"):
            r = json.loads(line)
            if r.get("profile") == prof and r.get("tool") == tname and \
                    "timeout" in str(r.get("error") or "") and not r.get("skipped"):
                n += 1
    except OSError:
        pass
    return n


def maybe_purge(ctx):
    free = shutil.disk_usage(ctx.work).free
    if free >= ctx.min_free:
        return
    log(f"disk: {free / 2**30:.1f} GiB free < {ctx.min_free / 2**30:.0f} GiB: deleting old "
        f"replicas, then {ctx.cooldown:.0f}s cool-down (ext4 discard slows file creation)")
    trash = ctx.work / "trash"
    trash.mkdir(exist_ok=True)
    ctx.rep.rename(trash / f"{ctx.rep.name}-{time.time_ns()}")
    ctx.rep.mkdir(parents=True)
    shutil.rmtree(trash, ignore_errors=True)
    subprocess.run(["sync"], timeout=600)
    time.sleep(ctx.cooldown)


if __name__ == "__main__":
    main()
