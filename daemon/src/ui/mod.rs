//! The page (`meshfs ui`, `docs/ui.md`): the daemon's state in a browser, live, for this
//! device's owner only. Off until `[ui] enabled = true` or a `meshfs ui` asks the running
//! daemon (control op `ui`) to serve it; from then on it serves until the daemon stops.
//!
//! Owns the loopback listener (`127.0.0.1` only, never another address), the per-start token
//! and its file in the state directory (mode 0600 in a 0700 directory: `meshfs ui` of the same
//! user reads it, no other user can). Shows what `status`, `conflicts` and `journal` show,
//! made by the same code (`readout`, `conflicts`, `status`); its only action is a rescan. It
//! never writes into a folder and never opens the journal for writing.
//!
//! `http` reads requests and writes answers, `guard` judges them, `site` routes them, `page`
//! writes the HTML, `live` keeps it current; `app.js` and `app.css` are shipped in the binary.

pub mod guard;
pub mod http;
pub mod live;
pub mod page;
pub mod site;

use crate::engine::Engine;
use guard::Token;
use site::Site;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Why the page cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum UiError {
    /// The port is taken (or not allowed).
    #[error("cannot listen on 127.0.0.1:{port} for the page: {source}; set another `port` under [ui] in {config} (0: any free port)")]
    Bind {
        /// The configured port.
        port: u16,
        /// The config file.
        config: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The token file cannot be written.
    #[error("cannot write the page's token to {path}: {source}")]
    TokenFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// The page of one daemon: not served until [`Ui::start`].
pub struct Ui {
    engine: Arc<Engine>,
    serving: Mutex<Option<Serving>>,
}

/// A page being served.
struct Serving {
    site: Arc<Site>,
    tasks: Vec<tokio::task::AbortHandle>,
}

/// The page's address for `port`, without the token.
pub fn address(port: u16) -> String {
    format!("http://127.0.0.1:{port}/")
}

impl Ui {
    /// The page of `engine`'s daemon, not served yet.
    pub fn new(engine: Arc<Engine>) -> Ui {
        Ui {
            engine,
            serving: Mutex::new(None),
        }
    }

    /// Serves the page if it is not served yet (on `[ui] port`, a free one if 0) with a new
    /// token written to the token file; returns its address (without the token). Must run
    /// inside the daemon's tokio runtime.
    pub fn start(&self) -> Result<String, UiError> {
        let mut serving = self.serving.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = serving.as_ref() {
            return Ok(address(s.site.port));
        }
        let home = &self.engine.home;
        let port = self.engine.config().ui.port;
        let bind = |source| UiError::Bind {
            port,
            config: home.config_file(),
            source,
        };
        let std_listener = std::net::TcpListener::bind(("127.0.0.1", port)).map_err(bind)?;
        std_listener.set_nonblocking(true).map_err(bind)?;
        let bound = std_listener.local_addr().map_err(bind)?.port();
        let listener = tokio::net::TcpListener::from_std(std_listener).map_err(bind)?;
        let token = Token::random();
        write_token(&home.state_dir, &home.ui_token_file(), &token)?;
        let site = Arc::new(Site::new(self.engine.clone(), bound, token));
        let tasks = vec![
            tokio::spawn(site::serve(site.clone(), listener)).abort_handle(),
            tokio::spawn(live::sample_loop(site.clone())).abort_handle(),
        ];
        tracing::info!(address = %address(bound), "serving the page (`meshfs ui` opens it)");
        *serving = Some(Serving { site, tasks });
        Ok(address(bound))
    }

    /// Starts serving if the config says so; a failure is logged (the daemon runs without
    /// the page, and `meshfs ui` reports the error).
    pub fn start_if_enabled(&self) {
        if self.engine.config().ui.enabled {
            if let Err(e) = self.start() {
                tracing::warn!(error = %e, "the page is enabled in the config but cannot be served");
            }
        }
    }

    /// Stops serving and removes the token file.
    pub fn stop(&self) {
        let mut serving = self.serving.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = serving.take() {
            for t in s.tasks {
                t.abort();
            }
            s.site.close();
            let _ = std::fs::remove_file(self.engine.home.ui_token_file());
        }
    }
}

/// Writes the token file: the state directory made the owner's alone first (as the engine
/// does at start), then the file.
fn write_token(
    state_dir: &std::path::Path,
    path: &std::path::Path,
    token: &Token,
) -> Result<(), UiError> {
    use std::os::unix::fs::PermissionsExt;
    let failed = |source| UiError::TokenFile {
        path: path.to_path_buf(),
        source,
    };
    std::fs::set_permissions(state_dir, std::fs::Permissions::from_mode(0o700)).map_err(failed)?;
    write_private(path, &format!("{}\n", token.as_str())).map_err(failed)
}

/// Writes `text` to a new file at `path` of mode 0600, replacing what was there (never
/// writing through it: a file left by someone else, or a link, is removed first).
pub fn write_private(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?
        .write_all(text.as_bytes())
}
