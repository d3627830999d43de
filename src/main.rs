//! `meshfs`: the command-line interface. Parses arguments, edits the config, talks to the
//! running daemon over its control socket, reads the journal, and runs the daemon itself.
//! See `docs/cli.md` for every command and `--json` field.

mod config_check;
mod demo;
mod journal_cmd;
mod ondemand_cmd;
mod package_assets;
mod status_cmd;
mod status_pending;
mod status_watch;
mod ui_cmd;
mod versions_cmd;

use anyhow::{anyhow, bail, Context as _};
use clap::{CommandFactory, Parser, Subcommand};
use meshfs_daemon::config::{Config, FolderConfig, FreeFloor, Home, PeerConfig, DEFAULT_LISTEN};
use meshfs_daemon::control::{self, Request};
use meshfs_daemon::identity::Identity;
use meshfs_daemon::readout::journal::printable;
use meshfs_protocol::{DeviceId, FolderId};
use std::path::PathBuf;
use std::process::ExitCode;

/// Exit code: an error (the message says what failed and what to do).
const EXIT_ERROR: u8 = 1;
// Exit code 2, bad arguments, is clap's: every argument with a shape (device id, HOST:PORT,
// folder id, log level) is checked by its value parser.
/// Exit code: the daemon is not running (commands that need one).
const EXIT_NO_DAEMON: u8 = 3;
/// Exit code: `--wait-synced` timed out.
const EXIT_TIMEOUT: u8 = 4;
/// Exit code: `--wait-synced` found a connected peer that does not share a folder back (a
/// pairing question: waiting would not end it).
const EXIT_NOT_SHARED: u8 = 5;

/// Log levels `--log-level` accepts (a typo would otherwise silence every log line).
const LOG_LEVELS: [&str; 6] = ["error", "warn", "info", "debug", "trace", "off"];

/// `meshfs daemon --help` and its man page: what it sends on the LAN, exactly (the same
/// text as docs/protocol.md, "Local discovery").
const DAEMON_HELP: &str = "Example: meshfs daemon
Logs to stderr (info level by default). Exits 1 if another daemon runs on the same home or the
listen address is in use. As a service: `systemctl --user enable --now meshfs`.

Local discovery ([discovery] local = true, the default; `init --no-discovery` or
`local = false` turns it off): unless its QUIC endpoint is bound to a loopback address, the
daemon sends one UDP datagram to port 21788 ([discovery] port) at start, 2 s later, every 30 s
and at once when one of its addresses changes: to the IPv4 broadcast address of each
interface that is up and broadcasts (loopback excluded) and, when the endpoint takes IPv6, to
the link-local multicast group ff12::6d65:7368 on each interface that multicasts. It listens
on the same port. The datagram, big-endian, nothing after the last address:
  offset 0   4 bytes   magic \"MFSA\" (4d 46 53 41)
  offset 4   1 byte    layout version, 1
  offset 5   32 bytes  device id (its 32 bytes, not the text form)
  offset 37  8 bytes   instance nonce (new after a restart or an address change)
  offset 45  2 bytes   UDP port of its QUIC endpoint (not 0)
  offset 47  1 byte    n, the number of addresses, 0-16
  offset 48  n times:  4 then an IPv4 address (4 bytes), or 6 then an IPv6 address (16 bytes)
At most 320 bytes. An announcement is a hint, not signed: a dial accepts only the pinned key
of the device it expects, so a forged one costs at most a failed dial. Addresses are kept
only for trusted devices whose address is dynamic, expire 90 s after the last announcement,
and are read at most 4 in a burst and 1 every 2 s per source, 64 in a burst and 32 a second
from all.";

#[derive(Parser)]
#[command(name = "meshfs", version, about = "Continuously synchronized folders across your devices", long_about = None,
    after_help = "Quick start on two devices:\n  A$ meshfs init --name laptop && meshfs id\n  B$ meshfs init --name server && meshfs id\n  A$ meshfs folder add ~/work --id work\n  A$ meshfs peer add <B-ID> --share work\n  B$ meshfs folder add ~/work --id work\n  B$ meshfs peer add <A-ID> --share work\n  A$ meshfs daemon    B$ meshfs daemon\n  A$ meshfs status --wait-synced\nOn one LAN the devices find each other; elsewhere give a device with a fixed name\nits address (`--addr server.example.org:7788`) and the others learn where the rest\nare from it.")]
struct Cli {
    /// Where config, keys and state live (default: XDG config and data dirs).
    #[arg(long, global = true, env = "MESHFS_HOME")]
    home: Option<PathBuf>,
    /// Log level (default: info for the daemon, warn otherwise); RUST_LOG overrides it.
    #[arg(long, global = true, value_parser = clap::builder::PossibleValuesParser::new(LOG_LEVELS))]
    log_level: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create this device's identity and config (refuses to overwrite).
    #[command(
        after_help = "Example: meshfs --home /tmp/a init --name laptop --listen 127.0.0.1:7788\n  SPBYD5N-L35BW72-NR64EQN-7PSGRHE-WPY7EXS-6WJFN6O-LT5UFPA-L7BYXQX\nPrints the new device id (and on stderr where the config is); exits 1, changing nothing, if\nthe home is already initialised."
    )]
    Init {
        /// A name for this device.
        #[arg(long)]
        name: Option<String>,
        /// UDP address for QUIC: IP:PORT or HOST:PORT (default: every address, IPv4 and IPv6).
        #[arg(long, default_value = DEFAULT_LISTEN, value_parser = parse_host_port)]
        listen: String,
        /// Local discovery off (`[discovery] local = false`): this device announces nothing on
        /// the LAN and listens for no announcement; its peers need a fixed address (`peer add
        /// --addr`) or to dial it.
        #[arg(long)]
        no_discovery: bool,
    },
    /// Print this device's id (give it to your other devices' `peer add`).
    #[command(
        after_help = "Example: meshfs id\n  SPBYD5N-L35BW72-NR64EQN-7PSGRHE-WPY7EXS-6WJFN6O-LT5UFPA-L7BYXQX\nOn a home that was never initialised it exits 1 and says to run `meshfs init`."
    )]
    Id,
    /// Replicated folders.
    #[command(
        subcommand,
        after_help = "Examples:\n  meshfs folder add ~/work --id work\n  meshfs folder list\n  meshfs folder remove work"
    )]
    Folder(FolderCmd),
    /// Known peers.
    #[command(
        subcommand,
        after_help = "Examples:\n  meshfs peer add QSXL24Z-U5YL3KP-VQSJWYR-7RR64YM-OHFT5UL-DUJDYZO-JUXOZ5B-R7IJOAP --share work\n  meshfs peer add QSXL24Z-U5YL3KP-VQSJWYR-7RR64YM-OHFT5UL-DUJDYZO-JUXOZ5B-R7IJOAP --addr server.lan:7788 --addr dynamic\n  meshfs peer list\n  meshfs peer remove QSXL24Z-U5YL3KP-VQSJWYR-7RR64YM-OHFT5UL-DUJDYZO-JUXOZ5B-R7IJOAP"
    )]
    Peer(PeerCmd),
    /// Share a folder with a known peer.
    #[command(
        after_help = "Example: meshfs share work QSXL24Z-U5YL3KP-VQSJWYR-7RR64YM-OHFT5UL-DUJDYZO-JUXOZ5B-R7IJOAP\nPrints nothing and exits 0; a running daemon reconnects to the peer, which then gets the folder."
    )]
    Share {
        /// The folder id.
        #[arg(value_parser = parse_folder_id)]
        folder: FolderId,
        /// The peer's device id.
        #[arg(value_parser = parse_device)]
        device: DeviceId,
    },
    /// Check the config without starting anything.
    #[command(subcommand, after_help = "Example: meshfs config check")]
    Config(ConfigCmd),
    /// Run the engine in the foreground until SIGINT/SIGTERM.
    #[command(
        after_help = "Example: meshfs daemon\nLogs to stderr (info level by default), e.g.\n  INFO meshfs_daemon::engine: folder scanned folder=work path=/home/u/work changes=1 ms=1\n  INFO meshfs_daemon::engine: meshfs daemon running device=SPBYD5N-L35BW72-NR64EQN-7PSGRHE-WPY7EXS-6WJFN6O-LT5UFPA-L7BYXQX listen=0.0.0.0:7788\nExits 1 if another daemon runs on the same home or the listen address is in use.\nAs a service: `systemctl --user enable --now meshfs` (the unit the package installs).",
        after_long_help = DAEMON_HELP
    )]
    Daemon,
    /// Mount a folder through the running daemon (an empty directory; the replica stays where it is).
    #[command(
        after_help = "Examples:\n  meshfs mount work ~/work   # then edit in ~/work\n  meshfs mount work /tmp/work-then --at 2026-11-27T18:50:00Z   # read-only, as it was then\nThe folder keeps syncing; `meshfs unmount work` ends the mount. To mount at every start, set `mount = \"PATH\"` in its [[folder]].\nWith --at (RFC 3339, or local time 2026-11-27 18:50:00) the mount shows the folder as this\ndevice's journal had it then, read-only; a file whose content is kept nowhere reachable is\nlisted and fails to open with ENODATA (No data available). End it with\n`meshfs unmount work /tmp/work-then`."
    )]
    Mount {
        /// The folder id.
        #[arg(value_parser = parse_folder_id)]
        folder: FolderId,
        /// Where to mount it: an existing empty directory.
        mountpoint: PathBuf,
        /// Refuse every change through the mount.
        #[arg(long)]
        read_only: bool,
        /// Let other users in (a web or Samba server, root): the kernel checks every access
        /// against the files' modes. As an ordinary user this needs `user_allow_other` in
        /// /etc/fuse.conf.
        #[arg(long)]
        allow_other: bool,
        /// Show the folder as it was at this time, read-only.
        #[arg(long, value_parser = versions_cmd::parse_time)]
        at: Option<i64>,
    },
    /// Unmount a folder (it keeps syncing), or a snapshot mounted with --at.
    #[command(
        after_help = "Examples:\n  meshfs unmount work\n  meshfs unmount work /tmp/work-then   # a snapshot (mount --at)\nPrints where it was mounted; exits 3 when no daemon runs (then nothing of it is mounted)."
    )]
    Unmount {
        /// The folder id.
        #[arg(value_parser = parse_folder_id)]
        folder: FolderId,
        /// A snapshot's mount point (`mount --at`).
        mountpoint: Option<PathBuf>,
    },
    /// Every version of a path the journal knows, and whether its content is kept here.
    #[command(
        after_help = "Examples:\n  meshfs versions work docs/report.txt\n  meshfs versions work photos --json   # a deleted directory: what was in it\nOne line per version, oldest first: sequence, time, device, op, size, hash, and where its\ncontent is: current, kept (restorable here), partial or not_here (restore asks the peers),\npruned. With --json: {\"folder\", \"path\", \"versions\": [...], \"below\": [...]} (docs/cli.md)."
    )]
    Versions {
        /// The folder id.
        #[arg(value_parser = parse_folder_id)]
        folder: FolderId,
        /// The path, relative to the folder.
        path: String,
        /// One JSON document.
        #[arg(long)]
        json: bool,
    },
    /// Bring a past version back as a new change of this device (or a tree as it was then).
    #[command(
        after_help = "Examples:\n  meshfs restore work docs/report.txt   # the newest kept version that is not the current one\n  meshfs restore work docs/report.txt --seq 1042\n  meshfs restore work photos --at 2026-11-27T18:50:00Z   # a deleted tree as it was then\n  meshfs restore work notes.txt --seq 77 --to notes-before.txt\n--at also takes a local time (2026-11-27 18:50:00). The restore is journaled and sent to every\npeer like an edit made here; content this device no longer has is fetched from a connected\npeer that keeps it. Exits 3 when no daemon runs."
    )]
    Restore(versions_cmd::RestoreArgs),
    /// A send-only folder: make this device's state win on every peer.
    #[command(
        after_help = "Example: meshfs override work\nFor every path where a peer's version was not applied here (`meshfs status` lists them),\nthis device's state is sent as a newer version. Exits 1 for a folder that is not send-only."
    )]
    Override {
        /// The folder id.
        #[arg(value_parser = parse_folder_id)]
        folder: FolderId,
    },
    /// A receive-only folder: undo the local changes, back to the shared state.
    #[command(
        after_help = "Example: meshfs revert work\nEvery path changed on this device (`meshfs status` lists them) gets the shared version back;\nthe local edits are kept as past versions (`meshfs versions`). Exits 1 for a folder that is\nnot receive-only."
    )]
    Revert {
        /// The folder id.
        #[arg(value_parser = parse_folder_id)]
        folder: FolderId,
    },
    /// An on-demand folder: keep PATH (a file, or a directory and all below it) here, and
    /// fetch now what of it is not.
    #[command(
        after_help = "Examples:\n  meshfs pin work photos/2024\n  meshfs pin work docs/report.odt --json\nPrints how many files were fetched; a file that could not be (no connected peer has it)\nis named on stderr and fetched at its next open (exit 1). A pinned file is never evicted;\na peer's new version of it is fetched as it arrives. Exits 3 when no daemon runs."
    )]
    Pin {
        /// The folder id.
        #[arg(value_parser = parse_folder_id)]
        folder: FolderId,
        /// The path, relative to the folder.
        path: String,
        /// One JSON document: {"path", "fetched", "failed": [{"path", "error", "errno"}]}.
        #[arg(long)]
        json: bool,
    },
    /// An on-demand folder: drop the pin of PATH (its files stay until the budget needs room).
    #[command(
        after_help = "Example: meshfs unpin work photos/2024\nExits 1 when PATH was not pinned itself (a pin of a directory covers what is below it)."
    )]
    Unpin {
        /// The folder id.
        #[arg(value_parser = parse_folder_id)]
        folder: FolderId,
        /// The path, relative to the folder.
        path: String,
    },
    /// An on-demand folder: free the room of what is local at or below PATH now.
    #[command(
        after_help = "Example: meshfs evict work videos\n  evicted 3 file(s) of videos in work, 2GiB freed; 120MiB of content local now (budget 1GiB)\n  kept videos/cut.mp4: open through the mount\nEvicted files stay listed (true size, mode, mtime) and are fetched again when opened.\nNever evicted: pinned files, open files, and content no connected peer is known to hold (a\nchange not acknowledged yet, a last copy); each kept file is named with why."
    )]
    Evict {
        /// The folder id.
        #[arg(value_parser = parse_folder_id)]
        folder: FolderId,
        /// The path, relative to the folder.
        path: String,
        /// One JSON document: {"evicted", "freed_bytes", "kept": [{"path", "why"}], "local_bytes", "cache_max"}.
        #[arg(long)]
        json: bool,
    },
    /// Rebuild a damaged journal: move it aside (nothing is deleted) so the next daemon start
    /// rescans every folder and reconciles with its peers; differences become conflicts.
    #[command(
        after_help = "Run it with the daemon stopped, when the daemon says the journal is damaged.\nThe change history kept in the old journal is not carried over; the files are untouched.\n\nExample: meshfs repair\n  kept the old journal as /home/u/.local/share/meshfs/journal.db.damaged-1795634291\n  the next `meshfs daemon` rescans every folder into a new journal and reconciles with its peers: files that differ become conflicts, nothing is overwritten\nExits 1 while the daemon runs."
    )]
    Repair,
    /// Rescan a folder now (the daemon also scans at start and watches for changes).
    #[command(
        after_help = "Example: meshfs scan work\n  1 change(s) journaled\nExits 3 when no daemon runs (changes are then picked up when it starts)."
    )]
    Scan {
        /// The folder id.
        #[arg(value_parser = parse_folder_id)]
        folder: FolderId,
    },
    /// Folders, peers, connections, pending work: in sync with every peer, or why not.
    #[command(
        after_help = "A folder is in sync when its own changes are recorded and every peer that shares it is\nconnected and caught up both ways. Otherwise status says why, e.g.\n  up to date with 1 of 2 peers; b offline since 10:42\n\nExamples:\n  meshfs status\n  meshfs daemon & meshfs status --wait-synced --timeout 60   # waits for the daemon too\n  meshfs status --watch                # live: done, left, rates, ETA; Ctrl-C to stop\n  meshfs status work --pending         # what waits in folder work, path by path, and why\n  meshfs status --json | jq .folders[0].in_sync\nExit codes: 0 ok/in sync, 1 error (e.g. not initialised), 3 no daemon, 4 timed out,\n5 a connected peer does not share a folder back (status says what to run on it)."
    )]
    Status {
        /// With --pending: only this folder.
        #[arg(value_parser = parse_folder_id, requires = "pending")]
        folder: Option<FolderId>,
        /// One JSON document (fields in docs/cli.md).
        #[arg(long)]
        json: bool,
        /// Wait (for the daemon to come up, then) until every folder is in sync with every
        /// peer that shares it. On a terminal a progress bar shows what is left. A connected
        /// peer that does not share a folder back ends the wait at once (exit 5), saying what
        /// to run on it.
        #[arg(long, conflicts_with_all = ["watch", "pending"])]
        wait_synced: bool,
        /// With --wait-synced: only the peers connected now count (a peer that is down is
        /// not waited for).
        #[arg(long, requires = "wait_synced")]
        connected: bool,
        /// Give up waiting after this many seconds (default 60); with --watch, stop after
        /// this many seconds (default: at Ctrl-C).
        #[arg(long)]
        timeout: Option<f64>,
        /// Refresh a view every second until Ctrl-C: per folder what is done and left, rate
        /// and ETA; per peer connection, rtt and rates. On a pipe: one plain line per second.
        #[arg(long, conflicts_with_all = ["json", "pending"])]
        watch: bool,
        /// List what waits, path by path, and why: local changes being recorded, remote
        /// versions skipped or waiting for a writer, unreadable files, and the records each
        /// peer has not acknowledged.
        #[arg(long)]
        pending: bool,
    },
    /// The change history of a folder.
    #[command(
        after_help = "Examples:\n  meshfs journal work --path docs/report.txt\n  meshfs journal work --device laptop --since 2h\n  meshfs journal work --since 1042 --follow --json"
    )]
    Journal(journal_cmd::JournalArgs),
    /// Conflict files that still exist.
    #[command(
        after_help = "Example: meshfs conflicts work\n  report.sync-conflict-20261125-191740-EXAK3F4.txt\n      belongs to report.txt; losing version by EXAK3F4 at 20261125-191740 (17 bytes); kept version by LQB2QJV (31 bytes)\nor `no conflicts in work`. With --json: an array of objects (fields in docs/cli.md)."
    )]
    Conflicts {
        /// The folder id.
        #[arg(value_parser = parse_folder_id)]
        folder: FolderId,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// A self-contained tour: two devices on loopback in a temp dir, edits, a conflict, the journal.
    #[command(
        after_help = "Example: meshfs demo\nTakes a few seconds and prints each step, e.g.\n  == a file saved on the laptop appears on the server\n  10 new files, save → readable on the server: median 9.6 ms, worst 10.8 ms\n  ...\n  demo finished; both daemons stopped\nEach folder is mounted where FUSE is usable; elsewhere the tour says so and works in the\nreplica directories. Both daemons are stopped and the directory removed at the end."
    )]
    Demo {
        /// Keep the temporary directory afterwards.
        #[arg(long)]
        keep: bool,
    },
    /// Open this device's page in the browser: folders, peers, conflicts and the journal, live.
    #[command(
        after_help = "Examples:\n  meshfs ui\n  meshfs ui --print-url\n  http://127.0.0.1:40123/?token=3f9c…\nThe running daemon serves the page on 127.0.0.1 only; the address carries a token that only\nthis user can read (it changes at each daemon start). Exits 3 when no daemon runs. To serve\nthe page from every start: `[ui] enabled = true` in the config (docs/ui.md)."
    )]
    Ui {
        /// Print the page's address (with its token) instead of opening a browser.
        #[arg(long)]
        print_url: bool,
    },
    /// Print shell completions.
    #[command(
        after_help = "Example: meshfs completions bash > ~/.local/share/bash-completion/completions/meshfs"
    )]
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Write the man pages and shell completions the package installs (for packagers).
    #[command(hide = true)]
    PackageAssets {
        /// Where to write `man/` and `completions/`.
        out: PathBuf,
    },
}

#[derive(Subcommand)]
enum ConfigCmd {
    /// Validate config.toml, the identity, the listen address and every folder path.
    #[command(
        after_help = "Example: meshfs config check\nPrints what it checked and exits 0, or names the file and field at fault and exits 1."
    )]
    Check,
}

#[derive(Subcommand)]
enum FolderCmd {
    /// Replicate the directory PATH (created if missing).
    #[command(
        after_help = "Example: meshfs folder add ~/work --id work   # prints the folder id\n  meshfs folder add ~/work --id work --on-demand-under videos --on-demand-under archive\nRefused (and nothing is created) when PATH is a file, overlaps another folder, or\ncontains or lies inside meshfs's own config or state directory.",
        group(clap::ArgGroup::new("demand").args(["on_demand", "on_demand_under"]).multiple(true))
    )]
    Add {
        /// The directory.
        path: PathBuf,
        /// The folder id shared with peers (default: random): 1-64 of A-Z a-z 0-9 . _ -
        #[arg(long, value_parser = parse_folder_id)]
        id: Option<FolderId>,
        /// Files on demand: every file is listed (true size, mode, mtime), its content
        /// fetched from a peer when it is opened (use the folder through its mount).
        #[arg(long)]
        on_demand: bool,
        /// Only this subtree (a path in the folder) on demand; everything else is kept here
        /// as a pinned path is. Repeatable; implies --on-demand.
        #[arg(long, value_name = "PATH", value_parser = ondemand_cmd::parse_subtree)]
        on_demand_under: Vec<String>,
        /// With --on-demand: keep at most this much content here (64MiB, 2GiB, bytes); the
        /// least recently used files are evicted beyond it.
        #[arg(long, value_parser = ondemand_cmd::parse_cache_max, requires = "demand")]
        cache_max: Option<u64>,
        /// With --on-demand: keep this much of the disk free by evicting (5%, 2GiB; default
        /// 5%; 0: no floor).
        #[arg(long, value_parser = ondemand_cmd::parse_min_free, requires = "demand")]
        min_free: Option<FreeFloor>,
    },
    /// Change a folder's options: files on demand and their budget.
    #[command(
        after_help = "Examples:\n  meshfs folder set work --on-demand --cache-max 20GiB\n  meshfs folder set work --on-demand-under videos   # only videos/ on demand, the rest fetched\n  meshfs folder set work --on-demand                # the whole folder on demand again\n  meshfs folder set work --cache-max none\n  meshfs folder set work --min-free 10%\n  meshfs folder set work --no-on-demand   # every file fetched again, the folder whole\nA running daemon follows at once."
    )]
    Set {
        /// The folder id.
        #[arg(value_parser = parse_folder_id)]
        id: FolderId,
        /// Files on demand from now on (new versions from peers are not fetched until opened):
        /// the whole folder, unless --on-demand-under is given.
        #[arg(long, conflicts_with = "no_on_demand")]
        on_demand: bool,
        /// Only this subtree on demand (repeatable; replaces the list; implies --on-demand):
        /// what is not local outside the subtrees is fetched now, and kept.
        #[arg(long, value_name = "PATH", value_parser = ondemand_cmd::parse_subtree, conflicts_with = "no_on_demand")]
        on_demand_under: Vec<String>,
        /// Not on demand: what is not local is fetched now, and every new version.
        #[arg(long)]
        no_on_demand: bool,
        /// The budget: a size (64MiB, 2GiB, bytes), or `none`.
        #[arg(long, value_parser = ondemand_cmd::parse_cache_max_or_none)]
        cache_max: Option<ondemand_cmd::Budget>,
        /// The disk's free floor: a share (5%), a size (2GiB), or `default` (5%).
        #[arg(long, value_parser = ondemand_cmd::parse_min_free_or_default)]
        min_free: Option<ondemand_cmd::Floor>,
    },
    /// List folders.
    #[command(
        after_help = "Example: meshfs folder list\n  work             /home/u/work  (shared with 1 peer)\nWith --json: [{\"id\": \"work\", \"path\": \"/home/u/work\", \"watch\": true, \"shared_with\": [DEVICE-ID, ...]}]"
    )]
    List {
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Stop replicating a folder (its files stay on disk).
    #[command(
        after_help = "Example: meshfs folder remove work\nPrints nothing and exits 0; a running daemon stops syncing the folder at once and ends its\nmount, if any. The files in its directory are left as they are. An unknown id exits 1."
    )]
    Remove {
        /// The folder id.
        #[arg(value_parser = parse_folder_id)]
        id: FolderId,
    },
}

#[derive(Subcommand)]
enum PeerCmd {
    /// Trust a device and (optionally) share folders with it.
    #[command(
        after_help = "Example: meshfs peer add QSXL24Z-U5YL3KP-VQSJWYR-7RR64YM-OHFT5UL-DUJDYZO-JUXOZ5B-R7IJOAP --share work\nPrints nothing and exits 0; adding a known peer again updates its addresses (when --addr is\ngiven), name and shares.\nWithout --addr the peer's address is \"dynamic\": found on the LAN (local discovery), learned\nfrom its own connections, and from other peers that reach it (a server both devices use\ntells each where the other is). --addr gives fixed addresses, e.g. for a server with a\nfixed name: `--addr server.lan:7788 --addr 10.0.0.5:7788`; add `--addr dynamic` to use both."
    )]
    Add {
        /// The peer's device id (`meshfs id` on that device).
        #[arg(value_parser = parse_device)]
        device: DeviceId,
        /// Where to reach it: HOST:PORT, or `dynamic` (wherever it is found: the default).
        /// Repeatable, or comma-separated; replaces the addresses it had.
        #[arg(long = "addr", value_parser = parse_peer_addr, value_delimiter = ',')]
        addr: Vec<String>,
        /// A name for it.
        #[arg(long)]
        name: Option<String>,
        /// Share this folder with it (repeatable).
        #[arg(long = "share")]
        share: Vec<String>,
    },
    /// List peers.
    #[command(
        after_help = "Example: meshfs peer list\n  QSXL24Z-U5YL3KP-VQSJWYR-7RR64YM-OHFT5UL-DUJDYZO-JUXOZ5B-R7IJOAP  server       192.168.1.20:7788      work\n(device id, name, addresses — \"dynamic\" for wherever it is found, \"(dials us)\" for none —,\nshared folders). With --json:\n[{\"device_id\": ..., \"name\": \"server\", \"addresses\": [\"192.168.1.20:7788\"], \"folders\": [\"work\"]}]"
    )]
    List {
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Forget a peer (it is refused from then on).
    #[command(
        after_help = "Example: meshfs peer remove QSXL24Z-U5YL3KP-VQSJWYR-7RR64YM-OHFT5UL-DUJDYZO-JUXOZ5B-R7IJOAP\nPrints nothing and exits 0; a running daemon closes its connection and refuses it from then\non. The folders stay as they are. An unknown peer exits 1."
    )]
    Remove {
        /// The peer's device id.
        #[arg(value_parser = parse_device)]
        device: DeviceId,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let home = Home::resolve(cli.home.as_deref());
    let is_daemon = matches!(cli.command, Command::Daemon);
    // A command whose output is cut short (`meshfs journal | head`, `status --json | grep -q`)
    // ends quietly, as other tools do; before, its next `print!` panicked. The daemon and the
    // demo (which runs daemons in this process) keep `SIGPIPE` ignored: they write to sockets.
    if !matches!(cli.command, Command::Daemon | Command::Demo { .. }) {
        meshfs_sys::default_sigpipe();
    }
    let level = cli.log_level.clone().unwrap_or_else(|| {
        if is_daemon {
            "info".into()
        } else {
            "warn".into()
        }
    });
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    match run(cli.command, &home) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("meshfs: {e:#}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}

fn reload_if_running(home: &Home) -> anyhow::Result<()> {
    if let Some(reply) = control::request(home, &Request::Reload)? {
        if !reply_ok(&reply) {
            bail!(
                "the daemon refused the new config: {}",
                reply_error(&reply, "unknown error")
            );
        }
    }
    Ok(())
}

/// A device id argument (clap reports a bad one as a usage error, exit 2).
fn parse_device(s: &str) -> Result<DeviceId, String> {
    s.parse::<DeviceId>()
        .map_err(|e| format!("{s:?} is not a device id: {e}"))
}

/// A `HOST:PORT` argument.
fn parse_host_port(s: &str) -> Result<String, String> {
    if s.parse::<std::net::SocketAddr>().is_ok() || meshfs_daemon::config::looks_like_host_port(s) {
        Ok(s.to_string())
    } else {
        Err(format!(
            "{s:?} is not HOST:PORT (e.g. 192.168.1.20:7788, [::1]:7788, server.lan:7788)"
        ))
    }
}

/// A peer address argument: `HOST:PORT` or `dynamic`.
fn parse_peer_addr(s: &str) -> Result<String, String> {
    if s == meshfs_daemon::config::DYNAMIC {
        return Ok(s.to_string());
    }
    parse_host_port(s).map_err(|e| format!("{e}, or \"dynamic\""))
}

/// A folder id argument.
fn parse_folder_id(s: &str) -> Result<FolderId, String> {
    FolderId::new(s).map_err(|e| e.to_string())
}

fn random_folder_id() -> anyhow::Result<FolderId> {
    const ALPHA: &[u8] = b"abcdefghijkmnpqrstuvwxyz23456789";
    let id: String = (0..10)
        .map(|_| ALPHA[rand::random::<usize>() % ALPHA.len()] as char)
        .collect();
    Ok(FolderId::new(&id)?)
}

fn run(cmd: Command, home: &Home) -> anyhow::Result<u8> {
    match cmd {
        Command::Init {
            name,
            listen,
            no_discovery,
        } => init(home, name, &listen, no_discovery),
        Command::Id => {
            let id = Identity::load(&home.identity_dir())
                .map_err(|e| anyhow!("{e} (run `meshfs init` first)"))?;
            println!("{}", id.device_id);
            Ok(0)
        }
        Command::Folder(cmd) => folder_cmd(home, cmd),
        Command::Peer(cmd) => peer_cmd(home, cmd),
        Command::Config(ConfigCmd::Check) => config_check::run(home),
        Command::Share { folder, device } => share(home, folder, device),
        Command::Daemon => daemon(home),
        Command::Mount {
            folder,
            mountpoint,
            read_only,
            allow_other,
            at,
        } => mount(home, folder, &mountpoint, read_only, allow_other, at),
        Command::Unmount { folder, mountpoint } => unmount(home, folder, mountpoint),
        Command::Versions { folder, path, json } => {
            versions_cmd::versions(home, folder, &path, json)
        }
        Command::Restore(args) => versions_cmd::restore(home, args),
        Command::Override { folder } => versions_cmd::role_command(home, folder, false),
        Command::Revert { folder } => versions_cmd::role_command(home, folder, true),
        Command::Pin { folder, path, json } => ondemand_cmd::pin(home, folder, path, json),
        Command::Unpin { folder, path } => ondemand_cmd::unpin(home, folder, path),
        Command::Evict { folder, path, json } => ondemand_cmd::evict(home, folder, path, json),
        Command::Repair => repair(home),
        Command::Scan { folder } => scan(home, folder),
        Command::Status {
            folder,
            json,
            wait_synced,
            connected,
            timeout,
            watch,
            pending,
        } => status_cmd::run(
            home,
            status_cmd::StatusArgs {
                json,
                wait_synced,
                connected,
                timeout,
                watch,
                pending,
                folder,
            },
        ),
        Command::Journal(args) => journal_cmd::run(home, args),
        Command::Conflicts { folder, json } => conflicts(home, folder, json),
        Command::Demo { keep } => demo::run_demo(keep),
        Command::Ui { print_url } => ui_cmd::run(home, print_url),
        Command::PackageAssets { out } => package_assets::run(Cli::command(), &out),
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "meshfs", &mut std::io::stdout());
            Ok(0)
        }
    }
}

/// The folder `id` of the config, or an error that says how to list them.
fn require_folder(home: &Home, id: &FolderId) -> anyhow::Result<()> {
    Config::load(home)?
        .folder(id)
        .ok_or_else(|| anyhow!("no folder {:?} (see `meshfs folder list`)", id.as_str()))?;
    Ok(())
}

/// The user's UTC offset now (UTC where the system does not say). The CLI runs on one thread,
/// where the `time` crate can read it.
fn local_offset() -> time::UtcOffset {
    time::UtcOffset::current_local_offset().unwrap_or(time::UtcOffset::UTC)
}

/// "on" or "off", as the status and mount lines show a switch.
/// ", other users allowed" where the mount lets other users in, from its status JSON.
fn others_text(m: &serde_json::Value) -> &'static str {
    if m["allow_other"] == true {
        ", other users allowed"
    } else {
        ""
    }
}

/// "kernel passthrough on", or "kernel passthrough off (why)", from a mount's status JSON.
fn passthrough_text(m: &serde_json::Value) -> String {
    if m["passthrough"] == true {
        return "kernel passthrough on".into();
    }
    match m["passthrough_off"]["why"].as_str() {
        Some(why) => format!("kernel passthrough off: {why}"),
        None => "kernel passthrough off".into(),
    }
}

fn on_off(on: bool) -> &'static str {
    if on {
        "on"
    } else {
        "off"
    }
}

/// A daemon's reply said `"ok": true`.
fn reply_ok(r: &serde_json::Value) -> bool {
    r.get("ok").and_then(|v| v.as_bool()) == Some(true)
}

/// The `error` of a daemon's reply, or `default`.
fn reply_error<'a>(r: &'a serde_json::Value, default: &'a str) -> &'a str {
    r.get("error").and_then(|v| v.as_str()).unwrap_or(default)
}

/// `init`: a new identity and config; refuses to overwrite either.
fn init(home: &Home, name: Option<String>, listen: &str, no_discovery: bool) -> anyhow::Result<u8> {
    if Identity::exists(&home.identity_dir()) || home.config_file().exists() {
        bail!("meshfs is already initialised in {} (identity or config exists); refusing to overwrite it. Use another --home to create a second device.", home.config_dir.display());
    }
    let name = name.unwrap_or_else(|| {
        std::fs::read_to_string("/etc/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "meshfs".into())
    });
    std::fs::create_dir_all(&home.state_dir)
        .with_context(|| format!("creating {}", home.state_dir.display()))?;
    let id = Identity::generate()?;
    id.save(&home.identity_dir())?;
    let mut config = Config::new(&name, listen);
    config.discovery.local = !no_discovery;
    config.save(home)?;
    println!("{}", id.device_id);
    eprintln!(
        "initialised device {name:?} in {}",
        home.config_dir.display()
    );
    Ok(0)
}

/// `folder add|list|remove`.
fn folder_cmd(home: &Home, cmd: FolderCmd) -> anyhow::Result<u8> {
    match cmd {
        FolderCmd::Add {
            path,
            id,
            on_demand,
            on_demand_under,
            cache_max,
            min_free,
        } => {
            let id = match id {
                Some(id) => id,
                None => random_folder_id()?,
            };
            let demand = ondemand_cmd::Demand {
                on: on_demand || !on_demand_under.is_empty(),
                under: on_demand_under,
                cache_max,
                min_free,
            };
            folder_add(home, &path, &id, demand)?;
            println!("{id}");
        }
        FolderCmd::Set {
            id,
            on_demand,
            on_demand_under,
            no_on_demand,
            cache_max,
            min_free,
        } => {
            let on = match (on_demand || !on_demand_under.is_empty(), no_on_demand) {
                (true, _) => Some(true),
                (_, true) => Some(false),
                _ => None,
            };
            return ondemand_cmd::folder_set(home, &id, on, on_demand_under, cache_max, min_free);
        }
        FolderCmd::List { json } => {
            let config = Config::load(home)?;
            if json {
                let v: Vec<_> = config.folders.iter().map(|f| serde_json::json!({"id": f.id, "path": f.path, "watch": f.watch,
                    "on_demand": f.on_demand, "on_demand_under": f.on_demand_under, "cache_max": f.cache_max,
                    "shared_with": config.peers.iter().filter(|p| p.folders.contains(&f.id)).map(|p| p.id.to_string()).collect::<Vec<_>>()})).collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                for f in &config.folders {
                    let n = config
                        .peers
                        .iter()
                        .filter(|p| p.folders.contains(&f.id))
                        .count();
                    println!(
                        "{:<16} {}  (shared with {n} peer{})",
                        f.id.as_str(),
                        f.path.display(),
                        if n == 1 { "" } else { "s" }
                    );
                }
            }
        }
        FolderCmd::Remove { id } => {
            let mut config = Config::load(home)?;
            if config.folder(&id).is_none() {
                bail!("no folder {:?} (see `meshfs folder list`)", id.as_str());
            }
            config.folders.retain(|f| f.id != id);
            for p in &mut config.peers {
                p.folders.retain(|f| f != &id);
            }
            config.save(home)?;
            reload_if_running(home)?;
            // Only temp files of an interrupted apply can be left here.
            let _ = std::fs::remove_dir_all(home.staging_dir(&id));
        }
    }
    Ok(0)
}

/// `peer add|list|remove`.
fn peer_cmd(home: &Home, cmd: PeerCmd) -> anyhow::Result<u8> {
    match cmd {
        PeerCmd::Add {
            device,
            addr,
            name,
            share,
        } => peer_add(home, device, addr, name, &share)?,
        PeerCmd::List { json } => {
            let config = Config::load(home)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&config.peers.iter().map(|p| serde_json::json!({"device_id": p.id.to_string(), "name": p.name, "addresses": p.addresses, "folders": p.folders})).collect::<Vec<_>>())?);
            } else {
                for p in &config.peers {
                    println!(
                        "{}  {:<12} {:<22} {}",
                        p.id,
                        p.name,
                        if p.addresses.is_empty() {
                            "(dials us)".to_string()
                        } else {
                            p.addresses.join(",")
                        },
                        p.folders
                            .iter()
                            .map(FolderId::as_str)
                            .collect::<Vec<_>>()
                            .join(",")
                    );
                }
            }
        }
        PeerCmd::Remove { device } => {
            let mut config = Config::load(home)?;
            let before = config.peers.len();
            config.peers.retain(|p| p.id != device);
            if config.peers.len() == before {
                bail!("no peer {device} (see `meshfs peer list`)");
            }
            config.save(home)?;
            reload_if_running(home)?;
        }
    }
    Ok(0)
}

/// `peer add`: trusts `id`, or updates what is known of it. `addr` empty: a new peer is
/// dynamic, a known one keeps its addresses.
fn peer_add(
    home: &Home,
    id: DeviceId,
    addr: Vec<String>,
    name: Option<String>,
    share: &[String],
) -> anyhow::Result<()> {
    if Identity::load(&home.identity_dir()).is_ok_and(|me| me.device_id == id) {
        bail!("{id} is this device's own id; add the id of another device");
    }
    let mut config = Config::load(home)?;
    // A malformed id names no folder either: the same answer.
    let share = share
        .iter()
        .map(|f| {
            FolderId::new(f)
                .ok()
                .filter(|id| config.folder(id).is_some())
                .ok_or_else(|| anyhow!("no folder {f:?} to share (add it first with `meshfs folder add PATH --id {f}`)"))
        })
        .collect::<anyhow::Result<Vec<FolderId>>>()?;
    match config.peer_mut(&id) {
        Some(p) => {
            if !addr.is_empty() {
                p.addresses = addr;
            }
            if let Some(n) = name {
                p.name = n;
            }
            for f in share {
                if !p.folders.contains(&f) {
                    p.folders.push(f);
                }
            }
        }
        None => config.peers.push(PeerConfig {
            name: name.unwrap_or_default(),
            addresses: if addr.is_empty() {
                PeerConfig::new(id).addresses
            } else {
                addr
            },
            folders: share,
            ..PeerConfig::new(id)
        }),
    }
    config.save(home)?;
    reload_if_running(home)
}

/// `share`: shares a folder with a known peer.
fn share(home: &Home, folder: FolderId, device: DeviceId) -> anyhow::Result<u8> {
    let mut config = Config::load(home)?;
    if config.folder(&folder).is_none() {
        bail!("no folder {:?} (see `meshfs folder list`)", folder.as_str());
    }
    let p = config.peer_mut(&device).ok_or_else(|| {
        anyhow!("unknown peer {device}: add it first with `meshfs peer add {device}`")
    })?;
    if !p.folders.contains(&folder) {
        p.folders.push(folder);
    }
    config.save(home)?;
    reload_if_running(home)?;
    Ok(0)
}

/// `daemon`: runs the engine in the foreground until SIGINT/SIGTERM.
fn daemon(home: &Home) -> anyhow::Result<u8> {
    // glibc gives each thread that allocates its own arena; the scanner's and apply's
    // blocking threads left ~10 MB free but resident in arenas of their own after a
    // scan of 100,000 files (RSS 30.1 → 19.9 MB with two arenas; scan time unchanged).
    // Fixed thresholds, not glibc's dynamic ones: after the scan of a big tree frees its
    // multi-megabyte maps, glibc raises both thresholds to their size, and a thread
    // arena's free top (which `malloc_trim` leaves alone) then stays resident — half
    // the starts measured 30.7 MiB instead of 20 MiB.
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets allocator tunables (integers, under the allocator's own
    // lock); no live allocation moves.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 2 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 4 << 20);
    }
    // The engine's threads run below the mount's request threads (D107): the thread that
    // makes mounts is started first, at the daemon's own priority.
    meshfs_daemon::priority::init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_start(meshfs_daemon::priority::background)
        .build()?;
    rt.block_on(control::run_daemon(home.clone()))?;
    Ok(0)
}

/// `mount`: asks the daemon to serve the folder at `mountpoint` (as it was at `at`, if given).
fn mount(
    home: &Home,
    folder: FolderId,
    mountpoint: &std::path::Path,
    read_only: bool,
    allow_other: bool,
    at: Option<i64>,
) -> anyhow::Result<u8> {
    require_folder(home, &folder)?;
    let point = std::path::absolute(mountpoint)
        .map_err(|e| anyhow!("mount point {}: {e}", mountpoint.display()))?;
    let req = Request::Mount {
        folder: folder.clone(),
        mountpoint: point.clone(),
        read_only,
        allow_other,
        at_ns: at,
    };
    match control::request(home, &req)? {
        None => {
            eprintln!(
                "meshfs: the daemon is not running; the mount is served by it (`meshfs daemon`)"
            );
            Ok(EXIT_NO_DAEMON)
        }
        Some(r) if reply_ok(&r) && r.get("snapshot").is_some() => {
            let s = &r["snapshot"];
            println!(
                "folder {folder} as it was at {} mounted read-only at {} ({} paths)",
                versions_cmd::at_text(at.unwrap_or_default()),
                point.display(),
                s["paths"]
            );
            Ok(0)
        }
        Some(r) if reply_ok(&r) => {
            let m = &r["mount"];
            println!(
                "folder {folder} mounted at {} ({}{}, {}, io_uring {})",
                point.display(),
                m["mode"].as_str().unwrap_or("read-write"),
                others_text(m),
                passthrough_text(m),
                on_off(m["io_uring"] == true),
            );
            Ok(0)
        }
        Some(r) => bail!("{}", reply_error(&r, "mount failed")),
    }
}

/// `unmount`: ends the folder's mount (it keeps syncing), or the snapshot at `mountpoint`.
fn unmount(home: &Home, folder: FolderId, mountpoint: Option<PathBuf>) -> anyhow::Result<u8> {
    require_folder(home, &folder)?;
    let mountpoint = mountpoint
        .map(|m| std::path::absolute(&m).map_err(|e| anyhow!("mount point {}: {e}", m.display())))
        .transpose()?;
    let req = Request::Unmount {
        folder: folder.clone(),
        mountpoint,
    };
    match control::request(home, &req)? {
        None => {
            eprintln!("meshfs: the daemon is not running, so nothing of it is mounted");
            Ok(EXIT_NO_DAEMON)
        }
        Some(r) if reply_ok(&r) => {
            println!(
                "folder {folder} unmounted from {}",
                r["mountpoint"].as_str().unwrap_or("?")
            );
            Ok(0)
        }
        Some(r) => bail!("{}", reply_error(&r, "unmount failed")),
    }
}

/// `repair`: moves a damaged journal aside so the next start rebuilds it.
fn repair(home: &Home) -> anyhow::Result<u8> {
    if control::is_running(home) {
        bail!("the daemon is running; stop it first (`meshfs repair` moves its journal aside)");
    }
    let db = home.journal_file();
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut moved = Vec::new();
    for suffix in ["", "-wal", "-shm", "-meshfs-wal"] {
        let from = PathBuf::from(format!("{}{suffix}", db.display()));
        if from.exists() {
            let to = PathBuf::from(format!("{}.damaged-{stamp}{suffix}", db.display()));
            std::fs::rename(&from, &to).map_err(|e| {
                anyhow!(
                    "cannot move {} aside to {}: {e}",
                    from.display(),
                    to.display()
                )
            })?;
            moved.push(to);
        }
    }
    if moved.is_empty() {
        println!(
            "no journal at {}; the next `meshfs daemon` creates one",
            db.display()
        );
    } else {
        for m in &moved {
            println!("kept the old journal as {}", m.display());
        }
        println!("the next `meshfs daemon` rescans every folder into a new journal and reconciles with its peers: files that differ become conflicts, nothing is overwritten");
    }
    Ok(0)
}

/// `scan`: asks the daemon for a full rescan of the folder now.
fn scan(home: &Home, folder: FolderId) -> anyhow::Result<u8> {
    require_folder(home, &folder)?;
    match control::request(home, &Request::Scan { folder })? {
        None => {
            eprintln!("meshfs: the daemon is not running; changes are picked up when it starts (`meshfs daemon`)");
            Ok(EXIT_NO_DAEMON)
        }
        Some(r) if reply_ok(&r) => {
            println!(
                "{} change(s) journaled",
                r.get("changes").and_then(|v| v.as_u64()).unwrap_or(0)
            );
            Ok(0)
        }
        Some(r) => bail!("scan failed: {}", reply_error(&r, "unknown error")),
    }
}

/// `conflicts`: the conflict siblings that still exist, read from the journal.
fn conflicts(home: &Home, folder: FolderId, json: bool) -> anyhow::Result<u8> {
    require_folder(home, &folder)?;
    let j = meshfs_daemon::journal::Journal::open_reader(&home.journal_file())?;
    let list = meshfs_daemon::conflicts::list(&j, &folder);
    if json {
        println!("{}", serde_json::to_string_pretty(&list)?);
    } else if list.is_empty() {
        println!("no conflicts in {folder}");
    } else {
        for c in list {
            // Names come from peers: control characters are shown escaped, as `journal` does.
            let (path, original) = (printable(&c.path), printable(&c.original));
            println!("{path}\n    belongs to {original}; losing version by {} at {} ({} bytes); kept version by {} ({} bytes)", printable(&c.loser_device), printable(&c.loser_time), c.size, printable(c.winner_device.as_deref().unwrap_or("-")), c.winner_size.map_or("-".into(), |s| s.to_string()));
        }
    }
    Ok(0)
}

/// `folder add`: every check runs before anything is created, and a refusal (here, when the
/// config is saved, or by a running daemon) leaves the disk and the config as they were.
fn folder_add(
    home: &Home,
    path: &std::path::Path,
    id: &FolderId,
    demand: ondemand_cmd::Demand,
) -> anyhow::Result<()> {
    let old = Config::load(home)?;
    if old.folder(id).is_some() {
        bail!(
            "a folder with id {:?} already exists (see `meshfs folder list`)",
            id.as_str()
        );
    }
    let real = meshfs_daemon::config::real_path(path);
    let existing = real
        .ancestors()
        .find(|a| std::fs::symlink_metadata(a).is_ok())
        .unwrap_or(std::path::Path::new("/"));
    if !existing.is_dir() {
        if existing == real {
            bail!(
                "{} is a file, not a directory: give the directory to replicate (it is created if missing)",
                path.display()
            );
        }
        bail!(
            "cannot create {}: {} is not a directory",
            path.display(),
            existing.display()
        );
    }
    if let Some(own) = home.overlap(&real) {
        bail!(
            "{} overlaps meshfs's own directory {} (its private key, journal and config must never be replicated); choose a folder outside it",
            real.display(),
            own.display()
        );
    }
    if let Some(f) = old
        .folders
        .iter()
        .find(|f| real.starts_with(&f.path) || f.path.starts_with(&real))
    {
        bail!(
            "{} overlaps folder {:?} at {}; folders must not nest",
            real.display(),
            f.id.as_str(),
            f.path.display()
        );
    }
    let mut new = old.clone();
    let mut folder = FolderConfig::new(id.clone(), real.clone());
    folder.on_demand = demand.on;
    folder.on_demand_under = demand.under;
    folder.cache_max = demand.cache_max;
    folder.min_free = demand.min_free;
    new.folders.push(folder);
    new.validate(home)?;
    // The directories this command creates, outermost first: removed again on a refusal.
    let created: Vec<PathBuf> = real
        .ancestors()
        .take_while(|a| *a != existing)
        .map(|a| a.to_path_buf())
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    std::fs::create_dir_all(&real).with_context(|| format!("creating {}", real.display()))?;
    let undo = || {
        for d in created.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    };
    if let Err(e) = new.save(home) {
        undo();
        return Err(e.into());
    }
    if let Err(e) = reload_if_running(home) {
        let _ = old.save(home);
        let _ = reload_if_running(home);
        undo();
        return Err(e);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::CommandFactory;

    /// The command lines an `after_help` shows: the text after `Example: `, and the lines of an
    /// `Examples:` block, each cut at a comment and split at `&`, `|`, `>` into the `meshfs …`
    /// commands they run.
    fn example_commands(help: &str) -> Vec<Vec<String>> {
        let mut lines = Vec::new();
        let mut in_block = false;
        for line in help.lines() {
            if let Some(rest) = line.strip_prefix("Example: ") {
                lines.push(rest);
                in_block = false;
            } else if line.starts_with("Examples:") {
                in_block = true;
            } else if in_block && line.starts_with("  ") {
                lines.push(line.trim());
            } else {
                in_block = false;
            }
        }
        lines
            .into_iter()
            .flat_map(|l| {
                l.split(" #")
                    .next()
                    .unwrap_or_default()
                    .split(['&', '|', '>'])
                    .map(str::trim)
                    .filter(|c| c.starts_with("meshfs "))
                    .map(|c| c.split_whitespace().map(String::from).collect::<Vec<_>>())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The names of the subcommands `m` selects, outermost first.
    fn selected(mut m: &clap::ArgMatches) -> Vec<String> {
        let mut path = Vec::new();
        while let Some((name, sub)) = m.subcommand() {
            path.push(name.to_string());
            m = sub;
        }
        path
    }

    /// Every visible subcommand, at any depth, with the names that lead to it.
    fn subcommands(
        cmd: &clap::Command,
        above: &[String],
        out: &mut Vec<(Vec<String>, clap::Command)>,
    ) {
        for sub in cmd.get_subcommands() {
            if sub.is_hide_set() || sub.get_name() == "help" {
                continue;
            }
            let mut path = above.to_vec();
            path.push(sub.get_name().to_string());
            out.push((path.clone(), sub.clone()));
            subcommands(sub, &path, out);
        }
    }

    #[test]
    fn every_subcommand_has_a_help_example_that_parses_and_runs_that_subcommand() {
        let root = Cli::command();
        root.clone().debug_assert();
        let mut all = Vec::new();
        subcommands(&root, &[], &mut all);
        assert!(all.len() > 20, "the walk found the tree: {}", all.len());
        for (path, cmd) in all {
            let help = cmd
                .get_after_help()
                .map(|h| h.to_string())
                .unwrap_or_default();
            let examples = example_commands(&help);
            assert!(
                !examples.is_empty(),
                "`meshfs {}` has no example in its --help",
                path.join(" ")
            );
            let mut runs_itself = false;
            for args in examples {
                let m = Cli::command()
                    .try_get_matches_from(&args)
                    .unwrap_or_else(|e| {
                        panic!(
                            "example `{}` of `meshfs {}`: {e}",
                            args.join(" "),
                            path.join(" ")
                        )
                    });
                runs_itself |= selected(&m).starts_with(&path);
            }
            assert!(
                runs_itself,
                "no example of `meshfs {}` runs it",
                path.join(" ")
            );
        }
    }
}
