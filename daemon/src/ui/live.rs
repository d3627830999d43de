//! What keeps the page live: one sampler takes the `status --json` document every [`TICK`]
//! while at least one page listens (none: it takes nothing), and each page (a [`Viewer`])
//! makes its sections from the samples: the header, folders and peers from each, the journal
//! rows again only when its folder's sequence or past versions (their count, the bytes their
//! vault holds: a row's content mark) moved, the conflicts only when a folder's
//! conflicts may have changed. A section is sent only when its HTML changed. The journal is
//! read through the page's own SQLite connection, on a blocking thread, never under the
//! engine's journal lock. What it all costs the daemon is counted ([`Cost`]) and logged at
//! debug level every [`COST_EVERY`] while a page listens.

use super::page::{self, FilterForm, Names, Rows};
use super::site::Site;
use crate::conflicts::ConflictFile;
use crate::readout::journal::{self as rows_of, Filter, Row};
use crate::readout::rates::History;
use crate::readout::status::{s, u};
use crate::versions::listing::{Content, ContentCheck};
use meshfs_protocol::FolderId;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use time::UtcOffset;
use tokio::sync::{watch, Notify};

/// How often a listened-to page gets news: under a second, so that it updates at least once a
/// second even when a sample waits for the journal lock behind an install.
pub const TICK: Duration = Duration::from_millis(500);
/// The journal rows a page shows unless it asks for fewer (`limit`), and the most it may ask.
pub const ROWS: usize = 100;
/// See [`ROWS`].
pub const MAX_ROWS: usize = 1000;

/// How often what the page cost is logged (at debug level) while a page listens.
pub const COST_EVERY: Duration = Duration::from_secs(5);

/// What serving the page has cost: the CPU time of the work it did, counted on the thread that
/// did each piece (status, rendering, journal reads, writing events), and what it sent.
#[derive(Default)]
pub struct Cost {
    cpu_ns: AtomicU64,
    samples: AtomicU64,
    events: AtomicU64,
    bytes: AtomicU64,
}

impl Cost {
    /// Runs `f`, counting the CPU time it takes on this thread.
    pub fn measure<T>(&self, f: impl FnOnce() -> T) -> T {
        let t0 = meshfs_sys::thread_cpu_time();
        let out = f();
        let spent = meshfs_sys::thread_cpu_time().saturating_sub(t0);
        self.cpu_ns
            .fetch_add(spent.as_nanos() as u64, Ordering::Relaxed);
        out
    }

    /// Counts an event of `bytes` sent.
    pub fn sent(&self, bytes: usize) {
        self.events.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// The counts so far: (CPU ns, samples, events, bytes).
    fn now(&self) -> [u64; 4] {
        [&self.cpu_ns, &self.samples, &self.events, &self.bytes].map(|c| c.load(Ordering::Relaxed))
    }
}

/// One status document and when it was taken.
pub struct Sample {
    /// When (for rates).
    pub at: Instant,
    /// When, in Unix seconds (for the clock on the page).
    pub unix: u64,
    /// The `status --json` document.
    pub status: Value,
}

/// The samples and who listens to them.
pub struct Live {
    tx: watch::Sender<Option<Arc<Sample>>>,
    kick: Notify,
    /// What serving has cost so far.
    pub cost: Cost,
}

impl Default for Live {
    fn default() -> Live {
        Live {
            tx: watch::channel(None).0,
            kick: Notify::new(),
            cost: Cost::default(),
        }
    }
}

impl Live {
    /// Listens to the samples; the newest comes at once if it is fresh, else one is taken now.
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Sample>>> {
        let mut rx = self.tx.subscribe();
        if self.fresh().is_some() {
            rx.mark_changed();
        } else {
            self.kick.notify_one();
        }
        rx
    }

    /// The newest sample, if it is younger than [`TICK`].
    pub fn fresh(&self) -> Option<Arc<Sample>> {
        self.tx.borrow().clone().filter(|s| s.at.elapsed() < TICK)
    }
}

/// Takes a sample every [`TICK`] while anyone listens, until the task is aborted; logs what
/// the page cost every [`COST_EVERY`] in which it did anything.
pub async fn sample_loop(site: Arc<Site>) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut logged_at, mut logged) = (Instant::now(), site.live.cost.now());
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = site.live.kick.notified() => {}
        }
        if logged_at.elapsed() >= COST_EVERY {
            let now = site.live.cost.now();
            if now != logged {
                let secs = logged_at.elapsed().as_secs_f64();
                let [cpu, samples, events, bytes] = [0, 1, 2, 3].map(|i| now[i] - logged[i]);
                tracing::debug!(
                    cpu_ms = cpu as f64 / 1e6,
                    secs,
                    percent_of_a_core = cpu as f64 / 1e7 / secs,
                    samples,
                    events,
                    kib = bytes / 1024,
                    "what the page cost"
                );
            }
            (logged_at, logged) = (Instant::now(), now);
        }
        if site.live.tx.receiver_count() == 0 {
            continue;
        }
        if let Some(sample) = take_sample(&site).await {
            site.live.tx.send_replace(Some(Arc::new(sample)));
        }
    }
}

/// The status document now, taken on a blocking thread (it reads the journal), the journal's
/// part through the page's own connection.
pub async fn take_sample(site: &Arc<Site>) -> Option<Sample> {
    let s = site.clone();
    let asked = Instant::now();
    let (status, started) = tokio::task::spawn_blocking(move || {
        let started = asked.elapsed();
        let status = s.live.cost.measure(|| {
            // Through the page's own connection: an install that holds the engine's journal
            // lock while the disk is slow does not hold up the page.
            let journal = s.journal().ok()?;
            serde_json::to_value(s.engine.status_reading(&journal)).ok()
        });
        (status, started)
    })
    .await
    .ok()?;
    let status = status?;
    let took = asked.elapsed();
    if took > TICK / 2 {
        tracing::debug!(
            ms = took.as_millis() as u64,
            waited_for_a_thread_ms = started.as_millis() as u64,
            "a status sample for the page was slow"
        );
    }
    site.live.cost.samples.fetch_add(1, Ordering::Relaxed);
    Some(Sample {
        at: Instant::now(),
        unix: crate::folder::now_secs(),
        status,
    })
}

/// One page's view: its time zone and journal filter, the samples it has seen (for rates)
/// and the sections it was sent.
pub struct Viewer {
    tz: UtcOffset,
    /// The filter as typed.
    pub form: FilterForm,
    limit: usize,
    history: History,
    sent: HashMap<&'static str, String>,
    rows_key: Option<(String, u64, u64, u64)>,
    conflicts_key: Option<Vec<(String, u64, u64)>>,
}

/// What the journal gave for one update.
#[derive(Default)]
struct Read {
    rows: Option<Rows>,
    conflicts: Option<Vec<(String, Vec<ConflictFile>)>>,
}

impl Viewer {
    /// A view with the page's parameters: `tz` (minutes east of UTC; UTC without it),
    /// `folder`, `path`, `device`, `since` and `limit`.
    pub fn new(param: impl Fn(&str) -> Option<String>) -> Viewer {
        let tz = param("tz")
            .and_then(|t| t.parse::<i32>().ok())
            .filter(|m| m.abs() <= 24 * 60)
            .and_then(|m| UtcOffset::from_whole_seconds(m * 60).ok())
            .unwrap_or(UtcOffset::UTC);
        let text = |k: &str| param(k).map(|v| v.trim().to_string()).unwrap_or_default();
        Viewer {
            tz,
            form: FilterForm {
                folder: text("folder"),
                path: text("path"),
                device: text("device"),
                since: text("since"),
            },
            limit: param("limit")
                .and_then(|l| l.parse::<usize>().ok())
                .map_or(ROWS, |l| l.clamp(1, MAX_ROWS)),
            history: History::default(),
            sent: HashMap::new(),
            rows_key: None,
            conflicts_key: None,
        }
    }

    /// The sections `sample` changes, by id (all of them the first time).
    pub async fn update(
        &mut self,
        site: &Arc<Site>,
        sample: &Sample,
    ) -> Vec<(&'static str, String)> {
        let cost = &site.live.cost;
        let (job, counted, rows_key, conflicts_key) = cost.measure(|| self.plan(sample));
        let read = if job.is_some() || counted.is_some() {
            let site = site.clone();
            tokio::task::spawn_blocking(move || {
                site.live.cost.measure(|| read(&site, job, counted))
            })
            .await
            .unwrap_or_default()
        } else {
            Read::default()
        };
        cost.measure(|| self.render(sample, read, rows_key, conflicts_key))
    }

    /// What an update must read from the journal (the rows, the conflicts), and the keys it
    /// reads them for.
    #[allow(clippy::type_complexity)]
    fn plan(
        &mut self,
        sample: &Sample,
    ) -> (
        Option<(FilterForm, UtcOffset, usize)>,
        Option<Vec<(String, u64, u64)>>,
        (String, u64, u64, u64),
        Vec<(String, u64, u64)>,
    ) {
        self.history.push(sample.at, sample.status.clone());
        let st = &sample.status;
        let folders: Vec<&Value> = st["folders"].as_array().into_iter().flatten().collect();
        if self.form.folder.is_empty() {
            if let Some(f) = folders.first() {
                self.form.folder = s(f, "id").to_string();
            }
        }
        let shown = folders.iter().find(|f| s(f, "id") == self.form.folder);
        let sequence = shown.map_or(0, |f| u(f, "sequence"));
        let (kept, kept_bytes) = shown.map_or((0, 0), |f| {
            (u(&f["versions"], "count"), u(&f["versions"], "bytes"))
        });
        let rows_key = (self.form.folder.clone(), sequence, kept, kept_bytes);
        let want_rows = self.rows_key.as_ref() != Some(&rows_key);
        // A folder's conflicts can change only when its count or (with some) its records do.
        let conflicts_key: Vec<(String, u64, u64)> = folders
            .iter()
            .map(|f| {
                let n = u(f, "conflicts");
                let seq = if n > 0 { u(f, "sequence") } else { 0 };
                (s(f, "id").to_string(), n, seq)
            })
            .collect();
        let want_conflicts = self.conflicts_key.as_ref() != Some(&conflicts_key);
        let job = want_rows.then(|| (self.form.clone(), self.tz, self.limit));
        let counted = want_conflicts.then(|| conflicts_key.clone());
        (job, counted, rows_key, conflicts_key)
    }

    /// The sections of `sample` with what the journal gave, those that changed.
    fn render(
        &mut self,
        sample: &Sample,
        read: Read,
        rows_key: (String, u64, u64, u64),
        conflicts_key: Vec<(String, u64, u64)>,
    ) -> Vec<(&'static str, String)> {
        let st = &sample.status;
        let names = Names::of(st);
        let mut now: Vec<(&'static str, String)> = vec![
            ("head", page::head(st, self.tz, sample.unix)),
            ("folders", page::folders(st, &self.history, self.tz)),
            ("peers", page::peers(st, &self.history, self.tz)),
        ];
        if let Some(c) = read.conflicts {
            now.push(("conflicts", page::conflicts(&c, &names)));
            self.conflicts_key = Some(conflicts_key);
        }
        if let Some(r) = read.rows {
            now.push(("rows", page::rows(&r, &names)));
            self.rows_key = Some(rows_key);
        }
        now.retain(|(id, html)| self.sent.get(id) != Some(html));
        for (id, html) in &now {
            self.sent.insert(id, html.clone());
        }
        now
    }

    /// The folder ids of the newest sample, for the filter's choice of folder.
    pub fn folder_ids(&self) -> Vec<String> {
        self.history
            .latest()
            .and_then(|st| st["folders"].as_array())
            .into_iter()
            .flatten()
            .map(|f| s(f, "id").to_string())
            .collect()
    }
}

/// Reads what an update needs from the journal (on a blocking thread).
fn read(
    site: &Site,
    rows: Option<(FilterForm, UtcOffset, usize)>,
    conflicts: Option<Vec<(String, u64, u64)>>,
) -> Read {
    let guard = site.journal();
    let journal: Result<&crate::journal::Journal, String> = guard.as_deref().map_err(Clone::clone);
    Read {
        rows: rows.map(|(form, tz, limit)| Rows {
            folder: form.folder.clone(),
            rows: journal
                .clone()
                .and_then(|j| journal_rows(site, j, &form, tz, limit)),
            limit,
        }),
        conflicts: conflicts.map(|folders| {
            folders
                .into_iter()
                .map(|(id, n, _)| {
                    let list = match (&journal, FolderId::new(&id)) {
                        (Ok(j), Ok(f)) if n > 0 => crate::conflicts::list(j, &f),
                        _ => Vec::new(),
                    };
                    (id, list)
                })
                .collect()
        }),
    }
}

/// The rows of `meshfs journal FOLDER --path … --device … --since … --limit N`, newest first,
/// each with where its content is (the `content` column of `meshfs journal`).
fn journal_rows(
    site: &Site,
    journal: &crate::journal::Journal,
    form: &FilterForm,
    tz: UtcOffset,
    limit: usize,
) -> Result<Vec<(Row, Content)>, String> {
    let folder = FolderId::new(&form.folder).map_err(|e| format!("folder: {e}"))?;
    let config = site.engine.config();
    if config.folder(&folder).is_none() {
        return Err(format!("no folder {:?} here", form.folder));
    }
    let nonempty = |s: &str| (!s.is_empty()).then(|| s.to_string());
    let since = nonempty(&form.since)
        .map(|s| rows_of::since(&s, rows_of::now_at(tz)))
        .transpose()
        .map_err(|e| format!("since: {e}"))?;
    let filter = Filter {
        path: nonempty(&form.path),
        device: nonempty(&form.device),
        since,
        limit: Some(limit),
        all: false,
    };
    let mut q = filter
        .query(&config, site.engine.device)
        .map_err(|e| match e {
            rows_of::FilterError::Path(e) => format!("path: {e}"),
            e => format!("device: {e}"),
        })?;
    q.newest = true;
    let entries = journal.history(&folder, &q).map_err(|e| e.to_string())?;
    // Where each version's content is: the vault asked chunk by chunk (a page shows a few
    // rows of what may be a large vault).
    let rt = site.engine.folders.get(&folder);
    let vault = rt.as_ref().and_then(|rt| rt.vault()).map(|v| v.as_ref());
    let mut check = ContentCheck::asking(journal, &folder, vault);
    let mut rows = Vec::with_capacity(entries.len());
    for e in entries.iter().rev() {
        let content = check.of(e).unwrap_or(Content::None);
        rows.push((Row::of(e), content));
    }
    Ok(rows)
}
