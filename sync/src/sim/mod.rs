//! Deterministic simulation of many replicas in one thread (DESIGN §11, STYLE: madsim/turmoil).
//!
//! N replicas, each with an in-memory filesystem and journal, run the REAL [`Session`] per
//! connected peer and the REAL [`decide`] for every received record; a driver modelled on the
//! engine executes the steps. One seeded RNG drives everything: random user operations,
//! message delays (FIFO within a connection's control stream, reordered between
//! connections), partitions and heals, crashes (also in the middle of an apply) and restarts,
//! chunk fetches that fail or arrive truncated. Virtual time is in milliseconds.
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
//!   state), so a resolution is never itself a new concurrent change.
//!
//! **Architecture invariant:** pure, like the modules it drives: no IO, no clock, no
//! threads. Trace lines are collected and returned, not printed.

mod ops;
mod replica;
mod truth;

use crate::plan::{plan, unavailable, Disk, Plan, Planned, Unavailable};
use crate::reconcile::{new_local_version, Context, Outcome, Step};
use crate::session::{Action, Session, SessionFolder, RECEIVE_DEPTH};
use meshfs_protocol::{DeviceId, FileKind, FileRecord, FolderId, Hash, Message, RelPath, ShortId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use replica::{captured_record, Content, Fs, Journal, Node, Pending};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, VecDeque};
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
    /// Records of a Receive applied while the Receive before it waited for content.
    pub ran_ahead: u64,
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
    ApplyReceive {
        replica: usize,
        conn: u64,
    },
}

struct PendingReceive {
    folder: FolderId,
    records: VecDeque<FileRecord>,
    up_to: u64,
}

struct Replica {
    dev: DeviceId,
    short: ShortId,
    name: String,
    fs: Fs,
    journal: Journal,
    alive: bool,
    skew_ms: i64,
    /// Records received on a connection, waiting to be applied: up to [`RECEIVE_DEPTH`]
    /// Receives per connection, oldest first.
    receives: BTreeMap<u64, VecDeque<PendingReceive>>,
}

/// A connection: one control stream, one session at each end.
struct Conn {
    ends: [usize; 2],
    sessions: [Session; 2],
    /// Delivery time of the last message towards each end (FIFO per direction).
    last_at: [u64; 2],
}

enum Fetch {
    Ready(HashMap<Hash, Vec<u8>>),
    Retry,
    Superseded,
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
                    receives: BTreeMap::new(),
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
                self.disconnect(a, b);
                Ok(())
            }
            Event::LinkUp(a, b) => {
                self.links.insert(key(a, b), true);
                self.log(|| format!("link r{a}-r{b} up"));
                let t = self.now + self.rng.gen_range(1..=30);
                self.schedule(t, Event::Connect(a, b));
                Ok(())
            }
            Event::Crash(r) => {
                self.crash(r);
                Ok(())
            }
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
            Event::ApplyReceive { replica, conn } => self.apply_receive(replica, conn),
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
        };
        Session::new(me.name.clone(), peer_dev, vec![f])
    }

    fn drop_conn(&mut self, id: u64) {
        if let Some(c) = self.conns.remove(&id) {
            for r in c.ends {
                self.replicas[r].receives.remove(&id);
            }
        }
    }

    fn disconnect(&mut self, a: usize, b: usize) {
        let ids: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.ends.contains(&a) && c.ends.contains(&b))
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            self.drop_conn(id);
        }
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
                    let pr = PendingReceive {
                        folder,
                        records: records.into(),
                        up_to,
                    };
                    let queue = self.replicas[r].receives.entry(id).or_default();
                    queue.push_back(pr);
                    if queue.len() > RECEIVE_DEPTH {
                        return Err(format!(
                            "r{r}: more than {RECEIVE_DEPTH} Receives outstanding"
                        ));
                    }
                    self.log(|| format!("r{r} receives {n} records from r{peer} up to {up_to}"));
                    let at = self.now + self.rng.gen_range(0..=5);
                    self.schedule(
                        at,
                        Event::ApplyReceive {
                            replica: r,
                            conn: id,
                        },
                    );
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

    fn crash(&mut self, r: usize) {
        if !self.replicas[r].alive {
            return;
        }
        self.replicas[r].alive = false;
        self.report.crashes += 1;
        self.log(|| format!("r{r} CRASHES"));
        for (id, _) in self.conns_of(r) {
            self.drop_conn(id);
        }
        self.replicas[r].receives.clear();
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
        let ctx = self.ctx(r);
        for path in changed {
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

    /// Applies the outstanding Receives of connection `id`, oldest first. A Receive whose
    /// content is not available yet stays outstanding (partially acknowledged) and is retried;
    /// the one behind it runs ahead meanwhile, as the engine's pipeline lets it, unless one of
    /// its paths is, contains or lies inside a path still waiting in the first (`apply::Turn`).
    /// Receives are acknowledged in order.
    fn apply_receive(&mut self, r: usize, id: u64) -> Res<()> {
        if !self.replicas[r].alive || !self.conns.contains_key(&id) {
            return Ok(());
        }
        let Some(mut queue) = self.replicas[r].receives.remove(&id) else {
            return Ok(());
        };
        let side = match self.conns.get(&id) {
            Some(c) if c.ends[0] == r => 0,
            Some(_) => 1,
            None => return Ok(()),
        };
        let sender = self.conns.get(&id).map(|c| c.ends[1 - side]).unwrap_or(r);
        let mut grew = false;
        let mut first_progress = None;
        let mut waiting: Vec<meshfs_protocol::RelPath> = Vec::new();
        for (i, pr) in queue.iter_mut().enumerate() {
            let overlaps = pr.records.iter().any(|rec| {
                waiting
                    .iter()
                    .any(|w| w.is_within(&rec.path) || rec.path.is_within(w))
            });
            if overlaps {
                break;
            }
            let before = pr.records.len();
            let Some((g, progress)) = self.apply_records(r, sender, pr)? else {
                return Ok(()); // crashed mid-apply
            };
            grew |= g;
            if i == 0 {
                first_progress = progress;
            } else {
                self.report.ran_ahead += (before - pr.records.len()) as u64;
            }
            waiting.extend(pr.records.iter().map(|rec| rec.path.clone()));
        }
        let mut acts = Vec::new();
        while queue.front().is_some_and(|pr| pr.records.is_empty()) {
            let Some(pr) = queue.pop_front() else { break };
            let Some(c) = self.conns.get_mut(&id) else {
                return Ok(());
            };
            acts.extend(c.sessions[side].applied(&pr.folder, pr.up_to));
        }
        if let Some(blocked) = queue.front() {
            let (folder, partial) = (blocked.folder.clone(), blocked.records[0].sequence - 1);
            if let (Some(_), Some(c)) = (first_progress, self.conns.get_mut(&id)) {
                acts.extend(c.sessions[side].applied(&folder, partial));
            }
            let at = self.now + self.rng.gen_range(20..=100);
            self.schedule(
                at,
                Event::ApplyReceive {
                    replica: r,
                    conn: id,
                },
            );
        }
        if !queue.is_empty() {
            self.replicas[r].receives.insert(id, queue);
        }
        self.process(id, side, acts)?;
        self.check_consistency(r)?;
        if grew {
            self.notify(r)?;
        }
        Ok(())
    }

    /// Decides and executes `pr`'s records in order until one's content is unavailable.
    /// Returns whether anything changed and the sequence of the last record done, or `None`
    /// if the replica crashed in the middle.
    fn apply_records(
        &mut self,
        r: usize,
        sender: usize,
        pr: &mut PendingReceive,
    ) -> Res<Option<(bool, Option<u64>)>> {
        let mut grew = false;
        let mut progress = None;
        while let Some(remote) = pr.records.front().cloned() {
            let decision = plan(&self.replicas[r].journal, &remote).map_err(|e| e.to_string())?;
            if let Some(local) = self.replicas[r].journal.record(&remote.path).cloned() {
                self.truth
                    .check_order(&local, &remote, local.version.compare(&remote.version))?;
                self.check_resolution(r, &local, &remote, &decision)?;
            }
            match self.fetch(r, sender, &decision)? {
                Fetch::Retry => break,
                Fetch::Superseded => {
                    self.report.superseded += 1;
                    self.log(|| {
                        format!(
                            "r{r} skips superseded {} {} from r{sender}",
                            remote.path, remote.version
                        )
                    });
                }
                Fetch::Ready(blobs) => {
                    if !decision.steps.is_empty() {
                        self.log(|| {
                            format!(
                                "r{r} {} {}: {:?}",
                                remote.path, remote.version, decision.outcome
                            )
                        });
                        *self
                            .report
                            .outcomes
                            .entry(outcome_name(&decision.outcome))
                            .or_default() += 1;
                    }
                    if self.execute(r, sender, &remote, &decision, &blobs)? {
                        return Ok(None);
                    }
                    grew |= !decision.steps.is_empty();
                }
            }
            pr.records.pop_front();
            progress = Some(remote.sequence);
        }
        Ok(Some((grew, progress)))
    }

    /// The remote contents a decision needs, from this replica's own files (the chunk index)
    /// or any connected peer; verified by hash, as the store does.
    fn fetch(&mut self, r: usize, sender: usize, d: &Plan) -> Res<Fetch> {
        let mut blobs = HashMap::new();
        for step in d.steps.iter().filter(|s| s.disk == Disk::Content) {
            let rec = step.record();
            if blobs.contains_key(&rec.hash) {
                continue;
            }
            if rec.size == 0 {
                blobs.insert(rec.hash, Vec::new());
                continue;
            }
            if let Some(b) = self.replicas[r].fs.find_content(&rec.hash) {
                blobs.insert(rec.hash, b.to_vec());
                continue;
            }
            let holders: Vec<usize> = self
                .conns_of(r)
                .into_iter()
                .filter_map(|(id, side)| self.conns.get(&id).map(|c| c.ends[1 - side]))
                .filter(|&p| {
                    self.replicas[p].alive && self.replicas[p].fs.find_content(&rec.hash).is_some()
                })
                .collect();
            if holders.is_empty() {
                // Nobody connected has it. If the sender itself no longer has it, the version
                // was superseded there and its successor follows in the sender's index.
                let at_sender = self.replicas[sender].fs.find_content(&rec.hash).is_some();
                return Ok(match unavailable(at_sender) {
                    Unavailable::Retry => Fetch::Retry,
                    Unavailable::Superseded => Fetch::Superseded,
                });
            }
            let from = holders[self.rng.gen_range(0..holders.len())];
            let mut data = self.replicas[from]
                .fs
                .find_content(&rec.hash)
                .map(<[u8]>::to_vec)
                .unwrap_or_default();
            if self.rng.gen_bool(self.fetch_fail_p) {
                data.truncate(data.len() / 2); // a transfer cut short
            }
            if Hash::of(&data) != rec.hash {
                self.report.fetch_retries += 1;
                return Ok(Fetch::Retry);
            }
            blobs.insert(rec.hash, data);
        }
        Ok(Fetch::Ready(blobs))
    }

    /// Carries out a decision: pending records, file writes (a crash may strike between
    /// any two), applied records.
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
        self.replicas[r].journal.pending = pending;
        let n = d.steps.len();
        let crash_at = if self.crash_apply_p > 0.0 && self.rng.gen_bool(self.crash_apply_p) {
            Some(self.rng.gen_range(0..=n))
        } else {
            None
        };
        for (k, step) in d.steps.iter().enumerate() {
            if crash_at == Some(k) {
                self.report.interrupted_applies += 1;
                self.log(|| format!("r{r} crash after {k} of {n} writes"));
                self.crash(r);
                return Ok(true);
            }
            self.write(r, step, blobs)?;
        }
        if crash_at == Some(n) {
            self.report.interrupted_applies += 1;
            self.log(|| format!("r{r} crash after all {n} writes, before marking them applied"));
            self.crash(r);
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
        let fs = &mut self.replicas[r].fs;
        let rec = planned.record();
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
        for (p, e) in &rep.journal.current {
            if !rep.fs.matches(&e.record) {
                return Err(format!(
                    "(e) r{r}: {p} is {:?} on disk but the journal says {:?}",
                    rep.fs.nodes.get(p),
                    e.record
                ));
            }
        }
        for p in rep.fs.nodes.keys() {
            if rep.journal.record(p).is_none_or(|rec| rec.deleted) {
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
            if !rep.receives.is_empty() || !rep.journal.pending.is_empty() {
                return Err(format!("quiet, but r{r} has records waiting to be applied"));
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
            // Directory and symlink mtimes are not replicated (DESIGN §3, `same_state`).
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
