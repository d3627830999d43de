//! The control socket: a Unix socket in the state directory (mode 0600, owner only) through
//! which the CLI talks to the running daemon. Nothing else listens except the QUIC port.
//!
//! Protocol: the client sends one [`Request`] as one JSON object on one line (`{"op":
//! "status"}`, `{"op": "scan", "folder": "ID"}`, `{"op": "reload"}`, `{"op": "stop"}`, …) and
//! reads one [`Reply`] line back. Errors come back as `{"ok": false, "error": "…"}`. Both
//! ends use these types, so the CLI and the daemon cannot disagree on the wire form.
//!
//! A request line is at most [`MAX_REQUEST_LINE`] bytes: a longer one is answered with an
//! error and its connection closed, without reading or holding the rest. A failing `accept`
//! (out of file descriptors, say) is retried after a pause that grows to a second, not at
//! once: it would fail again at once, and spin a core.

use crate::config::Home;
use crate::engine::Engine;
use crate::mounts::MountStatus;
use crate::pending::PendingFolder;
use crate::status::Status;
use crate::ui::Ui;
use meshfs_protocol::FolderId;
use serde::{Deserialize, Serialize, Serializer};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

/// Longest request line the daemon reads, newline excluded. Requests are a few hundred bytes.
pub const MAX_REQUEST_LINE: usize = 64 << 10;
/// The first pause after a failed `accept`; it doubles up to [`ACCEPT_PAUSE_MAX`].
const ACCEPT_PAUSE_MIN: Duration = Duration::from_millis(10);
/// See [`ACCEPT_PAUSE_MIN`].
const ACCEPT_PAUSE_MAX: Duration = Duration::from_secs(1);

/// One request to the daemon: `{"op": "<name>", …fields}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// The `status --json` document.
    Status,
    /// Re-read the config.
    Reload,
    /// Rescan a folder now.
    Scan {
        /// The folder.
        folder: FolderId,
    },
    /// Mount a folder, served by the daemon.
    Mount {
        /// The folder.
        folder: FolderId,
        /// Where: an existing empty directory.
        mountpoint: PathBuf,
        /// Refuse every change through the mount.
        #[serde(default)]
        read_only: bool,
        /// Mount the folder as it was at this time (ns since the epoch), read-only.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        at_ns: Option<i64>,
        /// Let other users in (`allow_other`).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        allow_other: bool,
    },
    /// End a folder's mount (it keeps syncing), or the snapshot of it at `mountpoint`.
    Unmount {
        /// The folder.
        folder: FolderId,
        /// A snapshot's mount point (`mount --at`); none: the folder's mount.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mountpoint: Option<PathBuf>,
    },
    /// Bring a past version back as a new local change.
    Restore {
        /// The folder.
        folder: FolderId,
        /// The path (as the user typed it, relative to the folder).
        path: String,
        /// That version (its sequence).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seq: Option<u64>,
        /// The path as it was at this time (ns since the epoch).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        at_ns: Option<i64>,
        /// Put it there instead.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        to: Option<String>,
    },
    /// A send-only folder: this device's state wins over every peer version it holds.
    Override {
        /// The folder.
        folder: FolderId,
    },
    /// A receive-only folder: its local changes give way to the shared state.
    Revert {
        /// The folder.
        folder: FolderId,
    },
    /// Keep a path of an on-demand folder local, and fetch what is not (D94).
    Pin {
        /// The folder.
        folder: FolderId,
        /// The path (as the user typed it, relative to the folder).
        path: String,
    },
    /// Let a pinned path go (its files stay until the budget needs the room).
    Unpin {
        /// The folder.
        folder: FolderId,
        /// The path.
        path: String,
    },
    /// Evict what is local at or below a path of an on-demand folder now (D93).
    Evict {
        /// The folder.
        folder: FolderId,
        /// The path.
        path: String,
    },
    /// What waits in a folder (every folder when none is named), path by path.
    Pending {
        /// The folder, or none for all.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        folder: Option<FolderId>,
    },
    /// Serve the page (`meshfs ui`) if it is not served yet; answers its address.
    Ui,
    /// Stop the daemon.
    Stop,
}

impl Request {
    /// Every `op` a daemon of this version answers.
    pub const OPS: &'static [&'static str] = &[
        "status", "reload", "scan", "mount", "unmount", "pending", "ui", "stop", "restore",
        "override", "revert", "pin", "unpin", "evict",
    ];

    /// Reads one request line; the error says what is wrong with it.
    pub fn parse(line: &str) -> Result<Request, RequestError> {
        serde_json::from_str(line).map_err(|error| {
            let value = match serde_json::from_str::<serde_json::Value>(line) {
                Ok(v) => v,
                Err(_) => return RequestError::NotJson(error),
            };
            match value.get("op").and_then(|op| op.as_str()) {
                None => RequestError::NoOp,
                Some(op) if !Request::OPS.contains(&op) => RequestError::UnknownOp(op.to_string()),
                Some(op) => RequestError::Fields {
                    op: op.to_string(),
                    error,
                },
            }
        })
    }
}

/// Why a request line was not understood.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// Not a JSON object.
    #[error("bad request: {0}")]
    NotJson(serde_json::Error),
    /// No `op` field, or one that is not a string.
    #[error("bad request: \"op\" must name one of {}", Request::OPS.join(", "))]
    NoOp,
    /// An `op` this daemon does not know: the CLI is probably newer than the daemon.
    #[error("unknown op {0:?}: this daemon answers {ops}; if `meshfs` was upgraded, restart the daemon", ops = Request::OPS.join(", "))]
    UnknownOp(String),
    /// A known `op` with missing or malformed fields.
    #[error("bad {op} request: {error}")]
    Fields {
        /// The op.
        op: String,
        /// What is wrong with its fields.
        error: serde_json::Error,
    },
}

/// The daemon's answer to a [`Request`].
#[derive(Clone, Debug)]
pub enum Reply {
    /// To `status`: the document itself (no `ok` field).
    Status(Box<Status>),
    /// `{"ok": true}`.
    Done,
    /// To `scan`: `{"ok": true, "changes": N}`, the new versions journaled.
    Scanned(usize),
    /// To `mount`: `{"ok": true, "mount": {…}}`.
    Mounted(MountStatus),
    /// To `unmount`: `{"ok": true, "mountpoint": "…"}`, where it was mounted.
    Unmounted(PathBuf),
    /// To `pending`: `{"ok": true, "folders": […]}`.
    Pending(Vec<PendingFolder>),
    /// To `restore`: `{"ok": true, "restore": {…}}`.
    Restored(crate::versions::restore::RestoreReport),
    /// To `mount` with `at_ns`: `{"ok": true, "snapshot": {"mountpoint", "paths", "at_ns"}}`.
    Snapshot {
        /// Where.
        mountpoint: PathBuf,
        /// How many paths it shows.
        paths: usize,
        /// As of when.
        at_ns: i64,
    },
    /// To `override` and `revert`: `{"ok": true, "report": {…}}`.
    Roles(crate::roles::RoleReport),
    /// To `ui`: `{"ok": true, "url": "http://127.0.0.1:PORT/"}`, the page's address without
    /// its token (which is in the state directory's `ui-token`).
    Ui(String),
    /// To `pin`: `{"ok": true, "pin": {"path", "fetched", "failed": [...]}}`.
    Pinned(crate::ondemand::pins::PinReport),
    /// To `unpin`: `{"ok": true, "unpinned": BOOL}`, whether it was pinned.
    Unpinned(bool),
    /// To `evict`: `{"ok": true, "evict": {"evicted", "freed_bytes", "kept", "local_bytes",
    /// "cache_max"}}`.
    Evicted(crate::ondemand::budget::EvictReport),
    /// `{"ok": false, "error": "…"}`.
    Failed(String),
}

impl Reply {
    /// A failure, with the error's message.
    pub fn failed(error: impl std::fmt::Display) -> Reply {
        Reply::Failed(error.to_string())
    }
}

impl Serialize for Reply {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        if let Reply::Status(st) = self {
            return st.serialize(s);
        }
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("ok", &!matches!(self, Reply::Failed(_)))?;
        match self {
            Reply::Status(_) | Reply::Done => {}
            Reply::Scanned(changes) => m.serialize_entry("changes", changes)?,
            Reply::Mounted(mount) => m.serialize_entry("mount", mount)?,
            Reply::Unmounted(point) => m.serialize_entry("mountpoint", point)?,
            Reply::Pending(folders) => m.serialize_entry("folders", folders)?,
            Reply::Restored(r) => m.serialize_entry("restore", r)?,
            Reply::Snapshot {
                mountpoint,
                paths,
                at_ns,
            } => m.serialize_entry(
                "snapshot",
                &serde_json::json!({"mountpoint": mountpoint, "paths": paths, "at_ns": at_ns}),
            )?,
            Reply::Roles(r) => m.serialize_entry("report", r)?,
            Reply::Ui(url) => m.serialize_entry("url", url)?,
            Reply::Pinned(r) => m.serialize_entry("pin", r)?,
            Reply::Unpinned(was) => m.serialize_entry("unpinned", was)?,
            Reply::Evicted(r) => m.serialize_entry("evict", r)?,
            Reply::Failed(error) => m.serialize_entry("error", error)?,
        }
        m.end()
    }
}

/// Why the control socket could not be opened or a daemon could not be asked.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Another daemon answers on this home's socket.
    #[error("a meshfs daemon is already running for {home} (control socket {socket}): stop it first (`systemctl --user stop meshfs`, or SIGTERM), or give this one another --home")]
    AlreadyRunning {
        /// The config directory.
        home: PathBuf,
        /// Its control socket.
        socket: PathBuf,
    },
    /// Creating the socket (or removing a stale one) failed.
    #[error("cannot open the control socket {path}: {source}")]
    Bind {
        /// The socket or its directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A socket is there but connecting to it failed.
    #[error("cannot reach the daemon at {path}: {source}")]
    Unreachable {
        /// The socket.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Sending the request or reading the reply failed.
    #[error("talking to the daemon at {path} failed: {source}")]
    Io {
        /// The socket.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The daemon hung up without a reply.
    #[error("the daemon closed the control connection without answering (socket {path})")]
    NoAnswer {
        /// The socket.
        path: PathBuf,
    },
    /// The request cannot be written as JSON (a mount point that is not UTF-8).
    #[error("cannot send the request to the daemon: {0}")]
    Encode(serde_json::Error),
    /// The reply is not JSON.
    #[error("the daemon at {path} sent a reply that is not JSON: {source}")]
    BadReply {
        /// The socket.
        path: PathBuf,
        /// The parser's explanation.
        source: serde_json::Error,
    },
}

/// Binds the control socket (replacing a stale one) with mode 0600.
pub fn bind(home: &Home) -> Result<UnixListener, ControlError> {
    let path = home.control_socket();
    let failed = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ControlError::Bind { path, source }
    };
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(&path).is_ok() {
            return Err(ControlError::AlreadyRunning {
                home: home.config_dir.clone(),
                socket: path,
            });
        }
        std::fs::remove_file(&path).map_err(failed(&path))?;
    }
    std::fs::create_dir_all(&home.state_dir).map_err(failed(&home.state_dir))?;
    let listener = UnixListener::bind(&path).map_err(failed(&path))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .map_err(failed(&path))?;
    Ok(listener)
}

/// Serves control requests until the daemon stops.
pub async fn serve(
    engine: Arc<Engine>,
    ui: Arc<Ui>,
    listener: UnixListener,
    stop: Arc<tokio::sync::Notify>,
    main: tokio::runtime::Handle,
    quit: Arc<tokio::sync::Notify>,
) {
    let mut pause = ACCEPT_PAUSE_MIN;
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = quit.notified() => return,
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                pause = ACCEPT_PAUSE_MIN;
                stream
            }
            Err(e) => {
                if pause == ACCEPT_PAUSE_MIN {
                    tracing::warn!(error = %e, "cannot accept a control connection; retrying");
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(ACCEPT_PAUSE_MAX);
                continue;
            }
        };
        if !same_user(&stream) {
            tracing::warn!("refused a control connection from another user");
            continue;
        }
        let engine = engine.clone();
        let ui = ui.clone();
        let stop = stop.clone();
        let main = main.clone();
        tokio::spawn(async move {
            let _ = handle(engine, ui, stream, stop, main).await;
        });
    }
}

fn same_user(stream: &UnixStream) -> bool {
    match stream.peer_cred() {
        Ok(cred) => cred.uid() == meshfs_sys::geteuid(),
        Err(_) => false,
    }
}

async fn handle(
    engine: Arc<Engine>,
    ui: Arc<Ui>,
    stream: UnixStream,
    stop: Arc<tokio::sync::Notify>,
    main: tokio::runtime::Handle,
) -> std::io::Result<()> {
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    let mut buf = Vec::new();
    loop {
        let (reply, last) = match next_line(&mut r, &mut buf).await? {
            Line::End => return Ok(()),
            Line::TooLong => (
                Reply::Failed(format!(
                    "request line longer than {MAX_REQUEST_LINE} bytes; closing the connection"
                )),
                true,
            ),
            Line::Text(line) => match Request::parse(&line) {
                Err(e) => (Reply::failed(e), false),
                Ok(req) => {
                    let asked = std::time::Instant::now();
                    let reply = match req {
                        // Read-only and asked often (`--wait-synced` polls it): answered on
                        // this thread's runtime, never queued behind the engine's work.
                        Request::Status => {
                            blocking(&engine, |e| Reply::Status(Box::new(e.status()))).await
                        }
                        // Everything else runs where the engine's tasks run.
                        req => {
                            let (engine, ui, stop) = (engine.clone(), ui.clone(), stop.clone());
                            main.spawn(async move { answer(&engine, &ui, req, &stop).await })
                                .await
                                .unwrap_or_else(Reply::failed)
                        }
                    };
                    // How long the daemon took, apart from the client's own start and the
                    // socket: `RUST_LOG=meshfs_daemon::control=debug`.
                    tracing::debug!(request = %line.chars().take(40).collect::<String>(),
                        ms = asked.elapsed().as_secs_f64() * 1e3, "control request answered");
                    (reply, false)
                }
            },
        };
        let mut out = serde_json::to_string(&reply).unwrap_or_else(|e| {
            serde_json::json!({"ok": false, "error": e.to_string()}).to_string()
        });
        out.push('\n');
        w.write_all(out.as_bytes()).await?;
        if last {
            return Ok(());
        }
    }
}

/// One request line as read from a control connection.
#[derive(Debug, PartialEq, Eq)]
enum Line {
    /// The connection ended.
    End,
    /// A line (without its newline; the last one may have none). Bytes that are not UTF-8
    /// are replaced, so that the parser says what is wrong.
    Text(String),
    /// More than [`MAX_REQUEST_LINE`] bytes without a newline: the rest was not read.
    TooLong,
}

/// Reads the next line into `buf`, never more than [`MAX_REQUEST_LINE`] and a byte.
async fn next_line<R: AsyncBufRead + Unpin>(r: &mut R, buf: &mut Vec<u8>) -> std::io::Result<Line> {
    buf.clear();
    let limit = MAX_REQUEST_LINE as u64 + 1;
    let n = (&mut *r).take(limit).read_until(b'\n', buf).await?;
    if n == 0 {
        return Ok(Line::End);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > MAX_REQUEST_LINE {
        return Ok(Line::TooLong);
    }
    Ok(Line::Text(String::from_utf8_lossy(buf).into_owned()))
}

/// Carries out one request. Status, mount and unmount run on a blocking thread: status reads
/// the journal, whose lock an install holds for tens of milliseconds (and `--wait-synced`
/// asks every 10–25 ms), and mounting waits for the kernel; a runtime worker waiting on them
/// would stall the connections it drives.
async fn answer(engine: &Arc<Engine>, ui: &Ui, req: Request, stop: &tokio::sync::Notify) -> Reply {
    match req {
        Request::Status => blocking(engine, |e| Reply::Status(Box::new(e.status()))).await,
        Request::Reload => match engine.reload().await {
            Ok(()) => {
                ui.start_if_enabled();
                Reply::Done
            }
            Err(e) => Reply::failed(e),
        },
        Request::Ui => match ui.start() {
            Ok(url) => Reply::Ui(url),
            Err(e) => Reply::failed(e),
        },
        Request::Scan { folder } => match engine.scan_paths(&folder, Vec::new()).await {
            Ok(n) => Reply::Scanned(n),
            Err(e) => Reply::failed(e),
        },
        Request::Mount {
            folder,
            mountpoint,
            at_ns: Some(at_ns),
            ..
        } => {
            blocking(engine, move |e| {
                match e.mount_at(&folder, &mountpoint, at_ns) {
                    Ok((mountpoint, paths)) => Reply::Snapshot {
                        mountpoint,
                        paths,
                        at_ns,
                    },
                    Err(e) => Reply::failed(e),
                }
            })
            .await
        }
        Request::Mount {
            folder,
            mountpoint,
            read_only,
            allow_other,
            at_ns: None,
        } => {
            blocking(engine, move |e| {
                match e.mount(&folder, &mountpoint, read_only, allow_other) {
                    Ok(m) => Reply::Mounted(m),
                    Err(e) => Reply::failed(e),
                }
            })
            .await
        }
        Request::Unmount { folder, mountpoint } => {
            blocking(engine, move |e| unmount(e, &folder, mountpoint.as_deref())).await
        }
        Request::Restore {
            folder,
            path,
            seq,
            at_ns,
            to,
        } => restore(engine, folder, &path, seq, at_ns, to.as_deref()).await,
        Request::Override { folder } => {
            blocking(engine, move |e| {
                match crate::roles::override_held(&e.folders, &folder, e.short) {
                    Ok(r) => Reply::Roles(r),
                    Err(e) => Reply::failed(e),
                }
            })
            .await
        }
        Request::Revert { folder } => {
            let peers = engine.peers_of(&folder);
            match crate::roles::revert(engine.folders.clone(), folder, engine.short, peers).await {
                Ok(r) => Reply::Roles(r),
                Err(e) => Reply::failed(e),
            }
        }
        Request::Pin { folder, path } => match folder_path(&path) {
            Ok(path) => match engine.pin(&folder, path).await {
                Ok(r) => Reply::Pinned(r),
                Err(e) => Reply::failed(e),
            },
            Err(e) => Reply::Failed(e),
        },
        Request::Unpin { folder, path } => match folder_path(&path) {
            Ok(path) => match engine.unpin(&folder, path).await {
                Ok(was) => Reply::Unpinned(was),
                Err(e) => Reply::failed(e),
            },
            Err(e) => Reply::Failed(e),
        },
        Request::Evict { folder, path } => match folder_path(&path) {
            Ok(path) => match engine.evict(&folder, path).await {
                Ok(r) => Reply::Evicted(r),
                Err(e) => Reply::failed(e),
            },
            Err(e) => Reply::Failed(e),
        },
        Request::Pending { folder } => {
            blocking(engine, move |e| match e.pending(folder.as_ref()) {
                Ok(folders) => Reply::Pending(folders),
                Err(e) => Reply::failed(e),
            })
            .await
        }
        Request::Stop => {
            stop.notify_one();
            Reply::Done
        }
    }
}

/// `unmount`: the snapshot at `mountpoint` if one is named; else the folder's mount, or its
/// only snapshot when it has no mount.
fn unmount(e: &Engine, folder: &FolderId, mountpoint: Option<&Path>) -> Reply {
    if let Some(mp) = mountpoint {
        return match e.snapshots.unmount(folder, Some(mp)) {
            Ok(Some(point)) => Reply::Unmounted(point),
            Ok(None) => Reply::failed(format!(
                "no snapshot of folder {folder} is mounted at {}",
                mp.display()
            )),
            Err(err) => Reply::failed(err),
        };
    }
    match e.unmount(folder) {
        Ok(point) => Reply::Unmounted(point),
        Err(crate::engine::MountError::NotMounted(_)) => match e.snapshots.unmount(folder, None) {
            Ok(Some(point)) => Reply::Unmounted(point),
            Ok(None) => Reply::failed(format!(
                "folder {folder} is not mounted (a snapshot: name its mount point)"
            )),
            Err(err) => Reply::failed(err),
        },
        Err(err) => Reply::failed(err),
    }
}

/// A path of a folder as the user typed it (relative to the folder, a trailing `/` allowed),
/// or why it is not one (the error names the path).
pub fn user_path(p: &str) -> Result<meshfs_protocol::RelPath, String> {
    meshfs_protocol::RelPath::normalized(p.trim_end_matches('/'))
        .map_err(|e| format!("not a path in the folder: {e}"))
}

/// A path of a folder as the user typed it (relative to the folder). The folder itself is not
/// a path a pin or an eviction takes: the whole folder kept local is a folder not on demand.
fn folder_path(p: &str) -> Result<meshfs_protocol::RelPath, String> {
    let t = p.trim_start_matches("./").trim_end_matches('/');
    if t.is_empty() || t == "." {
        return Err(format!(
            "{p:?} is the whole folder: to keep all of it here, turn on-demand off (`meshfs folder set FOLDER --no-on-demand`); to free its room, evict its directories"
        ));
    }
    user_path(t)
}

/// `restore`: checks the paths, then restores.
async fn restore(
    engine: &Arc<Engine>,
    folder: FolderId,
    path: &str,
    seq: Option<u64>,
    at_ns: Option<i64>,
    to: Option<&str>,
) -> Reply {
    use crate::versions::restore::Pick;
    let path = match user_path(path) {
        Ok(p) => p,
        Err(e) => return Reply::Failed(e),
    };
    let to = match to
        .map(|t| user_path(t).map_err(|e| format!("--to: {e}")))
        .transpose()
    {
        Ok(t) => t,
        Err(e) => return Reply::Failed(e),
    };
    let pick = match (seq, at_ns) {
        (Some(_), Some(_)) => return Reply::failed("give --seq or --at, not both"),
        (Some(s), None) => Pick::Sequence(s),
        (None, Some(t)) => Pick::At(t),
        (None, None) => Pick::Newest,
    };
    match engine.restore(&folder, path, pick, to).await {
        Ok(r) => Reply::Restored(r),
        Err(e) => Reply::failed(e),
    }
}

/// Runs `f` on a blocking thread (see [`answer`] for why).
async fn blocking(
    engine: &Arc<Engine>,
    f: impl FnOnce(&Engine) -> Reply + Send + 'static,
) -> Reply {
    let engine = engine.clone();
    tokio::task::spawn_blocking(move || f(&engine))
        .await
        .unwrap_or_else(Reply::failed)
}

/// Sends one request to the daemon of `home` and returns its reply; `Ok(None)` when no daemon
/// is running there.
pub fn request(home: &Home, req: &Request) -> Result<Option<serde_json::Value>, ControlError> {
    use std::io::BufRead;
    use std::os::fd::AsFd;
    let path = home.control_socket();
    let stream = match std::os::unix::net::UnixStream::connect(&path) {
        Ok(s) => s,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            return Ok(None)
        }
        Err(source) => return Err(ControlError::Unreachable { path, source }),
    };
    let io = |source| ControlError::Io {
        path: path.clone(),
        source,
    };
    let mut line = serde_json::to_string(req).map_err(ControlError::Encode)?;
    line.push('\n');
    // Not `write_all`: the command line lets `SIGPIPE` end it, and a daemon that closes the
    // socket (stopping) is an error to report, not a silent death.
    let mut rest = line.as_bytes();
    while !rest.is_empty() {
        match meshfs_sys::send(stream.as_fd(), rest, libc::MSG_NOSIGNAL) {
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io(e)),
        }
    }
    line.clear();
    std::io::BufReader::new(stream)
        .read_line(&mut line)
        .map_err(io)?;
    if line.is_empty() {
        return Err(ControlError::NoAnswer { path });
    }
    serde_json::from_str(&line)
        .map(Some)
        .map_err(|source| ControlError::BadReply { path, source })
}

/// Serves the control socket ([`serve`]) on a thread and runtime of its own: a `status` is
/// read and answered there, so it never waits for a runtime worker that the engine keeps busy
/// (a receive at full speed on a 2-core laptop); other requests are carried out on the
/// engine's runtime (`main`).
fn serve_apart(
    engine: Arc<Engine>,
    ui: Arc<Ui>,
    listener: UnixListener,
    stop: Arc<tokio::sync::Notify>,
) -> std::io::Result<Apart> {
    let listener = listener.into_std()?;
    let main = tokio::runtime::Handle::current();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .thread_name("meshfs-control")
        .build()?;
    let quit = Arc::new(tokio::sync::Notify::new());
    let q = quit.clone();
    let thread = std::thread::Builder::new()
        .name("meshfs-control".into())
        .spawn(move || {
            rt.block_on(async move {
                match UnixListener::from_std(listener) {
                    Ok(l) => serve(engine, ui, l, stop, main, q).await,
                    Err(e) => tracing::error!(error = %e, "cannot serve the control socket"),
                }
            })
            // The runtime goes with this closure, and the connections' tasks with it: the
            // engine is no longer held here.
        })?;
    Ok(Apart { quit, thread })
}

/// The control socket's thread ([`serve_apart`]).
struct Apart {
    quit: Arc<tokio::sync::Notify>,
    thread: std::thread::JoinHandle<()>,
}

impl Apart {
    /// Stops serving and waits for the thread to end, so that everything it held (the engine,
    /// and through it the journal, whose close marks its log) is let go before the daemon exits.
    async fn end(self) {
        self.quit.notify_one();
        let thread = self.thread;
        let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    }
}

/// Runs the daemon for `home` until SIGINT/SIGTERM or a `stop` request. Under systemd
/// (`Type=notify`) it says `READY=1` once the folders are started, the endpoint listens and the
/// control socket answers, and `STOPPING=1` when it begins to stop.
pub async fn run_daemon(home: Home) -> anyhow::Result<()> {
    let listener = bind(&home)?;
    let engine = Engine::start(home.clone()).await?;
    let stop = Arc::new(tokio::sync::Notify::new());
    let ui = Arc::new(Ui::new(engine.clone()));
    ui.start_if_enabled();
    let control = serve_apart(engine.clone(), ui.clone(), listener, stop.clone())?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    sd_notify("READY=1\nSTATUS=running");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        _ = stop.notified() => {}
    }
    tracing::info!("stopping");
    sd_notify("STOPPING=1");
    ui.stop();
    engine.stop().await;
    control.end().await;
    let _ = std::fs::remove_file(home.control_socket());
    Ok(())
}

/// Whether a daemon answers on `home`'s control socket.
pub fn is_running(home: &Home) -> bool {
    Path::new(&home.control_socket()).exists()
        && std::os::unix::net::UnixStream::connect(home.control_socket()).is_ok()
}

/// Sends `state` to the service manager's `$NOTIFY_SOCKET` (sd_notify(3)), if there is one. A
/// failure is logged, never fatal: the daemon works the same without a service manager.
fn sd_notify(state: &str) {
    use std::os::linux::net::SocketAddrExt;
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let bytes = path.as_encoded_bytes();
    // A leading '@' names a socket in the abstract namespace.
    let addr = match bytes.strip_prefix(b"@") {
        Some(name) => std::os::unix::net::SocketAddr::from_abstract_name(name),
        None => std::os::unix::net::SocketAddr::from_pathname(&path),
    };
    let sent = addr.and_then(|addr| {
        let sock = std::os::unix::net::UnixDatagram::unbound()?;
        sock.send_to_addr(state.as_bytes(), &addr)
    });
    if let Err(e) = sent {
        tracing::warn!(socket = ?path, error = %e, "cannot notify the service manager");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn work() -> FolderId {
        FolderId::new("work").unwrap()
    }

    /// What the CLI has always sent, op by op, and the request it means.
    fn wire() -> Vec<(Value, Request)> {
        vec![
            (json!({"op": "status"}), Request::Status),
            (json!({"op": "reload"}), Request::Reload),
            (json!({"op": "stop"}), Request::Stop),
            (
                json!({"op": "scan", "folder": "work"}),
                Request::Scan { folder: work() },
            ),
            (
                json!({"op": "mount", "folder": "work", "mountpoint": "/home/u/w", "read_only": true}),
                Request::Mount {
                    folder: work(),
                    mountpoint: "/home/u/w".into(),
                    read_only: true,
                    at_ns: None,
                    allow_other: false,
                },
            ),
            (
                json!({"op": "unmount", "folder": "work"}),
                Request::Unmount {
                    folder: work(),
                    mountpoint: None,
                },
            ),
            (
                json!({"op": "restore", "folder": "work", "path": "a/b", "at_ns": 5}),
                Request::Restore {
                    folder: work(),
                    path: "a/b".into(),
                    seq: None,
                    at_ns: Some(5),
                    to: None,
                },
            ),
            (
                json!({"op": "override", "folder": "work"}),
                Request::Override { folder: work() },
            ),
            (
                json!({"op": "revert", "folder": "work"}),
                Request::Revert { folder: work() },
            ),
            (
                json!({"op": "pending", "folder": "work"}),
                Request::Pending {
                    folder: Some(work()),
                },
            ),
            (json!({"op": "ui"}), Request::Ui),
            (
                json!({"op": "pin", "folder": "work", "path": "photos"}),
                Request::Pin {
                    folder: work(),
                    path: "photos".into(),
                },
            ),
            (
                json!({"op": "unpin", "folder": "work", "path": "photos"}),
                Request::Unpin {
                    folder: work(),
                    path: "photos".into(),
                },
            ),
            (
                json!({"op": "evict", "folder": "work", "path": "videos"}),
                Request::Evict {
                    folder: work(),
                    path: "videos".into(),
                },
            ),
        ]
    }

    #[test]
    fn requests_keep_the_wire_form_the_cli_has_always_sent() {
        for (line, req) in wire() {
            assert_eq!(serde_json::to_value(&req).unwrap(), line);
            assert_eq!(Request::parse(&line.to_string()).unwrap(), req);
        }
        let mut sent: Vec<String> = wire().iter().map(|(l, _)| l["op"].to_string()).collect();
        let mut known: Vec<String> = Request::OPS.iter().map(|o| json!(o).to_string()).collect();
        sent.sort();
        known.sort();
        assert_eq!(sent, known, "Request::OPS lists every op");
    }

    #[test]
    fn a_pending_request_without_a_folder_asks_for_every_folder() {
        let req = Request::parse(r#"{"op":"pending"}"#).unwrap();
        assert_eq!(req, Request::Pending { folder: None });
        assert_eq!(
            serde_json::to_value(&req).unwrap(),
            json!({"op": "pending"})
        );
    }

    #[test]
    fn a_mount_request_letting_other_users_in_says_so_and_one_that_does_not_is_as_before() {
        let req = Request::Mount {
            folder: work(),
            mountpoint: "/m".into(),
            read_only: false,
            allow_other: true,
            at_ns: None,
        };
        let line = json!({"op": "mount", "folder": "work", "mountpoint": "/m", "read_only": false, "allow_other": true});
        assert_eq!(serde_json::to_value(&req).unwrap(), line);
        assert_eq!(Request::parse(&line.to_string()).unwrap(), req);
    }

    #[test]
    fn a_mount_request_without_read_only_mounts_read_write() {
        let req = Request::parse(r#"{"op":"mount","folder":"work","mountpoint":"/m"}"#).unwrap();
        assert!(matches!(
            req,
            Request::Mount {
                read_only: false,
                allow_other: false,
                ..
            }
        ));
    }

    #[test]
    fn an_unknown_op_is_answered_with_an_error_naming_it_and_the_ops_there_are() {
        let err = Request::parse(r#"{"op":"frobnicate","folder":"work"}"#).unwrap_err();
        assert!(
            matches!(&err, RequestError::UnknownOp(op) if op == "frobnicate"),
            "{err:?}"
        );
        let reply = serde_json::to_value(Reply::failed(&err)).unwrap();
        assert_eq!(reply["ok"], false);
        let text = reply["error"].as_str().unwrap();
        assert!(
            text.contains("unknown op \"frobnicate\"") && text.contains("status, reload, scan"),
            "{text}"
        );
    }

    #[test]
    fn malformed_requests_say_what_is_wrong() {
        let cases = [
            ("not json", "bad request"),
            (r#"{"folder":"work"}"#, "\"op\" must name one of status"),
            (r#"{"op":3}"#, "\"op\" must name one of status"),
            (
                r#"{"op":"scan"}"#,
                "bad scan request: missing field `folder`",
            ),
            (
                r#"{"op":"scan","folder":"a/b"}"#,
                "invalid folder id \"a/b\"",
            ),
            (
                r#"{"op":"mount","folder":"work"}"#,
                "missing field `mountpoint`",
            ),
        ];
        for (line, says) in cases {
            let err = Request::parse(line).unwrap_err().to_string();
            assert!(err.contains(says), "{line}: {err}");
        }
    }

    fn lines(input: &[u8]) -> (Vec<Line>, usize) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut r = input;
            let mut buf = Vec::new();
            let mut out = Vec::new();
            loop {
                let line = next_line(&mut r, &mut buf).await.unwrap();
                let stop = matches!(line, Line::End | Line::TooLong);
                out.push(line);
                if stop {
                    return (out, r.len());
                }
            }
        })
    }

    #[test]
    fn request_lines_are_read_one_by_one_up_to_the_limit() {
        let at_limit = "x".repeat(MAX_REQUEST_LINE);
        let input = format!("{{\"op\":\"status\"}}\n{at_limit}\nlast");
        let (got, left) = lines(input.as_bytes());
        assert_eq!(
            got,
            vec![
                Line::Text(r#"{"op":"status"}"#.into()),
                Line::Text(at_limit),
                Line::Text("last".into()),
                Line::End
            ]
        );
        assert_eq!(left, 0);
        let (got, _) = lines(b"\xff\n");
        assert_eq!(got[0], Line::Text("\u{fffd}".into()));
    }

    #[test]
    fn an_overlong_request_line_is_refused_without_reading_the_rest() {
        let first = b"{\"op\":\"status\"}\n";
        let mut input = first.to_vec();
        input.resize(input.len() + (16 << 20), b'x');
        let (got, left) = lines(&input);
        assert_eq!(got.len(), 2);
        assert_eq!(got[1], Line::TooLong);
        // Read: the first line and one byte past the limit of the second; nothing more.
        assert_eq!(input.len() - left, first.len() + MAX_REQUEST_LINE + 1);
    }

    #[test]
    fn replies_keep_their_wire_form() {
        let cases = [
            (Reply::Done, json!({"ok": true})),
            (Reply::Scanned(3), json!({"ok": true, "changes": 3})),
            (
                Reply::Unmounted("/home/u/w".into()),
                json!({"ok": true, "mountpoint": "/home/u/w"}),
            ),
            (
                Reply::Mounted(MountStatus {
                    mountpoint: "/m".into(),
                    mode: "read-only",
                    allow_other: false,
                    passthrough: false,
                    passthrough_off: Some(crate::mounts::PassthroughOffStatus {
                        code: "needs_cap_sys_admin",
                        why: "registering backing files needs CAP_SYS_ADMIN".into(),
                    }),
                    io_uring: true,
                    open_handles: 0,
                    invalidations_pending: 0,
                }),
                json!({"ok": true, "mount": {"mountpoint": "/m", "mode": "read-only",
                       "allow_other": false, "passthrough": false,
                       "passthrough_off": {"code": "needs_cap_sys_admin",
                                           "why": "registering backing files needs CAP_SYS_ADMIN"},
                       "io_uring": true, "open_handles": 0,
                       "invalidations_pending": 0}}),
            ),
            (
                Reply::Ui("http://127.0.0.1:8384/".into()),
                json!({"ok": true, "url": "http://127.0.0.1:8384/"}),
            ),
            (
                Reply::failed("folder work is not mounted"),
                json!({"ok": false, "error": "folder work is not mounted"}),
            ),
        ];
        for (reply, want) in cases {
            assert_eq!(serde_json::to_value(&reply).unwrap(), want);
        }
    }
}
