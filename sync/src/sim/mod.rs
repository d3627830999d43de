//! Deterministic simulation of many replicas in one thread (madsim and turmoil's method: a
//! seeded scheduler, everything else a state machine).
//!
//! N replicas, each with an in-memory filesystem and journal, run the REAL [`Session`] per
//! connected peer, the REAL receive [`Pipeline`] per folder and the REAL planner for every
//! received record; an executor modelled on the daemon's carries out the pipeline's actions
//! (`apply.rs`). One seeded RNG drives everything: random user operations (reported by a
//! modelled watcher some milliseconds later, and some timed to land just before an install of
//! the same path), message delays (FIFO within a connection's control stream, reordered between
//! connections), partitions and heals, crashes (between any two pipeline steps, and in the
//! middle of an apply) and restarts, fetches that complete out of order, fail when their peer
//! goes away, or arrive corrupt. Virtual time is in milliseconds.
//!
//! Invariants checked, with the seed in every failure:
//! - (a) after healing and going quiet, all replicas hold identical files and records;
//! - (b) every content written and not causally overwritten survives everywhere, at its
//!   path or as a conflict sibling;
//! - (c) vector comparisons match the true causal histories, so no conflict file appears
//!   unless two versions were truly concurrent;
//! - (d) a path's version vector never moves backwards on any journal commit;
//! - (e) no file is ever written with content other than its record's (verified before the
//!   atomic write), and after every event the files match the journal exactly — also after a
//!   crash and its recovery, so an interrupted apply is never re-captured as a local edit;
//! - (f) every replica that resolves the same two versions makes the same record (vector and
//!   state), so a resolution is never itself a new concurrent change;
//! - (g) no apply replaces (or removes, or writes above or below) a local change the watcher
//!   has not reported yet: it is rescanned and decided again;
//! - (h) a batch is acknowledged only once every record in it is in the journal (or a newer
//!   version is), or was skipped because its sender no longer had the content or its path
//!   changed under every round ([`crate::pipeline::MAX_ROUNDS`]).
//!
//! **Architecture invariant:** pure, like the modules it drives: no IO, no clock, no
//! threads. Trace lines are collected and returned, not printed.

mod apply;
mod ops;
mod replica;
mod truth;

use crate::pipeline::{BatchId, Pipeline};
use crate::plan::{Disk, Plan, Planned};
use crate::reconcile::{new_local_version, Context, Outcome, Step};
use crate::session::{Action, Session, SessionFolder};
use meshfs_protocol::{DeviceId, FileKind, FileRecord, FolderId, Hash, Message, RelPath, ShortId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use replica::{captured_record, Content, Fs, Journal, Node, Pending};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};
use std::fmt;
use truth::{EventInfo, EventKind, RecTruth, Truth};

/// Virtual epoch of the simulation's clocks (ms since the Unix epoch, in 2027).
const BASE_MS: i64 = 1_800_000_000_000;
/// A run that has not gone quiet after this many events has a livelock.
const MAX_EVENTS: u64 = 300_000;

/// What to simulate.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Seeds everything; the same seed replays the same run exactly.
    pub seed: u64,
    /// Number of replicas (2..=5 chosen by the seed when `None`).
    pub replicas: Option<usize>,
    /// Number of user operations (chosen by the seed when `None`).
    pub ops: Option<usize>,
    /// Collect a trace of every event.
    pub trace: bool,
}

impl SimConfig {
    /// The default workload for `seed`.
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            replicas: None,
            ops: None,
            trace: false,
        }
    }
}

/// What a successful run did.
#[derive(Clone, Debug, Default)]
pub struct SimReport {
    /// The seed.
    pub seed: u64,
    /// Replicas simulated.
    pub replicas: usize,
    /// User operations performed.
    pub ops: usize,
    /// Events processed.
    pub events: u64,
    /// Control-stream messages sent.
    pub messages: u64,
    /// Decisions per outcome (Debug name of the [`Outcome`] variant).
    pub outcomes: BTreeMap<String, u64>,
    /// Replica crashes (scheduled or in the middle of an apply).
    pub crashes: u64,
    /// Applies interrupted by a crash between the pending and applied marks.
    pub interrupted_applies: u64,
    /// Received records skipped because the sender no longer had their content (superseded).
    pub superseded: u64,
    /// Chunk fetches that failed or arrived corrupt and were retried.
    pub fetch_retries: u64,
    /// Batches decided while an earlier batch of the same session was not applied yet.
    pub ran_ahead: u64,
    /// Transfers whose content arrived before that of a transfer decided before them.
    pub out_of_order: u64,
    /// Records decided again because their target changed under the apply.
    pub redecided: u64,
    /// Local writes timed to land just before an install of the same path.
    pub race_writes: u64,
    /// Sessions ended because their batches could not be applied (a peer gone mid-fetch, a
    /// corrupt chunk); the peer sends them again.
    pub pipeline_failures: u64,
    /// Received records skipped because their path changed under every round of the pipeline
    /// (the local edits reach the peer, where the versions meet).
    pub skipped_changing: u64,
    /// Virtual time at quiescence, ms.
    pub virtual_ms: u64,
    /// Paths (records, tombstones included) on every replica at the end.
    pub paths: usize,
    /// Conflict siblings on every replica at the end.
    pub conflict_files: usize,
    /// The most distinct versions any one path had, over all replicas.
    pub max_versions_per_path: usize,
    /// The most versions made at one path beyond its user edits (resolutions, merges,
    /// siblings, kept directories), over all replicas.
    pub max_extra_versions_per_path: usize,
    /// Trace lines, when asked for.
    pub trace: Vec<String>,
}

/// A failed run: which invariant broke, and how to replay it.
#[derive(Clone, Debug)]
pub struct SimFailure {
    /// The seed.
    pub seed: u64,
    /// What went wrong.
    pub message: String,
    /// A command that replays this run with a trace.
    pub replay: String,
    /// Trace lines up to the failure, when asked for.
    pub trace: Vec<String>,
}

impl fmt::Display for SimFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "simulation seed {} failed: {}\nreplay: {}",
            self.seed, self.message, self.replay
        )
    }
}

/// The command that replays `cfg`'s run verbosely.
pub fn replay_command(cfg: &SimConfig) -> String {
    let mut s = format!(
        "cargo run -p meshfs-sync --example simulate -- --seed {}",
        cfg.seed
    );
    if let Some(k) = cfg.replicas {
        s.push_str(&format!(" --replicas {k}"));
    }
    if let Some(o) = cfg.ops {
        s.push_str(&format!(" --ops {o}"));
    }
    s
}

/// Runs one simulation to quiescence and checks every invariant.
pub fn run(cfg: &SimConfig) -> Result<SimReport, SimFailure> {
    let mut sim = Sim::new(cfg);
    match sim.run() {
        Ok(()) => {
            sim.report.trace = sim.trace.take().unwrap_or_default();
            Ok(sim.report)
        }
        Err(message) => Err(SimFailure {
            seed: cfg.seed,
            message,
            replay: replay_command(cfg),
            trace: sim.trace.take().unwrap_or_default(),
        }),
    }
}

type Res<T> = Result<T, String>;

enum Event {
    UserOp(usize),
    Connect(usize, usize),
    LinkDown(usize, usize),
    LinkUp(usize, usize),
    Crash(usize),
    Restart(usize),
    Heal,
    Deliver {
        conn: u64,
        to_side: usize,
        msg: Message,
    },
    /// A step of a replica's receive pipeline, due now (`epoch`: the replica's life it
    /// belongs to; a crash ends it).
    Step {
        replica: usize,
        epoch: u64,
        step: apply::Step,
    },
    /// The replica's watcher reports its local changes: they are captured.
    Capture {
        replica: usize,
        epoch: u64,
    },
    /// A local write to `path`, timed to land just before an install there.
    RaceWrite {
        replica: usize,
        path: RelPath,
    },
}

struct Replica {
    dev: DeviceId,
    short: ShortId,
    name: String,
    fs: Fs,
    journal: Journal,
    alive: bool,
    skew_ms: i64,
    /// The receive pipeline of the folder (the real one), and what its executor holds per
    /// batch.
    pipe: Pipeline,
    work: HashMap<BatchId, apply::Work>,
    /// Incremented by every crash: pipeline steps scheduled before it are void.
    epoch: u64,
    /// Paths the user changed that are not captured yet (the watcher reports them a little
    /// later), in the order they changed.
    uncaptured: Vec<RelPath>,
}

/// A connection: one control stream, one session at each end.
struct Conn {
    ends: [usize; 2],
    sessions: [Session; 2],
    /// Delivery time of the last message towards each end (FIFO per direction).
    last_at: [u64; 2],
}

struct Sim {
    rng: StdRng,
    now: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    events: HashMap<u64, Event>,
    next_event: u64,
    replicas: Vec<Replica>,
    conns: BTreeMap<u64, Conn>,
    next_conn: u64,
    /// Links of the topology (a < b) and whether each is up.
    links: BTreeMap<(usize, usize), bool>,
    truth: Truth,
    /// Every resolution made, by the pair it resolved: its result and the replica that made it.
    resolutions: HashMap<String, (FileRecord, usize)>,
    folder: FolderId,
    unique: u64,
    crash_apply_p: f64,
    fetch_fail_p: f64,
    report: SimReport,
    trace: Option<Vec<String>>,
}

fn key(a: usize, b: usize) -> (usize, usize) {
    (a.min(b), a.max(b))
}

impl Sim {
    fn new(cfg: &SimConfig) -> Sim {
        let mut rng = StdRng::seed_from_u64(cfg.seed);
        let n = cfg.replicas.unwrap_or_else(|| rng.gen_range(2..=5)).max(1);
        let ops = cfg.ops.unwrap_or_else(|| rng.gen_range(6..=24));
        let replicas = (0..n)
            .map(|i| {
                let dev = DeviceId::from_bytes(rng.gen());
                Replica {
                    dev,
                    short: dev.short(),
                    name: format!("r{i}"),
                    fs: Fs::default(),
                    journal: Journal::new(rng.gen::<u64>() | 1),
                    alive: true,
                    skew_ms: rng.gen_range(-2000..=2000),
                    pipe: Pipeline::new(),
                    work: HashMap::new(),
                    epoch: 0,
                    uncaptured: Vec::new(),
                }
            })
            .collect();
        let folder = FolderId::new("sim").unwrap_or_else(|_| unreachable!("a valid folder id"));
        let mut sim = Sim {
            rng,
            now: 0,
            queue: BinaryHeap::new(),
            events: HashMap::new(),
            next_event: 0,
            replicas,
            conns: BTreeMap::new(),
            next_conn: 1,
            links: BTreeMap::new(),
            truth: Truth::default(),
            resolutions: HashMap::new(),
            folder,
            unique: 0,
            crash_apply_p: 0.0,
            fetch_fail_p: 0.1,
            report: SimReport {
                seed: cfg.seed,
                replicas: n,
                ops,
                ..SimReport::default()
            },
            trace: cfg.trace.then(Vec::new),
        };
        sim.setup(n, ops);
        sim
    }

    fn log(&mut self, line: impl FnOnce() -> String) {
        let now = self.now;
        if let Some(t) = &mut self.trace {
            t.push(format!("{now:>6}ms {}", line()));
        }
    }

    fn schedule(&mut self, at: u64, ev: Event) {
        self.next_event += 1;
        self.events.insert(self.next_event, ev);
        self.queue.push(Reverse((at, self.next_event)));
    }

    /// Topology, user operations, partitions and crashes, all drawn from the seed.
    fn setup(&mut self, n: usize, ops: usize) {
        let topology = self.rng.gen_range(0..5);
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            order.swap(i, self.rng.gen_range(0..=i));
        }
        let name = match (n, topology) {
            (2, _) | (_, 0 | 1) => {
                for a in 0..n {
                    for b in a + 1..n {
                        self.links.insert((a, b), true);
                    }
                }
                "full mesh"
            }
            (_, 2) => {
                for w in order.windows(2) {
                    self.links.insert(key(w[0], w[1]), true);
                }
                "chain"
            }
            (_, 3) => {
                for &o in &order[1..] {
                    self.links.insert(key(order[0], o), true);
                }
                "hub"
            }
            _ => {
                // A random spanning tree plus a random extra link or two.
                for i in 1..n {
                    let parent = order[self.rng.gen_range(0..i)];
                    self.links.insert(key(parent, order[i]), true);
                }
                for _ in 0..self.rng.gen_range(0..=2) {
                    let (a, b) = (self.rng.gen_range(0..n), self.rng.gen_range(0..n));
                    if a != b {
                        self.links.insert(key(a, b), true);
                    }
                }
                "random graph"
            }
        };
        let links: Vec<_> = self.links.keys().copied().collect();
        self.log(|| format!("{n} replicas, {name} {links:?}, {ops} operations"));
        let span = ops as u64 * 40 + 200;
        for _ in 0..ops {
            let (r, t) = (self.rng.gen_range(0..n), self.rng.gen_range(0..span));
            self.schedule(t, Event::UserOp(r));
        }
        let links: Vec<(usize, usize)> = self.links.keys().copied().collect();
        for _ in 0..self.rng.gen_range(0..=3) {
            let (a, b) = links[self.rng.gen_range(0..links.len())];
            let t = self.rng.gen_range(0..span);
            self.schedule(t, Event::LinkDown(a, b));
            let back = t + self.rng.gen_range(10..=span / 2);
            if back < span {
                self.schedule(back, Event::LinkUp(a, b));
            }
        }
        if self.rng.gen_bool(0.4) {
            self.crash_apply_p = 0.05;
            for _ in 0..self.rng.gen_range(1..=2) {
                let r = self.rng.gen_range(0..n);
                let t = self.rng.gen_range(0..span);
                self.schedule(t, Event::Crash(r));
                let back = t + self.rng.gen_range(5..=300);
                self.schedule(back, Event::Restart(r));
            }
        }
        for (a, b) in links {
            let t = self.rng.gen_range(0..20);
            self.schedule(t, Event::Connect(a, b));
        }
        self.schedule(span, Event::Heal);
    }

    fn run(&mut self) -> Res<()> {
        while let Some(Reverse((t, id))) = self.queue.pop() {
            self.report.events += 1;
            if self.report.events > MAX_EVENTS {
                return Err(format!(
                    "no quiescence after {MAX_EVENTS} events (livelock?)"
                ));
            }
            self.now = t;
            let Some(ev) = self.events.remove(&id) else {
                continue;
            };
            self.handle(ev)?;
        }
        self.report.virtual_ms = self.now;
        self.final_checks()
    }

    fn handle(&mut self, ev: Event) -> Res<()> {
        match ev {
            Event::UserOp(r) => self.user_op(r),
            Event::Connect(a, b) => self.connect(a, b),
            Event::LinkDown(a, b) => {
                self.links.insert(key(a, b), false);
                self.log(|| format!("link r{a}-r{b} down"));
                self.disconnect(a, b)
            }
            Event::LinkUp(a, b) => {
                self.links.insert(key(a, b), true);
                self.log(|| format!("link r{a}-r{b} up"));
                let t = self.now + self.rng.gen_range(1..=30);
                self.schedule(t, Event::Connect(a, b));
                Ok(())
            }
            Event::Crash(r) => self.crash(r),
            Event::Restart(r) => self.restart(r),
            Event::Heal => self.heal(),
            Event::Deliver { conn, to_side, msg } => {
                let Some(c) = self.conns.get_mut(&conn) else {
                    return Ok(());
                };
                let r = c.ends[to_side];
                let acts = c.sessions[to_side].handle(msg, &mut self.replicas[r].journal);
                self.process(conn, to_side, acts)
            }
            Event::Step {
                replica,
                epoch,
                step,
            } => {
                if !self.replicas[replica].alive || self.replicas[replica].epoch != epoch {
                    return Ok(());
                }
                self.step(replica, step)
            }
            Event::Capture { replica, epoch } => {
                if !self.replicas[replica].alive || self.replicas[replica].epoch != epoch {
                    return Ok(());
                }
                self.capture(replica)
            }
            Event::RaceWrite { replica, path } => self.race_write(replica, path),
        }
    }

    fn clock_ms(&self, r: usize) -> i64 {
        BASE_MS + self.now as i64 + self.replicas[r].skew_ms
    }

    fn ctx(&self, r: usize) -> Context {
        Context {
            local_device: self.replicas[r].short,
            now_secs: (self.clock_ms(r) / 1000) as u64,
        }
    }

    fn conns_of(&self, r: usize) -> Vec<(u64, usize)> {
        self.conns
            .iter()
            .filter_map(|(&id, c)| c.ends.iter().position(|&e| e == r).map(|side| (id, side)))
            .collect()
    }

    // ---- network ----

    fn connect(&mut self, a: usize, b: usize) -> Res<()> {
        let up = self.links.get(&key(a, b)).copied().unwrap_or(false);
        let exists = self
            .conns
            .values()
            .any(|c| c.ends.contains(&a) && c.ends.contains(&b));
        if !up || exists || !self.replicas[a].alive || !self.replicas[b].alive {
            return Ok(());
        }
        let id = self.next_conn;
        self.next_conn += 1;
        let sessions = [self.new_session(a, b), self.new_session(b, a)];
        self.conns.insert(
            id,
            Conn {
                ends: [a, b],
                sessions,
                last_at: [0, 0],
            },
        );
        self.log(|| format!("connect r{a}-r{b} (conn {id})"));
        for side in 0..2 {
            let Some(c) = self.conns.get_mut(&id) else {
                return Ok(());
            };
            let r = c.ends[side];
            let acts = c.sessions[side].start(&mut self.replicas[r].journal);
            self.process(id, side, acts)?;
        }
        Ok(())
    }

    fn new_session(&self, r: usize, peer: usize) -> Session {
        let me = &self.replicas[r];
        let peer_dev = self.replicas[peer].dev;
        let p = me.journal.peers.get(&peer_dev).cloned().unwrap_or_default();
        let f = SessionFolder {
            folder: self.folder.clone(),
            index_id: me.journal.index_id,
            their_index_id: p.their_index_id,
            their_sequence: p.their_sequence,
            our_acked: p.our_acked,
            scanning: false,
            partial: false,
        };
        Session::new(me.name.clone(), peer_dev, vec![f])
    }

    fn drop_conn(&mut self, id: u64) -> Res<()> {
        if let Some(c) = self.conns.remove(&id) {
            for r in c.ends {
                self.replicas[r]
                    .pipe
                    .source_gone(crate::pipeline::Source(id));
                self.pump(r)?;
            }
        }
        Ok(())
    }

    fn disconnect(&mut self, a: usize, b: usize) -> Res<()> {
        let ids: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.ends.contains(&a) && c.ends.contains(&b))
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            self.drop_conn(id)?;
        }
        Ok(())
    }

    /// Executes a session's actions for the replica at `side` of connection `id`.
    fn process(&mut self, id: u64, side: usize, acts: Vec<Action>) -> Res<()> {
        for act in acts {
            let Some(c) = self.conns.get_mut(&id) else {
                return Ok(());
            };
            let (r, peer) = (c.ends[side], c.ends[1 - side]);
            match act {
                Action::Send(msg) => {
                    let delay = self.rng.gen_range(1..=20);
                    let at = c.last_at[1 - side].max(self.now + delay);
                    c.last_at[1 - side] = at;
                    self.report.messages += 1;
                    self.schedule(
                        at,
                        Event::Deliver {
                            conn: id,
                            to_side: 1 - side,
                            msg,
                        },
                    );
                }
                Action::Receive {
                    folder,
                    records,
                    up_to,
                    ..
                } => {
                    let n = records.len();
                    self.log(|| format!("r{r} receives {n} records from r{peer} up to {up_to}"));
                    self.receive(r, id, peer, folder, records, up_to)?;
                }
                Action::SaveTheirSequence {
                    index_id, sequence, ..
                } => {
                    let pdev = self.replicas[peer].dev;
                    let p = self.replicas[r].journal.peers.entry(pdev).or_default();
                    if p.their_index_id == index_id && sequence < p.their_sequence {
                        return Err(format!(
                            "r{r}: progress of r{peer} moved backwards {} -> {sequence}",
                            p.their_sequence
                        ));
                    }
                    p.their_index_id = index_id;
                    p.their_sequence = sequence;
                }
                Action::SaveOurAcked { sequence, .. } => {
                    let pdev = self.replicas[peer].dev;
                    let p = self.replicas[r].journal.peers.entry(pdev).or_default();
                    p.our_acked = p.our_acked.max(sequence);
                }
                Action::Close { reason } => {
                    return Err(format!("session r{r}->r{peer} closed: {reason}"));
                }
                // The simulation's replicas are all connected: no addresses to exchange.
                Action::Sought { .. } | Action::Learned(_) => {}
            }
        }
        Ok(())
    }

    /// The journal of `r` grew: every session of `r` may send.
    fn notify(&mut self, r: usize) -> Res<()> {
        for (id, side) in self.conns_of(r) {
            let Some(c) = self.conns.get_mut(&id) else {
                continue;
            };
            let acts = c.sessions[side].local_changed(&self.folder, &mut self.replicas[r].journal);
            self.process(id, side, acts)?;
        }
        Ok(())
    }

    // ---- crashes ----

    fn crash(&mut self, r: usize) -> Res<()> {
        if !self.replicas[r].alive {
            return Ok(());
        }
        self.replicas[r].alive = false;
        self.report.crashes += 1;
        self.log(|| format!("r{r} CRASHES"));
        // Everything in memory goes: the pipeline, its steps under way, what they made.
        let rep = &mut self.replicas[r];
        rep.epoch += 1;
        rep.pipe = Pipeline::new();
        rep.work.clear();
        for (id, _) in self.conns_of(r) {
            self.drop_conn(id)?;
        }
        Ok(())
    }

    /// Start-up after a crash: complete the interrupted apply (the longest prefix of its
    /// steps that the files already show), then the scan must find nothing to capture.
    fn restart(&mut self, r: usize) -> Res<()> {
        if self.replicas[r].alive {
            return Ok(());
        }
        self.replicas[r].alive = true;
        let pending = std::mem::take(&mut self.replicas[r].journal.pending);
        let total = pending.len();
        let mut done = 0;
        for p in pending {
            if !self.replicas[r].fs.matches(&p.record) {
                break;
            }
            self.commit_one(r, p)?;
            done += 1;
        }
        self.log(|| format!("r{r} restarts: {done} of {total} pending steps completed"));
        // The start-up scan journals what the user changed before the crash.
        self.capture(r)?;
        self.check_consistency(r).map_err(|e| {
            format!(
                "after crash recovery (a remote version would be re-captured as a local edit): {e}"
            )
        })?;
        for (&(a, b), &up) in &self.links.clone() {
            if up && (a == r || b == r) {
                let t = self.now + self.rng.gen_range(1..=30);
                self.schedule(t, Event::Connect(a, b));
            }
        }
        Ok(())
    }

    fn heal(&mut self) -> Res<()> {
        self.log(|| "HEAL: all links up, all replicas running".to_string());
        self.crash_apply_p = 0.0;
        // Corrupt chunks end a session; rarer from here, so the run goes quiet.
        self.fetch_fail_p = self.fetch_fail_p.min(0.02);
        for up in self.links.values_mut() {
            *up = true;
        }
        for r in 0..self.replicas.len() {
            self.restart(r)?;
        }
        for (a, b) in self.links.keys().copied().collect::<Vec<_>>() {
            let t = self.now + self.rng.gen_range(1..=30);
            self.schedule(t, Event::Connect(a, b));
        }
        Ok(())
    }

    // ---- local changes ----

    fn user_op(&mut self, r: usize) -> Res<()> {
        if !self.replicas[r].alive {
            return Ok(());
        }
        let now_ns = self.clock_ms(r) * 1_000_000;
        let (desc, changed) = ops::random_op(
            &mut self.rng,
            &mut self.replicas[r].fs,
            now_ns,
            &mut self.unique,
        );
        self.log(|| format!("r{r} user: {desc}"));
        self.changed_locally(r, changed);
        Ok(())
    }

    /// A local write to `path` timed to land just before an install there (a user saving a
    /// file the moment a peer's version of it arrives).
    fn race_write(&mut self, r: usize, path: RelPath) -> Res<()> {
        if !self.replicas[r].alive {
            return Ok(());
        }
        let now_ns = self.clock_ms(r) * 1_000_000;
        let fs = &mut self.replicas[r].fs;
        if !ops::write_at(&mut self.rng, fs, &path, now_ns, &mut self.unique) {
            return Ok(());
        }
        self.report.race_writes += 1;
        self.log(|| format!("r{r} user (racing an install): write {path}"));
        self.changed_locally(r, vec![path]);
        Ok(())
    }

    /// The user changed `paths` on disk: the watcher reports them after a little while, and
    /// until then they are the user's alone (no apply may replace them, invariant (g)).
    fn changed_locally(&mut self, r: usize, paths: Vec<RelPath>) {
        self.replicas[r].uncaptured.extend(paths);
        let at = self.now + self.rng.gen_range(0..=30);
        let epoch = self.replicas[r].epoch;
        self.schedule(at, Event::Capture { replica: r, epoch });
    }

    /// Journals every local change not captured yet, as the scanner would: new paths parents
    /// first, deletions children first.
    fn capture(&mut self, r: usize) -> Res<()> {
        let mut paths = std::mem::take(&mut self.replicas[r].uncaptured);
        if paths.is_empty() {
            return Ok(());
        }
        paths.sort();
        paths.dedup();
        let fs = &self.replicas[r].fs;
        // As the scanner orders them: deletions below a path that is now a file or a symlink,
        // then creations parents first, then the other deletions children first.
        let replaced: Vec<RelPath> = paths
            .iter()
            .filter(|p| fs.nodes.get(*p).is_some_and(|n| n.kind() != FileKind::Dir))
            .cloned()
            .collect();
        paths.sort_by_key(|p| {
            let depth = p.components().count();
            match fs.nodes.contains_key(p) {
                true => (1, depth),
                false if replaced.iter().any(|d| p.is_within(d) && p != d) => {
                    (0, usize::MAX - depth)
                }
                false => (2, usize::MAX - depth),
            }
        });
        let now_ns = self.clock_ms(r) * 1_000_000;
        let ctx = self.ctx(r);
        for path in paths {
            let rep = &self.replicas[r];
            let prev = rep.journal.record(&path).cloned();
            let node = rep.fs.nodes.get(&path).cloned();
            let unchanged = match (&node, &prev) {
                (Some(n), Some(p)) => n.matches(p),
                (None, Some(p)) => p.deleted,
                (None, None) => true,
                (Some(_), None) => false,
            };
            if unchanged {
                continue;
            }
            let version = new_local_version(prev.as_ref(), &ctx);
            let rec = captured_record(
                &path,
                node.as_ref(),
                prev.as_ref(),
                version,
                rep.short,
                now_ns,
            );
            let u = self.truth.alloc();
            let mut t = self.truth.of(prev.as_ref())?;
            t.hist.insert(u);
            t.content = if rec.deleted {
                BTreeSet::new()
            } else {
                BTreeSet::from([u])
            };
            let info = EventInfo {
                path: path.clone(),
                kind: EventKind::User,
                content: (!rec.deleted).then_some((rec.kind, rec.hash)),
                replica: r,
            };
            let pending = Pending {
                record: rec,
                source: None,
                truth: t,
                transfers: BTreeSet::new(),
                event: Some((u, info)),
            };
            self.commit_one(r, pending)?;
        }
        self.check_consistency(r)?;
        self.notify(r)
    }

    // ---- applying a peer's records ----

    /// Carries out a decision whole: pending records, file writes (a crash may strike between
    /// any two), applied records. Returns whether the replica crashed.
    #[allow(dead_code)]
    fn execute(
        &mut self,
        r: usize,
        sender: usize,
        remote: &FileRecord,
        d: &Plan,
        blobs: &HashMap<Hash, Vec<u8>>,
    ) -> Res<bool> {
        if d.steps.is_empty() {
            return Ok(false);
        }
        let pending = self.pending_steps(r, sender, remote, d)?;
        let steps = pending.into_iter().enumerate().collect();
        self.run_steps(r, d, steps, blobs)
    }

    /// Carries out some steps of a decision (`steps`: their indexes and journal records, in
    /// order), as the daemon does the part of a decision it does at once or at an install:
    /// pending records, file writes (a crash may strike between any two), applied records.
    /// Returns whether the replica crashed.
    fn run_steps(
        &mut self,
        r: usize,
        d: &Plan,
        steps: Vec<(usize, Pending)>,
        blobs: &HashMap<Hash, Vec<u8>>,
    ) -> Res<bool> {
        if steps.is_empty() {
            return Ok(false);
        }
        let idx: Vec<usize> = steps.iter().map(|(i, _)| *i).collect();
        self.replicas[r].journal.pending = steps.into_iter().map(|(_, p)| p).collect();
        let n = idx.len();
        let crash_at = if self.crash_apply_p > 0.0 && self.rng.gen_bool(self.crash_apply_p) {
            Some(self.rng.gen_range(0..=n))
        } else {
            None
        };
        for (k, &i) in idx.iter().enumerate() {
            if crash_at == Some(k) {
                self.report.interrupted_applies += 1;
                self.log(|| format!("r{r} crash after {k} of {n} writes"));
                self.crash(r)?;
                return Ok(true);
            }
            self.write(r, &d.steps[i], blobs)?;
        }
        if crash_at == Some(n) {
            self.report.interrupted_applies += 1;
            self.log(|| format!("r{r} crash after all {n} writes, before marking them applied"));
            self.crash(r)?;
            return Ok(true);
        }
        for p in std::mem::take(&mut self.replicas[r].journal.pending) {
            self.commit_one(r, p)?;
        }
        Ok(false)
    }

    /// (f) A resolution depends on the two versions it resolves, not on who resolves them:
    /// every replica that resolves the same pair makes the same record at the path (same
    /// vector, same state), so no resolution is itself a new concurrent change. Decisions
    /// that look around the path (a directory kept for its children, revived ancestors)
    /// depend on more than the pair and are not compared.
    fn check_resolution(
        &mut self,
        r: usize,
        local: &FileRecord,
        remote: &FileRecord,
        d: &Plan,
    ) -> Res<()> {
        let resolves = matches!(
            d.outcome,
            Outcome::Conflict { .. }
                | Outcome::MergedNoConflict
                | Outcome::DeleteLostToModify { .. }
        );
        let Some(last) = d.steps.last().filter(|_| resolves) else {
            return Ok(());
        };
        let result = match &last.step {
            Step::ApplyRemote { record } | Step::UpdateLocal { record } => record,
            _ => return Ok(()),
        };
        let mut pair = [local.clone(), remote.clone()];
        for p in &mut pair {
            p.sequence = 0;
        }
        pair.sort_by(|a, b| format!("{:?}", a.version).cmp(&format!("{:?}", b.version)));
        let key = format!("{}|{:?}|{:?}", remote.path, pair[0], pair[1]);
        match self.resolutions.get(&key) {
            Some((other, first)) if other != result => Err(format!(
                "(f) r{r} resolved {} {} vs {} into {:?}, r{first} into {:?}",
                remote.path, local.version, remote.version, result, other
            )),
            Some(_) => Ok(()),
            None => {
                self.resolutions.insert(key, (result.clone(), r));
                Ok(())
            }
        }
    }

    /// The journal records of a decision's steps, with their ground truth.
    fn pending_steps(
        &mut self,
        r: usize,
        sender: usize,
        remote: &FileRecord,
        d: &Plan,
    ) -> Res<Vec<Pending>> {
        let tr = self.truth.of(Some(remote))?;
        let local = self.replicas[r].journal.record(&remote.path).cloned();
        let mut out = Vec::new();
        for planned in &d.steps {
            let step = &planned.step;
            let j = &self.replicas[r].journal;
            let record = planned.record().clone();
            let old = j.record(&record.path).cloned();
            let told = self.truth.of(old.as_ref())?;
            let on_path = record.path == remote.path;
            let expected = old
                .as_ref()
                .map(|o| o.version.clone())
                .unwrap_or_default()
                .merge(&remote.version);
            let mut transfers = BTreeSet::new();
            let mut source = None;
            let mut event_kind = None;
            let mut truth = match step {
                Step::PreserveLocal { from, .. } => {
                    let src = j.record(from).cloned();
                    transfers = self.truth.of(src.as_ref())?.content;
                    event_kind = Some(EventKind::Sibling);
                    RecTruth {
                        hist: told.hist.clone(),
                        content: BTreeSet::new(),
                    }
                }
                Step::PreserveRemote { .. } => {
                    transfers = tr.content.clone();
                    event_kind = Some(EventKind::Sibling);
                    RecTruth {
                        hist: told.hist.clone(),
                        content: BTreeSet::new(),
                    }
                }
                Step::ApplyRemote { .. } if on_path && planned.from_peer => {
                    source = Some(self.replicas[sender].dev);
                    tr.clone()
                }
                Step::ApplyRemote { record } | Step::UpdateLocal { record } if on_path => {
                    let same_old = old.as_ref().is_some_and(|o| o.same_content(record));
                    let content = match (record.same_content(remote), same_old) {
                        (true, true) => told.content.union(&tr.content).copied().collect(),
                        (true, false) => tr.content.clone(),
                        _ => told.content.clone(),
                    };
                    if record.version != expected {
                        event_kind = Some(EventKind::Internal);
                    }
                    RecTruth {
                        hist: told.hist.union(&tr.hist).copied().collect(),
                        content,
                    }
                }
                Step::ReviveDir { .. } => {
                    event_kind = Some(EventKind::Internal);
                    let hist = if on_path {
                        told.hist.union(&tr.hist).copied().collect()
                    } else {
                        told.hist.clone()
                    };
                    RecTruth {
                        hist,
                        content: BTreeSet::new(),
                    }
                }
                _ => return Err(format!("unexpected step off the decision's path: {step:?}")),
            };
            let event = event_kind.map(|kind| self.event_of(r, &record, kind, &mut truth));
            out.push(Pending {
                record,
                source,
                truth,
                transfers,
                event,
            });
        }
        self.taken_over(r, remote, local.as_ref(), d, &mut out)?;
        Ok(out)
    }

    /// The derived event a step makes (a sibling, a resolution), recorded in its truth.
    fn event_of(
        &mut self,
        r: usize,
        record: &FileRecord,
        kind: EventKind,
        truth: &mut RecTruth,
    ) -> (u32, EventInfo) {
        let id = self.truth.derived(&record.path, &record.version);
        truth.hist.insert(id);
        let content = (kind == EventKind::Sibling).then_some((record.kind, record.hash));
        if content.is_some() {
            truth.content.insert(id);
        }
        let info = EventInfo {
            path: record.path.clone(),
            kind,
            content,
            replica: r,
        };
        (id, info)
    }

    /// A conflict loser already preserved under its sibling name (same content) is taken over
    /// by it: its content's obligations move to the last step.
    fn taken_over(
        &mut self,
        r: usize,
        remote: &FileRecord,
        local: Option<&FileRecord>,
        d: &Plan,
        out: &mut [Pending],
    ) -> Res<()> {
        let Outcome::Conflict { winner_is_local } = d.outcome else {
            return Ok(());
        };
        let loser = if winner_is_local { Some(remote) } else { local };
        let j = &self.replicas[r].journal;
        let sibling_holds_it = loser.is_some_and(|l| {
            j.current.values().any(|e| {
                !e.record.deleted
                    && e.record.same_content(l)
                    && e.record.path.parent() == l.path.parent()
                    && e.record.path.file_name().contains(".sync-conflict-")
            })
        });
        if d.conflict.is_none() && sibling_holds_it {
            let moved = self.truth.of(loser)?.content;
            if let Some(last) = out.last_mut() {
                last.transfers.extend(moved);
            }
        }
        Ok(())
    }

    /// Stores one record in the journal with its truth, checking (d) and that no history is
    /// forgotten.
    fn commit_one(&mut self, r: usize, p: Pending) -> Res<()> {
        let old = self.replicas[r].journal.record(&p.record.path).cloned();
        let told = self.truth.of(old.as_ref())?;
        if !told.hist.is_subset(&p.truth.hist) {
            return Err(format!(
                "r{r}: {} {} replaced {} without having seen all of it ({:?} ⊄ {:?})",
                p.record.path,
                p.record.version,
                old.map(|o| o.version).unwrap_or_default(),
                told.hist,
                p.truth.hist
            ));
        }
        self.truth.register(&p.record, &p.truth)?;
        if let Some((id, info)) = p.event {
            self.truth.materialize(id, info, &p.truth.hist);
        }
        self.truth.transfer(&p.transfers);
        self.replicas[r].journal.commit(p.record, p.source)?;
        Ok(())
    }

    /// One planned step's disk work, as the store does it: content verified by hash before
    /// the atomic rename, never replacing something the plan did not expect.
    fn write(&mut self, r: usize, planned: &Planned, blobs: &HashMap<Hash, Vec<u8>>) -> Res<()> {
        let rec = planned.record();
        // A step that writes nothing only journals (a vector, a resolution the local content
        // wins): over a change the watcher has not reported yet, the file differs from the
        // record, and that change is captured as a version of its own when it is reported.
        let uncaptured_here = self.replicas[r].uncaptured.iter().any(|u| u == &rec.path);
        if planned.disk == Disk::Nothing && uncaptured_here {
            return Ok(());
        }
        // (g) What the user changed and the watcher has not reported yet is theirs: an apply
        // that wrote over it (or over what is below or above it) would lose that write.
        let from = match &planned.disk {
            Disk::CopyLocal { from } => Some(from),
            _ => None,
        };
        if planned.disk == Disk::Nothing {
            // Nothing written.
        } else if let Some(u) = self.replicas[r]
            .uncaptured
            .iter()
            .find(|u| apply::overlaps(u, &rec.path) || from.is_some_and(|f| apply::overlaps(u, f)))
        {
            return Err(format!(
                "(g) r{r}: an apply of {} would replace {u}, written by the user and not captured yet",
                rec.path
            ));
        }
        let fs = &mut self.replicas[r].fs;
        match &planned.disk {
            Disk::CopyLocal { from } => return copy_local(r, fs, from, rec),
            Disk::Nothing if rec.deleted => {
                if fs.nodes.contains_key(&rec.path) {
                    return Err(format!(
                        "r{r}: {} stays on disk under a tombstone",
                        rec.path
                    ));
                }
                return Ok(());
            }
            Disk::Nothing => {
                return match fs.nodes.get(&rec.path) {
                    Some(node) if node.matches(rec) => Ok(()),
                    other => Err(format!(
                        "r{r}: nothing to do on disk for {}, but it is {other:?}",
                        rec.path
                    )),
                };
            }
            Disk::SetMeta { mtime, .. } => {
                let Some(node) = fs.nodes.get_mut(&rec.path) else {
                    return Err(format!("r{r}: metadata of missing {}", rec.path));
                };
                if !node.same_content(rec) {
                    return Err(format!(
                        "r{r}: metadata of {} over different content",
                        rec.path
                    ));
                }
                node.mode = rec.mode;
                if *mtime {
                    node.mtime_ns = rec.mtime_ns;
                }
                return Ok(());
            }
            Disk::RemoveDir | Disk::RemoveFile => {
                if fs.has_children(&rec.path) {
                    return Err(format!(
                        "r{r}: deleting {} would delete what is below it",
                        rec.path
                    ));
                }
                fs.nodes.remove(&rec.path);
                return Ok(());
            }
            Disk::MakeDir { .. } | Disk::MakeSymlink | Disk::Content => {}
        }
        if matches!(planned.step, Step::PreserveRemote { .. }) && fs.nodes.contains_key(&rec.path) {
            return Err(format!("r{r}: conflict sibling {} is taken", rec.path));
        }
        if !fs.parent_is_dir(&rec.path) {
            return Err(format!(
                "r{r}: {} written without its parent directory",
                rec.path
            ));
        }
        let bytes = match planned.disk {
            Disk::Content => {
                let b = blobs.get(&rec.hash).cloned().unwrap_or_default();
                if Hash::of(&b) != rec.hash {
                    return Err(format!(
                        "(e) r{r}: {} would be written with wrong content",
                        rec.path
                    ));
                }
                Some(b)
            }
            _ => None,
        };
        if rec.kind != FileKind::Dir && fs.has_children(&rec.path) {
            return Err(format!(
                "r{r}: {} replaced a directory that has entries",
                rec.path
            ));
        }
        fs.nodes
            .insert(rec.path.clone(), Node::from_record(rec, bytes));
        Ok(())
    }

    /// The files are exactly what the journal says (no partial content, nothing uncaptured).
    fn check_consistency(&self, r: usize) -> Res<()> {
        let rep = &self.replicas[r];
        let uncaptured = |p: &RelPath| rep.uncaptured.iter().any(|u| u == p);
        for (p, e) in &rep.journal.current {
            if !rep.fs.matches(&e.record) && !uncaptured(p) {
                return Err(format!(
                    "(e) r{r}: {p} is {:?} on disk but the journal says {:?}",
                    rep.fs.nodes.get(p),
                    e.record
                ));
            }
        }
        for p in rep.fs.nodes.keys() {
            if rep.journal.record(p).is_none_or(|rec| rec.deleted) && !uncaptured(p) {
                return Err(format!(
                    "(e) r{r}: {p} exists on disk but not in the journal"
                ));
            }
        }
        Ok(())
    }

    // ---- the end ----

    fn final_checks(&mut self) -> Res<()> {
        self.check_quiet()?;
        self.check_identical()?;
        self.check_no_content_lost()?;
        self.count();
        Ok(())
    }

    /// Quiet means every link connected and in sync both ways, and nothing waiting to apply.
    fn check_quiet(&self) -> Res<()> {
        for &(a, b) in self.links.keys() {
            let Some(c) = self
                .conns
                .values()
                .find(|c| c.ends.contains(&a) && c.ends.contains(&b))
            else {
                return Err(format!("quiet, but r{a}-r{b} is not connected"));
            };
            for side in 0..2 {
                let st = c.sessions[side].folder_status(&self.folder);
                if !st.as_ref().is_some_and(|s| s.in_sync) {
                    return Err(format!(
                        "quiet, but r{} is not in sync with r{}: {st:?}",
                        c.ends[side],
                        c.ends[1 - side]
                    ));
                }
            }
        }
        for r in 0..self.replicas.len() {
            let rep = &self.replicas[r];
            if !rep.pipe.is_idle() || !rep.work.is_empty() || !rep.journal.pending.is_empty() {
                return Err(format!("quiet, but r{r} has records waiting to be applied"));
            }
            if !rep.uncaptured.is_empty() {
                return Err(format!("quiet, but r{r} has local changes not captured"));
            }
            self.check_consistency(r)?;
        }
        Ok(())
    }

    /// (a) identical records and files.
    fn check_identical(&self) -> Res<()> {
        let strip = |j: &Journal| -> Vec<FileRecord> {
            j.current
                .values()
                .map(|e| FileRecord {
                    sequence: 0,
                    ..e.record.clone()
                })
                .collect()
        };
        let first = strip(&self.replicas[0].journal);
        for r in 1..self.replicas.len() {
            let other = strip(&self.replicas[r].journal);
            if other != first {
                let diff = first
                    .iter()
                    .map(Some)
                    .chain(std::iter::repeat(None))
                    .zip(other.iter().map(Some).chain(std::iter::repeat(None)))
                    .take(first.len().max(other.len()))
                    .find(|(x, y)| x != y);
                return Err(format!("(a) r0 and r{r} differ: {diff:?}"));
            }
            // Directory and symlink mtimes are not replicated (docs/design.md, "Data model"; `same_state`).
            let norm = |n: Option<&Node>| {
                n.map(|n| match n.content {
                    Content::File(_) => n.clone(),
                    _ => Node {
                        mtime_ns: 0,
                        ..n.clone()
                    },
                })
            };
            let (f0, fr) = (&self.replicas[0].fs.nodes, &self.replicas[r].fs.nodes);
            if let Some(p) = f0
                .keys()
                .chain(fr.keys())
                .find(|p| norm(f0.get(*p)) != norm(fr.get(*p)))
            {
                return Err(format!(
                    "(a) files of r0 and r{r} differ at {p}: {:?} vs {:?}",
                    f0.get(p),
                    fr.get(p)
                ));
            }
        }
        Ok(())
    }

    /// (b) every content not causally overwritten survives.
    fn check_no_content_lost(&self) -> Res<()> {
        for (id, e) in self.truth.obligations() {
            let Some((kind, hash)) = e.content else {
                continue;
            };
            for (r, rep) in self.replicas.iter().enumerate() {
                let here = |rec: &FileRecord| !rec.deleted && rec.kind == kind && rec.hash == hash;
                let at_path = rep.journal.record(&e.path).is_some_and(here);
                let as_sibling = || {
                    rep.journal.current.values().any(|en| {
                        here(&en.record)
                            && en.record.path.parent() == e.path.parent()
                            && en.record.path.file_name().contains(".sync-conflict-")
                    })
                };
                if !at_path && !as_sibling() {
                    return Err(format!(
                        "(b) r{r} lost content {} of {} written by r{} (event {id}, {:?})",
                        hash.short(),
                        e.path,
                        e.replica,
                        e.kind
                    ));
                }
            }
        }
        Ok(())
    }

    /// The final report's counts, once every invariant holds.
    fn count(&mut self) {
        let j = &self.replicas[0].journal;
        self.report.paths = j.current.len();
        self.report.conflict_files = j
            .current
            .values()
            .filter(|e| !e.record.deleted && e.record.path.file_name().contains(".sync-conflict-"))
            .count();
        for (versions, edits) in self.truth.versions_per_path().into_values() {
            self.report.max_versions_per_path = self.report.max_versions_per_path.max(versions);
            self.report.max_extra_versions_per_path = self
                .report
                .max_extra_versions_per_path
                .max(versions.saturating_sub(edits));
        }
        let made = self.truth.events_made();
        self.log(|| format!("quiet: {made} versions made, all invariants hold"));
    }
}

/// A local loser's content copied to its conflict sibling `rec`, as the store's hard link
/// does: the content must be the one the plan keeps, the sibling's name free.
fn copy_local(r: usize, fs: &mut Fs, from: &RelPath, rec: &FileRecord) -> Res<()> {
    let Some(node) = fs.nodes.get(from).cloned() else {
        return Err(format!("r{r}: preserve of missing {from}"));
    };
    if !node.same_content(rec) {
        return Err(format!(
            "(e) r{r}: {from} does not hold the content to preserve"
        ));
    }
    if fs.nodes.contains_key(&rec.path) || !fs.parent_is_dir(&rec.path) {
        return Err(format!(
            "r{r}: conflict sibling {} is taken or has no directory",
            rec.path
        ));
    }
    fs.nodes.insert(
        rec.path.clone(),
        Node {
            mode: rec.mode,
            mtime_ns: rec.mtime_ns,
            ..node
        },
    );
    Ok(())
}

fn outcome_name(o: &Outcome) -> String {
    let s = format!("{o:?}");
    s.split([' ', '{', '(']).next().unwrap_or("").to_string()
}
