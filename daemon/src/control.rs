//! The control socket: a Unix socket in the state directory (mode 0600, owner only) through
//! which the CLI talks to the running daemon. Nothing else listens except the QUIC port.
//!
//! Protocol: the client sends one JSON object on one line (`{"op": "status"}`, `{"op": "scan",
//! "folder": "ID"}`, `{"op": "reload"}`, `{"op": "stop"}`) and reads one JSON object line back.
//! Errors come back as `{"ok": false, "error": "…"}`.

use crate::config::Home;
use crate::engine::Engine;
use meshfs_protocol::FolderId;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

/// Binds the control socket (replacing a stale one) with mode 0600.
pub fn bind(home: &Home) -> anyhow::Result<UnixListener> {
    let path = home.control_socket();
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(&path).is_ok() {
            anyhow::bail!(
                "a meshfs daemon is already running for {} (control socket {})",
                home.config_dir.display(),
                path.display()
            );
        }
        std::fs::remove_file(&path)?;
    }
    std::fs::create_dir_all(&home.state_dir)?;
    let listener = UnixListener::bind(&path)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Serves control requests until the daemon stops.
pub async fn serve(engine: Arc<Engine>, listener: UnixListener, stop: Arc<tokio::sync::Notify>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        if !same_user(&stream) {
            tracing::warn!("refused a control connection from another user");
            continue;
        }
        let engine = engine.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let _ = handle(engine, stream, stop).await;
        });
    }
}

fn same_user(stream: &UnixStream) -> bool {
    match stream.peer_cred() {
        Ok(cred) => cred.uid() == crate::sys::geteuid(),
        Err(_) => false,
    }
}

async fn handle(
    engine: Arc<Engine>,
    stream: UnixStream,
    stop: Arc<tokio::sync::Notify>,
) -> std::io::Result<()> {
    let (r, mut w) = stream.into_split();
    let mut lines = BufReader::new(r).lines();
    while let Some(line) = lines.next_line().await? {
        let reply = match serde_json::from_str::<serde_json::Value>(&line) {
            Err(e) => serde_json::json!({"ok": false, "error": format!("bad request: {e}")}),
            Ok(req) => match req.get("op").and_then(|v| v.as_str()).unwrap_or("") {
                // On a blocking thread: status reads the journal, whose lock an install holds
                // for tens of milliseconds, and `--wait-synced` asks every 10–25 ms; a runtime
                // worker waiting on it would stall the connections it drives.
                "status" => {
                    let engine = engine.clone();
                    tokio::task::spawn_blocking(move || engine.status())
                        .await
                        .unwrap_or_else(
                            |e| serde_json::json!({"ok": false, "error": e.to_string()}),
                        )
                }
                "reload" => match engine.reload().await {
                    Ok(()) => serde_json::json!({"ok": true}),
                    Err(e) => serde_json::json!({"ok": false, "error": e.to_string()}),
                },
                "scan" => {
                    let folder = req.get("folder").and_then(|v| v.as_str()).unwrap_or("");
                    match FolderId::new(folder) {
                        Err(e) => serde_json::json!({"ok": false, "error": e.to_string()}),
                        Ok(f) => match engine.scan_paths(&f, Vec::new()).await {
                            Ok(n) => serde_json::json!({"ok": true, "changes": n}),
                            Err(e) => serde_json::json!({"ok": false, "error": e}),
                        },
                    }
                }
                "mount" | "unmount" => mount_op(&engine, &req).await,
                "stop" => {
                    stop.notify_one();
                    serde_json::json!({"ok": true})
                }
                other => serde_json::json!({"ok": false, "error": format!("unknown op {other:?}")}),
            },
        };
        let mut out = reply.to_string();
        out.push('\n');
        w.write_all(out.as_bytes()).await?;
    }
    Ok(())
}

/// `mount` (`folder`, `mountpoint`, `read_only`) and `unmount` (`folder`), on a blocking
/// thread: mounting and unmounting wait for the kernel.
async fn mount_op(engine: &Arc<Engine>, req: &serde_json::Value) -> serde_json::Value {
    let folder = req.get("folder").and_then(|v| v.as_str()).unwrap_or("");
    let folder = match FolderId::new(folder) {
        Ok(f) => f,
        Err(e) => return serde_json::json!({"ok": false, "error": e.to_string()}),
    };
    let engine = engine.clone();
    let op = req
        .get("op")
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_string();
    let point = req
        .get("mountpoint")
        .and_then(|v| v.as_str())
        .map(std::path::PathBuf::from);
    let read_only = req.get("read_only").and_then(|v| v.as_bool()) == Some(true);
    let done = tokio::task::spawn_blocking(move || match (op.as_str(), point) {
        ("mount", Some(p)) => engine
            .mount(&folder, &p, read_only)
            .map(|m| serde_json::json!({"ok": true, "mount": m})),
        ("mount", None) => Err("mount needs a mountpoint".to_string()),
        _ => engine
            .unmount(&folder)
            .map(|p| serde_json::json!({"ok": true, "mountpoint": p})),
    })
    .await;
    match done {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => serde_json::json!({"ok": false, "error": e}),
        Err(e) => serde_json::json!({"ok": false, "error": e.to_string()}),
    }
}

/// Sends one request to the daemon of `home` and returns its reply; `Ok(None)` when no daemon
/// is running there.
pub fn request(home: &Home, req: &serde_json::Value) -> anyhow::Result<Option<serde_json::Value>> {
    use std::io::{BufRead, Write};
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
        Err(e) => {
            return Err(anyhow::anyhow!(
                "cannot reach the daemon at {}: {e}",
                path.display()
            ))
        }
    };
    let mut w = stream.try_clone()?;
    w.write_all(format!("{req}\n").as_bytes())?;
    let mut line = String::new();
    std::io::BufReader::new(stream).read_line(&mut line)?;
    if line.is_empty() {
        anyhow::bail!("the daemon closed the control connection without answering");
    }
    Ok(Some(serde_json::from_str(&line)?))
}

/// Runs the daemon for `home` until SIGINT/SIGTERM or a `stop` request. Under systemd
/// (`Type=notify`) it says `READY=1` once the folders are started, the endpoint listens and the
/// control socket answers, and `STOPPING=1` when it begins to stop.
pub async fn run_daemon(home: Home) -> anyhow::Result<()> {
    let listener = bind(&home)?;
    let engine = Engine::start(home.clone()).await?;
    let stop = Arc::new(tokio::sync::Notify::new());
    tokio::spawn(serve(engine.clone(), listener, stop.clone()));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    sd_notify("READY=1\nSTATUS=running");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        _ = stop.notified() => {}
    }
    tracing::info!("stopping");
    sd_notify("STOPPING=1");
    engine.stop().await;
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
