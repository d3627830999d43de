//! The page's server: accepts connections on the loopback listener (at most
//! [`MAX_CONNECTIONS`] at once, of which [`MAX_STREAMS`] event streams), reads one request,
//! lets `guard` judge it, and answers: the page (`/`), its script and style, its event stream
//! (`/events`), and its two actions, a rescan (`POST /scan?folder=ID`) and the restore of the
//! version a journal row names (`POST /restore?folder=ID&sequence=N`). Anything else is 404;
//! anything unjudged never reaches a route (an action needs the cookie and the page's own
//! origin: `guard`).

use super::guard::{self, Token, Verdict};
use super::http::{self, Request, Response};
use super::live::{self, Live, Viewer};
use super::page;
use crate::engine::Engine;
use crate::journal::Journal;
use meshfs_protocol::FolderId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

/// Connections served at once; more are closed as they come.
pub const MAX_CONNECTIONS: usize = 32;
/// Event streams (open pages) served at once; more are answered 503.
pub const MAX_STREAMS: usize = 8;

/// The page's script and style, shipped in the binary.
const APP_JS: &str = include_str!("app.js");
/// See [`APP_JS`].
const APP_CSS: &str = include_str!("app.css");

/// What every connection of one serving shares.
pub struct Site {
    /// The engine whose state is shown.
    pub engine: Arc<Engine>,
    /// The port on 127.0.0.1.
    pub port: u16,
    /// The token of this serving.
    pub token: Token,
    /// The samples.
    pub live: Live,
    /// The page's own read connection to the journal, opened at first use.
    journal: OnceLock<Mutex<Journal>>,
    connections: Arc<Semaphore>,
    streams: Arc<Semaphore>,
    /// Set when serving stops: open streams end.
    closing: watch::Sender<bool>,
}

impl Site {
    /// A site for `engine` on `port` with `token`.
    pub fn new(engine: Arc<Engine>, port: u16, token: Token) -> Site {
        Site {
            engine,
            port,
            token,
            live: Live::default(),
            journal: OnceLock::new(),
            connections: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
            streams: Arc::new(Semaphore::new(MAX_STREAMS)),
            closing: watch::channel(false).0,
        }
    }

    /// Ends the open event streams.
    pub fn close(&self) {
        self.closing.send_replace(true);
    }

    /// The page's journal connection (opened now if it is not yet). SQLite in WAL mode lets
    /// it read beside the engine's writes, as `meshfs journal` does.
    pub fn journal(&self) -> Result<MutexGuard<'_, Journal>, String> {
        let cell = match self.journal.get() {
            Some(cell) => cell,
            None => {
                let j = Journal::open_reader(&self.engine.home.journal_file())
                    .map_err(|e| e.to_string())?;
                let _ = self.journal.set(Mutex::new(j));
                self.journal
                    .get()
                    .ok_or_else(|| "the journal could not be opened".to_string())?
            }
        };
        cell.lock()
            .map_err(|_| "the page's journal connection failed earlier".to_string())
    }
}

/// Accepts connections until the task is aborted.
pub async fn serve(site: Arc<Site>, listener: TcpListener) {
    let mut pause = Duration::from_millis(10);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => {
                pause = Duration::from_millis(10);
                stream
            }
            Err(e) => {
                tracing::warn!(error = %e, "the page cannot accept a connection; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let Ok(permit) = site.connections.clone().try_acquire_owned() else {
            continue;
        };
        let site = site.clone();
        tokio::spawn(async move {
            let _permit = permit;
            connection(site, stream).await;
        });
    }
}

/// Serves one connection: one request, one answer (or an event stream).
async fn connection(site: Arc<Site>, mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let req = match http::read_request(&mut stream).await {
        Ok(req) => req,
        Err(e) => {
            if let Some(status) = e.status() {
                let _ = http::write_all(&mut stream, &Response::bare(status).to_bytes(false)).await;
            }
            return;
        }
    };
    let head_only = req.method == "HEAD";
    let answer = match guard::check(&req, site.port, &site.token) {
        Verdict::Refuse(status) => Response::bare(status),
        Verdict::Login { cookie, next } => login(&cookie, &next),
        Verdict::Pass if req.method == "GET" && req.path == "/events" => {
            return events(site, stream, req).await;
        }
        Verdict::Pass => route(&site, &req).await,
    };
    let _ = http::write_all(&mut stream, &answer.to_bytes(head_only)).await;
}

/// The answer to a login: the cookie, and a page that goes on to `next` by itself. Not a
/// redirect: a `SameSite=Strict` cookie is not sent along a redirect that began on another
/// site (the file `meshfs ui` opens), but is on a navigation this page makes.
fn login(cookie: &str, next: &str) -> Response {
    let next = page::esc(next);
    Response::new(
        200,
        "text/html; charset=utf-8",
        format!(
            "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
             <meta http-equiv=\"refresh\" content=\"0; url={next}\"><title>meshfs</title></head>\
             <body><p><a href=\"{next}\">Continue to the page</a></p></body></html>"
        ),
    )
    .with_header(format!("Set-Cookie: {cookie}"))
}

async fn route(site: &Arc<Site>, req: &Request) -> Response {
    let get = req.method == "GET" || req.method == "HEAD";
    match (get, req.method.as_str(), req.path.as_str()) {
        (true, _, "/") => document(site, req).await,
        (true, _, "/app.js") => Response::new(200, "text/javascript; charset=utf-8", APP_JS),
        (true, _, "/app.css") => Response::new(200, "text/css; charset=utf-8", APP_CSS),
        (true, _, "/events") => Response::new(200, "text/event-stream", ""),
        (_, "POST", "/scan") => scan(site, req).await,
        (_, "POST", "/restore") => restore(site, req).await,
        (_, _, "/" | "/app.js" | "/app.css" | "/events" | "/scan" | "/restore") => {
            Response::bare(405)
        }
        _ => Response::bare(404),
    }
}

/// The whole page, as it is now.
async fn document(site: &Arc<Site>, req: &Request) -> Response {
    let sample = match site.live.fresh() {
        Some(s) => s,
        None => match live::take_sample(site).await {
            Some(s) => Arc::new(s),
            None => return Response::bare(500),
        },
    };
    let mut viewer = Viewer::new(|k| req.param(k).map(String::from));
    let sections: HashMap<&'static str, String> =
        viewer.update(site, &sample).await.into_iter().collect();
    let restored = |n: &str| -> Option<String> {
        let seq = n.parse::<u64>().ok()?;
        let path = req.param("restored_path")?;
        Some(if req.param("unchanged").is_some() {
            format!("{path} already holds version {seq}: nothing to restore")
        } else {
            format!(
                "version {seq} of {path} restored: a new change of this device, sent to its peers"
            )
        })
    };
    let notice = match (
        req.param("scanned"),
        req.param("restored"),
        req.param("folder"),
    ) {
        (Some(n), _, Some(f)) => n
            .parse::<u64>()
            .ok()
            .map(|n| format!("rescan of folder {f}: {n} change(s) journaled")),
        (_, Some(n), Some(_)) => restored(n),
        _ => None,
    };
    let title = crate::readout::status::s(&sample.status["device"], "name").to_string();
    let form = page::filter_form(&viewer.form, &viewer.folder_ids());
    Response::new(
        200,
        "text/html; charset=utf-8",
        page::document(&title, &sections, &form, notice.as_deref()),
    )
}

/// `POST /scan?folder=ID`: a rescan of the folder now, then back to the page.
async fn scan(site: &Arc<Site>, req: &Request) -> Response {
    let Some(folder) = req.param("folder").and_then(|f| FolderId::new(f).ok()) else {
        return Response::bare(404);
    };
    match site.engine.scan_paths(&folder, Vec::new()).await {
        Ok(n) => Response::see_other(&format!(
            "/?folder={}&scanned={n}",
            http::encode(folder.as_str())
        )),
        Err(e) => Response::new(
            404,
            "text/html; charset=utf-8",
            format!(
                "<!doctype html><title>meshfs</title><p>{}</p><p><a href=\"/\">Back</a></p>",
                page::esc(&e.to_string())
            ),
        ),
    }
}

/// `POST /restore?folder=ID&sequence=N`: the version the journal row `N` names, brought back
/// as `meshfs restore FOLDER PATH --seq` does (a new change of this device, through the
/// store's safe path), then back to the page, which says what was done; or a page that says
/// why not (404: no such folder or version here; 409: it could not be written).
async fn restore(site: &Arc<Site>, req: &Request) -> Response {
    let folder = req.param("folder").and_then(|f| FolderId::new(f).ok());
    let sequence = req.param("sequence").and_then(|s| s.parse::<u64>().ok());
    let (Some(folder), Some(sequence)) = (folder, sequence) else {
        return Response::bare(404);
    };
    let error = |status: u16, what: String| {
        Response::new(
            status,
            "text/html; charset=utf-8",
            format!(
                "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
                 <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
                 <link rel=\"stylesheet\" href=\"/app.css\"><title>meshfs: not restored</title>\
                 </head><body><p class=\"notice warn\" id=\"not-restored\">not restored: {}</p>\
                 <p class=\"notice\"><a href=\"/?folder={}\">Back to the page</a></p></body></html>",
                page::esc(&what),
                page::esc(&http::encode(folder.as_str()))
            ),
        )
    };
    if site.engine.folders.get(&folder).is_none() {
        return error(404, format!("no folder {folder} runs here"));
    }
    let looked = {
        let (site, folder) = (site.clone(), folder.clone());
        tokio::task::spawn_blocking(move || {
            let j = site.journal()?;
            crate::versions::restore::version_of_row(&j, &folder, sequence)
                .map_err(|e| e.to_string())
        })
        .await
    };
    let (path, version) = match looked {
        Ok(Ok(found)) => found,
        Ok(Err(e)) => return error(404, e),
        Err(e) => return error(500, e.to_string()),
    };
    let pick = crate::versions::restore::Pick::Sequence(version);
    match site.engine.restore(&folder, path.clone(), pick, None).await {
        Ok(report) if report.failed.is_empty() => Response::see_other(&format!(
            "/?folder={}&restored={version}&restored_path={}{}",
            http::encode(folder.as_str()),
            http::encode(path.as_str()),
            if report.restored.is_empty() {
                "&unchanged=1"
            } else {
                ""
            }
        )),
        Ok(report) => error(
            409,
            report
                .failed
                .iter()
                .map(|f| format!("{}: {}", f.path, f.error))
                .collect::<Vec<_>>()
                .join("; "),
        ),
        Err(e) => error(409, e.to_string()),
    }
}

/// `GET /events`: the page's sections as they change, one `update` event per sample that
/// changed any, until the page goes away or serving stops.
async fn events(site: Arc<Site>, mut stream: TcpStream, req: Request) {
    let Ok(_stream_permit) = site.streams.clone().try_acquire_owned() else {
        let _ = http::write_all(&mut stream, &Response::bare(503).to_bytes(false)).await;
        return;
    };
    let mut head = http::event_stream_head();
    // A page whose stream ends (the daemon restarts) tries again after this long.
    head.extend_from_slice(b"retry: 2000\n\n");
    if http::write_all(&mut stream, &head).await.is_err() {
        return;
    }
    let mut viewer = Viewer::new(|k| req.param(k).map(String::from));
    let mut samples = site.live.subscribe();
    let mut closing = site.closing.subscribe();
    loop {
        tokio::select! {
            changed = samples.changed() => if changed.is_err() { return },
            _ = closing.wait_for(|c| *c) => return,
        }
        let Some(sample) = samples.borrow_and_update().clone() else {
            continue;
        };
        let changed = viewer.update(&site, &sample).await;
        if changed.is_empty() {
            continue;
        }
        let cost = &site.live.cost;
        // Written at once where the socket takes it all (it nearly always does), so that the
        // write is counted on this thread too.
        let (event, written) = cost.measure(|| {
            let data: serde_json::Map<String, serde_json::Value> = changed
                .into_iter()
                .map(|(id, html)| (id.to_string(), serde_json::Value::String(html)))
                .collect();
            let event = format!(
                "event: update\ndata: {}\n\n",
                serde_json::Value::Object(data)
            );
            let written = stream.try_write(event.as_bytes()).unwrap_or(0);
            (event, written)
        });
        cost.sent(event.len());
        if http::write_all(&mut stream, &event.as_bytes()[written..])
            .await
            .is_err()
        {
            return;
        }
    }
}
