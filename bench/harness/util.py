"""Process management, timing and small helpers shared by the harness.

Everything the harness starts in the background goes through `PROCS` so that it can be
stopped on exit (atexit + signal handlers here, and `bench/run`'s EXIT trap reads the pid
file as a last resort).
"""
from __future__ import annotations

import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)

LOG_FILE = None  # set by main: a file object that receives a copy of every log line


def log(*parts):
    line = time.strftime("%H:%M:%S ") + " ".join(str(p) for p in parts)
    print(line, file=sys.stderr, flush=True)
    if LOG_FILE is not None:
        LOG_FILE.write(line + "\n")
        LOG_FILE.flush()


class BenchError(Exception):
    pass


def sh(cmd, check=True, timeout=120, capture=True, env=None, input=None):
    """Run a short command (list or string) in the foreground, with a timeout."""
    if isinstance(cmd, str):
        cmd = ["bash", "-c", cmd]
    try:
        r = subprocess.run(cmd, capture_output=capture, text=True, timeout=timeout, env=env,
                           input=input)
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"timeout after {timeout}s: {shlex.join(cmd)}") from e
    if check and r.returncode != 0:
        err = (r.stderr or "").strip()[-2000:] if capture else ""
        raise BenchError(f"exit {r.returncode}: {' '.join(err.split())[:600]} "
                         f"[command: {shlex.join(cmd)[:300]}]")
    return r


# ---------------------------------------------------------------------------------------
# Background processes


class Procs:
    """Registry of background processes (each in its own process group)."""

    def __init__(self):
        self.procs: dict[int, tuple[subprocess.Popen, str]] = {}
        self.pidfile: Path | None = None
        self.lock = threading.Lock()

    def _write_pidfile(self):
        if self.pidfile:
            tmp = self.pidfile.with_suffix(".tmp")
            tmp.write_text("".join(f"{pid}\n" for pid in self.procs))
            tmp.replace(self.pidfile)

    def start(self, name, argv, log_path, env=None, cwd=None, stdin=subprocess.DEVNULL):
        logf = open(log_path, "ab")
        logf.write(f"\n=== {time.strftime('%F %T')} {shlex.join(argv)}\n".encode())
        logf.flush()
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        p = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=stdin,
                             env=full_env, cwd=cwd, start_new_session=True)
        logf.close()
        with self.lock:
            self.procs[p.pid] = (p, name)
            self._write_pidfile()
        return p

    def stop(self, p, sig=signal.SIGTERM, timeout=15.0):
        """Signal the process group, wait up to timeout, then SIGKILL it."""
        if p is None:
            return None
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log(f"  process {p.pid} did not exit after {sig!s}; SIGKILL")
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        # children left in the group (e.g. sshd sessions)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        with self.lock:
            self.procs.pop(p.pid, None)
            self._write_pidfile()
        return p.returncode

    def stop_all(self):
        for pid, (p, name) in list(self.procs.items()):
            try:
                self.stop(p, timeout=5)
            except Exception as e:  # noqa: BLE001 - best effort on exit
                log(f"  stop {name} ({pid}): {e}")


PROCS = Procs()

# pids of one-shot client processes while they run (for RSS sampling)
CLIENT_PIDS: set[int] = set()


def run_timed(argv, timeout, log_path, env=None, cwd=None):
    """Run a command to completion; return dict(rc, wall_s, cpu_s, timed_out).

    CPU time comes from wait4(2) on the child, i.e. it includes the child's reaped
    descendants (rsync's ssh, for example). (ru_maxrss is not used for memory: Linux
    carries the pre-exec address space's high-water mark of the forking parent into it;
    peak RSS is sampled from /proc/PID/status VmHWM instead, see scenarios.Meter.)
    """
    logf = open(log_path, "ab")
    logf.write(f"\n=== {time.strftime('%F %T')} {shlex.join(argv)}\n".encode())
    logf.flush()
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         env=full_env, cwd=cwd, start_new_session=True)
    logf.close()
    with PROCS.lock:
        PROCS.procs[p.pid] = (p, argv[0])
        PROCS._write_pidfile()
    CLIENT_PIDS.add(p.pid)
    result = {}

    def waiter():
        _, status, ru = os.wait4(p.pid, 0)
        result["t1"] = time.monotonic()
        result["status"] = status
        result["ru"] = ru

    th = threading.Thread(target=waiter, daemon=True)
    th.start()
    th.join(timeout)
    timed_out = th.is_alive()
    if timed_out:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        th.join(10)
    try:  # kill leftovers in the group, if any
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    with PROCS.lock:
        PROCS.procs.pop(p.pid, None)
        PROCS._write_pidfile()
    CLIENT_PIDS.discard(p.pid)
    p.returncode = 0  # reaped by us; keep Popen from trying again
    if "ru" not in result:
        return {"rc": -9, "wall_s": time.monotonic() - t0, "cpu_s": None, "timed_out": True}
    st = result["status"]
    rc = os.waitstatus_to_exitcode(st)
    ru = result["ru"]
    return {"rc": rc, "wall_s": result["t1"] - t0, "cpu_s": ru.ru_utime + ru.ru_stime,
            "timed_out": timed_out}


def tail(path, n=20):
    """Last n meaningful lines of a log (without the harness's own '=== command' lines)."""
    try:
        lines = [l for l in Path(path).read_text(errors="replace").splitlines()
                 if l.strip() and not l.startswith("=== ")]
        return "\n".join(lines[-n:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------
# /proc accounting

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid, children=True):
    """utime+stime (+cutime+cstime of reaped children) of a process, in seconds."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    ut, st, cut, cst = (int(x) for x in fields[11:15])
    total = ut + st + ((cut + cst) if children else 0)
    return total / CLK_TCK


def proc_status(pid, key):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_hwm(pid):
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def children_of(pid):
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        if int(fields[1]) == pid:
            out.append(int(d))
    return out


def descendants(pids):
    """All live descendants of the given pids (not including them)."""
    parent = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        parent[int(d)] = int(raw[raw.rindex(")") + 2:].split()[1])
    roots = set(pids)
    out = set()
    changed = True
    while changed:
        changed = False
        for pid, pp in parent.items():
            if pid not in out and pid not in roots and (pp in roots or pp in out):
                out.add(pid)
                changed = True
    return sorted(out)


def wait_no_children(pid, timeout=10.0):
    """Wait until a server master (sshd, rsyncd) has reaped all its session children, so
    that their CPU time shows up in its cutime/cstime."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not children_of(pid):
            return True
        time.sleep(0.05)
    return False


class RssSampler:
    """Samples VmHWM of the descendants of some root pids every `interval` seconds (for
    short-lived server-side processes such as rsync's receiver, which we cannot wait4)."""

    def __init__(self, roots, interval=0.1):
        self.roots = list(roots)
        self.interval = interval
        self.peak_kb = 0
        self.stop_ev = threading.Event()
        self.th = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop_ev.is_set():
            for pid in descendants(self.roots):
                v = proc_status(pid, "VmHWM")
                if v and v > self.peak_kb:
                    self.peak_kb = v
            self.stop_ev.wait(self.interval)

    def __enter__(self):
        self.th.start()
        return self

    def __exit__(self, *exc):
        self.stop_ev.set()
        self.th.join(5)


# ---------------------------------------------------------------------------------------
# Sockets inside a network namespace (setns only affects the calling thread, and a socket
# stays in the namespace where it was created).


def socket_in_netns(ns, family=socket.AF_INET, type_=socket.SOCK_STREAM):
    box = {}

    def work():
        try:
            fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {ns}")
            finally:
                os.close(fd)
            box["s"] = socket.socket(family, type_)
        except Exception as e:  # noqa: BLE001
            box["e"] = e

    th = threading.Thread(target=work)
    th.start()
    th.join()
    if "e" in box:
        raise box["e"]
    return box["s"]


def tcp_port_open(ns, host, port, timeout=1.0):
    s = socket_in_netns(ns)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def port_listening(ns, port, udp=False):
    """True if something listens on `port` inside netns `ns` (no connection is made)."""
    r = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Hln" + ("u" if udp else "t"),
                        f"sport = :{port}"], capture_output=True, text=True, timeout=10)
    return r.returncode == 0 and bool(r.stdout.strip())


def http_json(ns, host, port, path, headers=None, timeout=5.0):
    """GET http://host:port/path from inside netns `ns`; returns parsed JSON."""
    s = socket_in_netns(ns)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
        hdrs = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n{hdrs}\r\n".encode())
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    finally:
        s.close()
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0]
    if b" 200 " not in status + b" ":
        raise BenchError(f"HTTP {status.decode(errors='replace')} for {path}: {body[:200]!r}")
    return json.loads(body)


def wait_until(pred, timeout, interval=0.1, what="condition"):
    deadline = time.monotonic() + timeout
    last_exc = None
    while True:
        try:
            if pred():
                return True
        except Exception as e:  # noqa: BLE001 - keep polling until the deadline
            last_exc = e
        if time.monotonic() >= deadline:
            raise BenchError(f"timeout after {timeout:.0f}s waiting for {what}"
                             + (f" (last error: {last_exc})" if last_exc else ""))
        time.sleep(interval)


def drop_caches():
    subprocess.run(["sync"], timeout=600)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


# How much memory back_memory() touches before a step: what the largest step's page cache takes
# (the fan-out: one 512 MiB file read on A and written on three peers) with room to spare.
BACK_MEMORY_BYTES = 4 << 30


def back_memory():
    """Writes and deletes BACK_MEMORY_BYTES in /dev/shm (untimed, before a step): this VM hands
    the memory freed by a page-cache drop or a deleted replica back to its host, and the next
    step to fill the page cache then paid a host fault per page (`copy_folio_from_iter_atomic`
    30 % of a receiver's samples, a 512 MiB fetch 1.7 s instead of 0.75 s, for every tool alike:
    the bimodal large rows). Pages freed here are the first the kernel hands out again."""
    shm = Path("/dev/shm")
    try:
        st = os.statvfs(shm)
    except OSError:
        return
    n = min(BACK_MEMORY_BYTES, st.f_bavail * st.f_frsize - (1 << 30))
    if n <= 0:
        return
    path = shm / f"meshfs-bench-back-{os.getpid()}"
    block = bytes(1 << 20)
    try:
        with open(path, "wb") as f:
            for _ in range(n >> 20):
                f.write(block)
    except OSError:
        pass
    finally:
        path.unlink(missing_ok=True)


def loadavg():
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return None


def du_bytes(path):
    total = 0
    for root, dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total
