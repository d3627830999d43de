"""Drivers for the synchronizers under test.

Two kinds:
* one-shot tools (rsync over ssh, rsync daemon, unison over ssh): `sync()` runs the
  transfer from the source host to every destination (in parallel for fan-out) and returns
  when it is done;
* continuous tools (meshfs, Syncthing): `start()` starts one daemon per host; changes
  propagate by themselves; `synced()` asks the tool whether it considers itself in sync.

Every driver runs its processes inside the hosts' network namespaces (`ip netns exec`).
"""
from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from .netns import HOSTS, ip_of, ns_of
from .util import (PROCS, BenchError, http_json, log, port_listening, proc_cpu, proc_status,
                   reset_hwm, run_timed, sh, tail, wait_no_children, wait_until)


class Tool:
    name = "?"
    continuous = False
    note = ""
    short_name = None

    @property
    def dir_name(self):
        """The directory of its replicas under the profile's directory."""
        return self.short_name or self.name

    def __init__(self, ctx):
        self.ctx = ctx
        self.topo = None
        self.roots = {}
        self.state = None
        self.hosts = []

    # configure() is called once per chain-run with fresh replica directories.
    def configure(self, topo, roots: dict, state: Path):
        self.topo, self.roots, self.state = topo, dict(roots), state
        self.hosts = list(roots)
        state.mkdir(parents=True, exist_ok=True)

    def logf(self, what):
        return self.state / f"{what}.log"

    def views(self):
        """{host: directory} where the scenarios write and read on each host: the replica
        directory itself, except for a tool that serves it through a mount."""
        return dict(self.roots)

    def probe_argv(self, host, argv):
        """argv to run a probe (the latency poller) on `host`, seeing that host's views."""
        return self.topo.exec_argv(host, argv)

    # --- accounting (CPU seconds and peak RSS of the tool's own processes) ------------
    def daemon_procs(self):
        """[(host, Popen)] of long-running tool processes (daemons or servers)."""
        return []

    def cpu_snapshot(self):
        return {f"{h}:{p.pid}": proc_cpu(p.pid) or 0.0 for h, p in self.daemon_procs()}

    def reset_peaks(self):
        for _, p in self.daemon_procs():
            reset_hwm(p.pid)

    def peaks(self):
        return {h: proc_status(p.pid, "VmHWM") for h, p in self.daemon_procs()}

    def settle(self):
        """Before reading counters after a measurement: let servers reap their sessions."""
        for _, p in self.daemon_procs():
            wait_no_children(p.pid, timeout=10)

    def stop(self):
        for _, p in self.daemon_procs():
            PROCS.stop(p, timeout=20)


# =====================================================================================
# ssh server (for rsync over ssh and unison)


class SshServers:
    PORT = 2222

    def __init__(self, ctx, state: Path):
        self.ctx = ctx
        self.state = state
        self.procs = {}
        keys = ctx.work / "keys"
        keys.mkdir(parents=True, exist_ok=True)
        self.client_key = keys / "client_ed25519"
        self.host_key = keys / "host_ed25519"
        for k in (self.client_key, self.host_key):
            if not k.exists():
                sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "meshfs-bench",
                    "-f", str(k)])
        self.authorized = keys / "authorized_keys"
        self.authorized.write_text(Path(str(self.client_key) + ".pub").read_text())
        os.chmod(self.authorized, 0o600)

    def ssh_args(self):
        return ["-p", str(self.PORT), "-i", str(self.client_key), "-o",
                "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o",
                "BatchMode=yes", "-o", "LogLevel=ERROR", "-o", "Compression=no"]

    def start(self, topo, hosts):
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        for h in hosts:
            conf = self.state / f"sshd-{h}.conf"
            conf.write_text("\n".join([
                f"Port {self.PORT}", f"ListenAddress {ip_of(h)}", f"HostKey {self.host_key}",
                f"AuthorizedKeysFile {self.authorized}", "PermitRootLogin prohibit-password",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
                "StrictModes no", "PidFile none", "UseDNS no", "PrintMotd no",
                "LogLevel ERROR", "MaxStartups 100:30:200", "MaxSessions 50", ""]))
            self.procs[h] = PROCS.start(f"sshd-{h}", topo.exec_argv(
                h, ["/usr/sbin/sshd", "-D", "-e", "-f", str(conf)]), self.state / f"sshd-{h}.log")
        for h in hosts:
            wait_until(lambda: port_listening(ns_of(h), self.PORT) or
                       self.procs[h].poll() is not None, 15, what=f"sshd on {h}")
            if self.procs[h].poll() is not None:
                raise BenchError(f"sshd on {h} exited: {tail(self.state / f'sshd-{h}.log')}")


# =====================================================================================


class RsyncSsh(Tool):
    name = "rsync-ssh"
    note = "rsync -a --delete over ssh (AES-128-GCM, else OpenSSH's defaults)"

    def configure(self, topo, roots, state):
        super().configure(topo, roots, state)
        self.ssh = SshServers(self.ctx, state)
        self.ssh.start(topo, self.hosts[1:])

    def daemon_procs(self):
        return list(self.ssh.procs.items())

    def _argv(self, src, dst):
        # AES-128-GCM, the cipher issue #46 states its target against (and the suite meshfs
        # seals with, D104); OpenSSH's default is ChaCha20-Poly1305.
        args = self.ssh.ssh_args() + ["-c", "aes128-gcm@openssh.com"]
        e = "ssh " + " ".join(shlex.quote(a) for a in args)
        return self.topo.exec_argv(src, ["rsync", "-a", "--delete", "-e", e,
                                         self.roots[src] + "/",
                                         f"root@{ip_of(dst)}:{self.roots[dst]}/"])

    def sync(self, src, dsts, timeout):
        return run_parallel({d: self._argv(src, d) for d in dsts}, timeout, self)


class Served(Tool):
    """A one-shot tool with a server process on each destination (`procs`)."""
    PORT = 0

    def start_servers(self, argv_of, udp=False):
        """Starts `argv_of(h)` in each destination's namespace (its log `NAME-h.log`) and waits
        until it listens on PORT."""
        self.procs = {}
        for h in self.hosts[1:]:
            self.procs[h] = PROCS.start(f"{self.name}-{h}", self.topo.exec_argv(h, argv_of(h)),
                                        self.state / f"{self.name}-{h}.log")
        for h in self.hosts[1:]:
            wait_until(lambda: port_listening(ns_of(h), self.PORT, udp=udp) or
                       self.procs[h].poll() is not None, 15, what=f"{self.name} on {h}")
            if self.procs[h].poll() is not None:
                raise BenchError(f"{self.name} on {h} exited: "
                                 f"{tail(self.state / f'{self.name}-{h}.log')}")

    def daemon_procs(self):
        return list(self.procs.items())


class Rsyncd(Served):
    name = "rsyncd"
    note = "rsync -a --delete to an rsync daemon (no encryption)"
    PORT = 8730

    def configure(self, topo, roots, state):
        super().configure(topo, roots, state)

        def argv(h):
            conf = state / f"rsyncd-{h}.conf"
            conf.write_text("\n".join([
                # chroot: without it the daemon sanitizes absolute symlink targets
                "use chroot = yes", "munge symlinks = no", "numeric ids = yes",
                "max connections = 0", "[bench]", f"  path = {roots[h]}", "  read only = no",
                "  uid = root", "  gid = root", ""]))
            return ["rsync", "--daemon", "--no-detach", f"--config={conf}", f"--address={ip_of(h)}",
                    f"--port={self.PORT}", f"--log-file={state / f'rsyncd-{h}.xfer.log'}"]
        self.start_servers(argv)

    def sync(self, src, dsts, timeout):
        return run_parallel({d: self.topo.exec_argv(src, [
            "rsync", "-a", "--delete", self.roots[src] + "/",
            f"rsync://{ip_of(d)}:{self.PORT}/bench/"]) for d in dsts}, timeout, self)


class WireCopy(Served):
    """The floor under the transfer rows: meshfs's own transport (QUIC, TLS 1.3, the daemon's
    tuning) carrying a plain copy of the tree, no chunking, hashing, journal or fsync
    (`daemon/examples/wire_copy.rs`). One sender process per destination, like rsync."""
    name = "wire-copy"
    note = "meshfs's transport alone: a plain copy over its QUIC endpoint (examples/wire_copy)"
    PORT = 22010

    def _home(self, h):
        return str(self.state / f"wire-{h}")

    def _id(self, h):
        return sh([str(self.ctx.wire_bin), "id", self._home(h)], timeout=30).stdout.strip()

    # The carrier's flag for both ends: none for QUIC, ["--tcp"] for WireCopyTcp.
    CARRIER = []

    def configure(self, topo, roots, state):
        super().configure(topo, roots, state)
        if not Path(self.ctx.wire_bin).exists():
            raise BenchError(f"{self.ctx.wire_bin} is not built (cargo build --release "
                             "-p meshfs-daemon --example wire_copy)")
        self.ids = {h: self._id(h) for h in self.hosts}
        self.start_servers(lambda h: [str(self.ctx.wire_bin), "serve", *self.CARRIER,
                                      self._home(h), f"{ip_of(h)}:{self.PORT}", roots[h],
                                      self.ids["A"]],
                           udp=not self.CARRIER)

    def sync(self, src, dsts, timeout):
        return run_parallel({d: self.topo.exec_argv(src, [
            str(self.ctx.wire_bin), "send", *self.CARRIER, self._home(src),
            f"{ip_of(d)}:{self.PORT}", self.ids[d], self.roots[src]]) for d in dsts}, timeout, self)


class WireCopyTcp(WireCopy):
    """The same copy over one TCP connection with TLS 1.3 in userspace (rustls), the same
    identities and checks (`wire_copy --tcp`): what another carrier would give meshfs, for the
    transport decision (issue #46, docs/decisions.md)."""
    name = "wire-copy-tcp"
    note = "the same plain copy over TCP + TLS 1.3 (rustls), same identities (examples/wire_copy --tcp)"
    PORT = 22011
    CARRIER = ["--tcp"]


class Unison(Tool):
    name = "unison"
    note = "unison -batch -auto -times over ssh, one invocation"

    def configure(self, topo, roots, state):
        super().configure(topo, roots, state)
        self.ssh = SshServers(self.ctx, state)
        self.ssh.start(topo, self.hosts[1:])
        src = self.hosts[0]
        self.udirs = {}
        for h in self.hosts[1:]:
            # archives of the client side (one dir per destination) and of the server side
            cdir = state / f"unison-{src}-{h}"
            sdir = state / f"unison-server-{h}"
            cdir.mkdir(exist_ok=True)
            sdir.mkdir(exist_ok=True)
            wrapper = state / f"unison-server-{h}.sh"
            wrapper.write_text(f"#!/bin/sh\nUNISON={shlex.quote(str(sdir))}\nexport UNISON\n"
                               "exec /usr/bin/unison \"$@\"\n")
            wrapper.chmod(0o755)
            sshargs = " ".join(self.ssh.ssh_args())
            (cdir / "bench.prf").write_text("\n".join([
                f"root = {roots[src]}", f"root = ssh://root@{ip_of(h)}/{roots[h]}",
                "batch = true", "auto = true", "times = true", "confirmbigdel = false",
                f"sshargs = {sshargs}", f"servercmd = {wrapper}",
                f"logfile = {state / f'unison-{h}.ulog'}", ""]))
            self.udirs[h] = cdir

    def daemon_procs(self):
        return list(self.ssh.procs.items())

    def sync(self, src, dsts, timeout):
        return run_parallel({d: self.topo.exec_argv(src, [
            "env", f"UNISON={self.udirs[d]}", "HOME=" + str(self.state), "unison", "bench",
            "-silent"]) for d in dsts}, timeout, self)


def run_parallel(argvs: dict, timeout, tool):
    """Run one command per destination concurrently; returns a summary dict."""
    import threading
    results = {}

    def one(d, argv):
        results[d] = run_timed(argv, timeout, tool.logf(f"{tool.name}-client-{d}"))

    ths = [threading.Thread(target=one, args=(d, a)) for d, a in argvs.items()]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    errs = []
    for d, r in results.items():
        if r["timed_out"]:
            errs.append(f"{d}: timed out after {timeout}s")
        elif r["rc"] != 0:
            errs.append(f"{d}: exit {r['rc']}: "
                        + tail(tool.logf(f"{tool.name}-client-{d}"), 5).replace("\n", " | "))
    return {"client_cpu_s": sum(r["cpu_s"] or 0 for r in results.values()),
            "error": "; ".join(errs) or None}


# =====================================================================================


class Syncthing(Tool):
    continuous = True
    GUI_PORT = 8384
    BEP_PORT = 22000

    def __init__(self, ctx, delay_s=10):
        super().__init__(ctx)
        self.delay_s = delay_s
        self.name = "syncthing" if delay_s == 10 else f"syncthing-{delay_s}s"
        self.note = f"Syncthing {ctx.versions.get('syncthing', '')}, fsWatcherDelayS={delay_s}"
        self.procs = {}
        self.apikey = secrets.token_hex(16)
        self.ids = {}
        self.started_at = None

    def configure(self, topo, roots, state):
        super().configure(topo, roots, state)
        self.procs = {}
        for h in self.hosts:
            home = state / f"st-{h}"
            sh(["syncthing", "generate", f"--home={home}", "--no-default-folder",
                "--skip-port-probing"], timeout=60)
            self.ids[h] = sh(["syncthing", "serve", f"--home={home}", "--device-id"]
                             ).stdout.strip()
        for i, h in enumerate(self.hosts):
            self._write_config(state / f"st-{h}" / "config.xml", i)
            Path(roots[h], ".stfolder").mkdir(exist_ok=True)

    def _write_config(self, path, i):
        me = self.hosts[i]
        tree = ET.parse(path)
        cfg = tree.getroot()
        opts = cfg.find("options")

        def setopt(k, v):
            el = opts.find(k)
            if el is None:
                el = ET.SubElement(opts, k)
            el.text = str(v)

        setopt("listenAddress", f"tcp://{ip_of(me)}:{self.BEP_PORT}")
        for k, v in [("globalAnnounceEnabled", "false"), ("localAnnounceEnabled", "false"),
                     ("relaysEnabled", "false"), ("natEnabled", "false"),
                     ("urAccepted", "-1"), ("urSeen", "3"), ("crashReportingEnabled", "false"),
                     ("autoUpgradeIntervalH", "0"), ("startBrowser", "false"),
                     ("setLowPriority", "false"), ("announceLANAddresses", "false"),
                     ("stunKeepaliveStartS", "0"), ("stunKeepaliveMinS", "0")]:
            setopt(k, v)
        for el in opts.findall("globalAnnounceServer"):
            opts.remove(el)
        for el in opts.findall("stunServer"):
            opts.remove(el)
        gui = cfg.find("gui")
        gui.find("address").text = f"127.0.0.1:{self.GUI_PORT}"
        gui.find("apikey").text = self.apikey
        # devices: every host knows every other; only the lower-index host has the
        # other's address, so exactly one side dials each connection.
        for el in cfg.findall("device"):
            cfg.remove(el)
        for j, h in enumerate(self.hosts):
            d = ET.SubElement(cfg, "device", {"id": self.ids[h], "name": h,
                                              "compression": "metadata", "introducer": "false",
                                              "skipIntroductionRemovals": "false",
                                              "introducedBy": ""})
            addr = f"tcp://{ip_of(h)}:{self.BEP_PORT}" if j > i else "dynamic"
            ET.SubElement(d, "address").text = addr
            ET.SubElement(d, "paused").text = "false"
            ET.SubElement(d, "autoAcceptFolders").text = "false"
        defaults = cfg.find("defaults")
        tmpl = defaults.find("folder")
        folder = ET.fromstring(ET.tostring(tmpl))
        folder.set("id", "bench")
        folder.set("label", "bench")
        folder.set("path", self.roots[me])
        folder.set("type", "sendreceive")
        folder.set("rescanIntervalS", "3600")
        folder.set("fsWatcherEnabled", "true")
        folder.set("fsWatcherDelayS", str(self.delay_s))
        for el in folder.findall("device"):
            folder.remove(el)
        for h in self.hosts:
            fd = ET.Element("device", {"id": self.ids[h], "introducedBy": ""})
            ET.SubElement(fd, "encryptionPassword").text = ""
            folder.insert(0, fd)
        cfg.insert(0, folder)
        tree.write(path)

    def start(self):
        self.started_at = time.time()
        for h in self.hosts:
            home = self.state / f"st-{h}"
            self.procs[h] = PROCS.start(f"syncthing-{h}", self.topo.exec_argv(h, [
                "syncthing", "serve", f"--home={home}", "--no-browser", "--no-restart",
                "--no-upgrade", "--logflags=3"]), self.logf(f"syncthing-{h}"),
                env={"STNORESTART": "1", "STNOUPGRADE": "1", "HOME": str(home),
                     "STMONITORED": "1"})
        for h in self.hosts:
            wait_until(lambda: self._ping(h), 60, interval=0.1, what=f"syncthing REST on {h}")

    def _ping(self, h):
        if self.procs[h].poll() is not None:
            raise BenchError(f"syncthing on {h} exited: {tail(self.logf(f'syncthing-{h}'))}")
        return self.rest(h, "/rest/system/ping").get("ping") == "pong"

    def rest(self, h, path):
        return http_json(ns_of(h), "127.0.0.1", self.GUI_PORT, path,
                         headers={"X-API-Key": self.apikey})

    def daemon_procs(self):
        return [(h, p) for h, p in self.procs.items() if p.poll() is None]

    def synced(self, since=None, timeout=None):
        """Every device: folder idle, scanned since `since` (if given), nothing needed,
        global state equal everywhere, every peer connected and 100 % complete."""
        st = {h: self.rest(h, "/rest/db/status?folder=bench") for h in self.hosts}
        for h, s in st.items():
            if s.get("state") != "idle" or s.get("needTotalItems", s.get("needFiles", 1)) != 0:
                return False
            if s.get("pullErrors", 0):
                return False
        g = {(s["globalFiles"], s["globalDirectories"], s["globalBytes"]) for s in st.values()}
        if len(g) != 1:
            return False
        if since is not None:
            for h in self.hosts:
                stats = self.rest(h, "/rest/stats/folder").get("bench", {})
                last = stats.get("lastScan", "")
                if not last or _parse_rfc3339(last) < since:
                    return False
        for h in self.hosts:
            conns = self.rest(h, "/rest/system/connections")["connections"]
            for o in self.hosts:
                if o != h and not conns.get(self.ids[o], {}).get("connected"):
                    return False
                if o != h:
                    c = self.rest(h, f"/rest/db/completion?folder=bench&device={self.ids[o]}")
                    if c.get("completion", 0) < 100 or c.get("needItems", 1) != 0:
                        return False
        return True


def _parse_rfc3339(s):
    from datetime import datetime
    s = s.strip()
    if s.endswith("Z"):
        s = s[:-1] + "+00:00"
    # trim fractional seconds to microseconds
    import re
    m = re.match(r"(.*T\d\d:\d\d:\d\d)(\.\d+)?(.*)", s)
    if m:
        frac = (m.group(2) or "")[:7]
        s = m.group(1) + frac + m.group(3)
    try:
        return datetime.fromisoformat(s).timestamp()
    except ValueError:
        return 0.0


# =====================================================================================


class MeshFS(Tool):
    name = "meshfs"
    continuous = True
    note = "meshfs daemon (this repository), release build"
    PORT = 7788

    def __init__(self, ctx):
        super().__init__(ctx)
        self.bin = str(ctx.meshfs_bin)
        self.procs = {}
        self.ids = {}

    def cli(self, h, args, timeout=60, check=True):
        home = self.state / f"mf-{h}"
        return sh(self.topo.exec_argv(h, [self.bin, "--home", str(home)] + args),
                  timeout=timeout, check=check)

    def configure(self, topo, roots, state):
        super().configure(topo, roots, state)
        if not Path(self.bin).exists():
            raise BenchError(f"{self.bin} not found (cargo build --release failed?)")
        self.procs = {}
        # Local discovery off (a binary older than discovery has no such flag, and none): the
        # bench's peers are given their addresses.
        help_text = subprocess.run([self.bin, "init", "--help"], capture_output=True, text=True).stdout
        nd = ["--no-discovery"] if "--no-discovery" in help_text else []
        for h in self.hosts:
            self.cli(h, ["init", "--name", h, "--listen", f"{ip_of(h)}:{self.PORT}"] + nd)
            out = self.cli(h, ["id"]).stdout.strip().splitlines()
            if not out:
                raise BenchError("meshfs id printed nothing")
            self.ids[h] = out[-1].strip()
            self.cli(h, ["folder", "add", roots[h], "--id", "bench"])
        for h in self.hosts:
            for o in self.hosts:
                if o != h:
                    self.cli(h, ["peer", "add", self.ids[o], "--addr", f"{ip_of(o)}:{self.PORT}",
                                 "--name", o, "--share", "bench"])

    def daemon_argv(self, h, argv):
        return self.topo.exec_argv(h, argv)

    def start(self):
        for h in self.hosts:
            home = self.state / f"mf-{h}"
            self.procs[h] = PROCS.start(f"meshfs-{h}", self.daemon_argv(
                h, [self.bin, "--home", str(home), "daemon"]), self.logf(f"meshfs-{h}"),
                env={"RUST_LOG": os.environ.get("MESHFS_BENCH_LOG", "info"), "NO_COLOR": "1"})
        for h in self.hosts:
            wait_until(lambda: self._up(h), 60, interval=0.1, what=f"meshfs daemon on {h}")

    def _up(self, h):
        if self.procs[h].poll() is not None:
            raise BenchError(f"meshfs daemon on {h} exited {self.procs[h].returncode}: "
                             + tail(self.logf(f"meshfs-{h}"), 8))
        r = self.cli(h, ["status", "--json"], timeout=20, check=False)
        return r.returncode == 0

    def daemon_procs(self):
        return [(h, p) for h, p in self.procs.items() if p.poll() is None]

    def status(self, h):
        r = self.cli(h, ["status", "--json"], timeout=30, check=False)
        try:
            return json.loads(r.stdout)
        except ValueError:
            return None

    def synced(self, since=None, timeout=600):
        """`status --wait-synced` on every host (exit 0), and — where the JSON has
        'connected' fields — every peer connected (a daemon that has not connected yet is
        trivially 'in sync with every connected peer')."""
        for h in self.hosts:
            st = self.status(h)
            conn = list(_find_key(st, "connected")) if st is not None else []
            if conn and not all(v is True for v in conn):
                return False
        import threading
        rcs = {}

        def one(h):
            r = self.cli(h, ["status", "--json", "--wait-synced", "--timeout", str(int(timeout))],
                         timeout=timeout + 30, check=False)
            rcs[h] = r.returncode

        ths = [threading.Thread(target=one, args=(h,)) for h in self.hosts]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        return all(rc == 0 for rc in rcs.values())


class MeshFSMount(MeshFS):
    """meshfs with every host's folder mounted (`meshfs mount`, FUSE): the scenarios write in
    mount A and read in mount B, the replica directories behind them are only the mounts'
    backing stores. The daemons enter only their host's network namespace (not a private
    mount namespace), so their mounts are visible to the harness and the probes."""
    name = "meshfs-mount"
    # Short: the control socket's path under it must fit a Unix socket address (107 bytes).
    short_name = "mfsm"
    note = "meshfs daemon, each folder mounted (FUSE); written and read through the mounts"

    def configure(self, topo, roots, state):
        super().configure(topo, roots, state)
        self.mnts = {h: str(Path(roots[h]).parent / f"mnt-{h}") for h in self.hosts}
        for m in self.mnts.values():
            Path(m).mkdir(parents=True, exist_ok=True)

    def views(self):
        return dict(self.mnts)

    def probe_argv(self, host, argv):
        return self.topo.exec_net_argv(host, argv)

    def daemon_argv(self, h, argv):
        return self.topo.exec_net_argv(h, argv)

    def start(self):
        super().start()
        for h in self.hosts:
            self.cli(h, ["mount", "bench", self.mnts[h]])
        for h in self.hosts:
            if not _mounted(self.mnts[h]):
                raise BenchError(f"meshfs mount on {h}: {self.mnts[h]} is not a mount point")

    def stop(self):
        # SIGTERM unmounts; a daemon that died or was killed may leave a dead mount behind.
        super().stop()
        for m in getattr(self, "mnts", {}).values():
            if _mounted(m):
                log(f"  {m} still mounted after the daemon stopped: umount -l")
                sh(["umount", "-l", m], check=False)


def _mounted(path):
    """Whether `path` is a mount point in our mount namespace (a dead FUSE mount included,
    which `os.path.ismount` cannot stat)."""
    want = os.path.realpath(path)
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    return any(len(f) > 1 and f[1].replace("\\040", " ") == want
               for f in (line.split() for line in lines))


def _find_key(obj, key):
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                yield v
            else:
                yield from _find_key(v, key)
    elif isinstance(obj, list):
        for v in obj:
            yield from _find_key(v, key)


ALL_TOOLS = ["meshfs", "meshfs-mount", "rsync-ssh", "rsyncd", "syncthing", "syncthing-1s", "unison",
             "wire-copy", "wire-copy-tcp"]


def make(name, ctx):
    if name == "meshfs":
        return MeshFS(ctx)
    if name == "meshfs-mount":
        return MeshFSMount(ctx)
    if name == "rsync-ssh":
        return RsyncSsh(ctx)
    if name == "rsyncd":
        return Rsyncd(ctx)
    if name == "unison":
        return Unison(ctx)
    if name == "wire-copy":
        return WireCopy(ctx)
    if name == "wire-copy-tcp":
        return WireCopyTcp(ctx)
    if name == "syncthing":
        return Syncthing(ctx, 10)
    if name.startswith("syncthing-") and name.endswith("s"):
        return Syncthing(ctx, int(name[len("syncthing-"):-1]))
    raise BenchError(f"unknown tool {name}")
