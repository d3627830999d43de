//! The script of a randomized run: a list of steps drawn from a seeded RNG before anything runs.
//! It depends only on the seed, the number of devices and the number of steps — never on what
//! the daemons did — so a seed replays the same operations (their outcomes, such as whether a
//! file was still there to delete, depend on timing and are traced by the runner).
//!
//! The path space is small (eight files in three directories) so that edits collide.
//!
//! With an on-demand device (`od`), the script also reads files through its mount (which
//! fetches what is not local) and runs `meshfs evict` on it; its writes are never made while
//! its daemon is down (its mount is gone then, and its backing directory is not for writing,
//! D90). Without one, the script of a seed is the same as before this option existed.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// The files the script writes, deletes and renames.
pub const FILES: &[&str] = &[
    "f0.txt",
    "f1",
    "f2",
    "d0/f0.txt",
    "d0/f1",
    "d1/f0",
    "d1/f1.txt",
    "d1/d2/f0",
];

/// The directories above them (removed whole by [`Op::RemoveDir`]).
pub const DIRS: &[&str] = &["d0", "d1", "d1/d2"];

/// One operation of the script.
#[derive(Clone, Debug)]
pub enum Op {
    /// Writes new content to `path` on `dev` (creating its directories): in place
    /// (`open(O_TRUNC)`, write, close), or `atomic`ally (a temporary file renamed over it, as
    /// editors save). The device's daemon may be down: its start-up scan then finds the write.
    Write {
        dev: usize,
        path: &'static str,
        atomic: bool,
    },
    /// Deletes the file `path` on `dev` (nothing if it is not there).
    Delete { dev: usize, path: &'static str },
    /// Removes the directory `dir` and everything in it on `dev`.
    RemoveDir { dev: usize, dir: &'static str },
    /// Renames `from` to `to` on `dev` (replacing `to` if it exists).
    Rename {
        dev: usize,
        from: &'static str,
        to: &'static str,
    },
    /// The race of issue #41: `from` writes each path; the moment `from`'s content is readable
    /// on `to`, `to` overwrites it.
    Race {
        from: usize,
        to: usize,
        paths: Vec<&'static str>,
    },
    /// Opens `path` on `dev` for appending and writes a line, keeping it open (a program that
    /// holds a file open for writing while peers' versions of it arrive).
    Hold { dev: usize, path: &'static str },
    /// Writes another line to the file held by [`Op::Hold`] and closes it.
    Release { dev: usize, path: &'static str },
    /// Takes the link between two devices down.
    Cut { a: usize, b: usize },
    /// Brings it back up.
    Mend { a: usize, b: usize },
    /// Splits the devices into two groups (`true`/`false`): every link between them down.
    Split { side: Vec<bool> },
    /// Every link up.
    Heal,
    /// SIGKILLs a device's daemon (restarted a few steps later).
    Kill { dev: usize },
    /// Starts a killed device's daemon again.
    Restart { dev: usize },
    /// Reads `path` whole through the on-demand device's mount (fetching what is not local).
    Read { dev: usize, path: &'static str },
    /// `meshfs evict work PATH` on the on-demand device (`path`: a file, a directory or `.`).
    Evict { dev: usize, path: &'static str },
}

/// An operation and the pause after it.
#[derive(Clone, Debug)]
pub struct Step {
    pub op: Op,
    pub pause_ms: u64,
}

/// What the planner knows: only what its own steps did.
struct Model {
    n: usize,
    running: Vec<bool>,
    restart_at: Vec<Option<usize>>,
    up: Vec<Vec<bool>>,
    held: Vec<(usize, &'static str)>,
}

impl Model {
    fn running(&self) -> Vec<usize> {
        (0..self.n).filter(|&d| self.running[d]).collect()
    }

    fn stopped(&self) -> Vec<usize> {
        (0..self.n).filter(|&d| !self.running[d]).collect()
    }

    fn any_down(&self) -> bool {
        (0..self.n).any(|a| (a + 1..self.n).any(|b| !self.up[a][b]))
    }

    /// Whether `path` (or `dir` and everything below it) is free of files held open on `dev`.
    fn free(&self, dev: usize, path: &str) -> bool {
        !self
            .held
            .iter()
            .any(|&(d, p)| d == dev && (p == path || p.starts_with(&format!("{path}/"))))
    }

    /// The running devices `from` reaches over links that are up, through running devices.
    fn reachable(&self, from: usize) -> Vec<usize> {
        let mut seen = vec![false; self.n];
        let mut stack = vec![from];
        seen[from] = true;
        while let Some(a) = stack.pop() {
            let next: Vec<usize> = (0..self.n)
                .filter(|&b| !seen[b] && self.running[b] && self.up[a][b])
                .collect();
            for b in next {
                seen[b] = true;
                stack.push(b);
            }
        }
        (0..self.n).filter(|&d| d != from && seen[d]).collect()
    }

    fn set_link(&mut self, a: usize, b: usize, up: bool) {
        self.up[a][b] = up;
        self.up[b][a] = up;
    }
}

fn pause(rng: &mut StdRng) -> u64 {
    match rng.gen_range(0..100) {
        0..=69 => rng.gen_range(0..60),
        70..=94 => rng.gen_range(60..400),
        _ => rng.gen_range(400..2500),
    }
}

/// The script of `steps` steps for `n` devices from `seed`; `od`: the on-demand device.
pub fn plan(seed: u64, n: usize, steps: usize, od: Option<usize>) -> Vec<Step> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut m = Model {
        n,
        running: vec![true; n],
        restart_at: vec![None; n],
        up: vec![vec![true; n]; n],
        held: Vec::new(),
    };
    let max_down = (n / 2).max(1);
    let mut out = Vec::with_capacity(steps);
    while out.len() < steps {
        let i = out.len();
        if let Some(dev) = (0..n).find(|&d| m.restart_at[d].is_some_and(|at| at <= i)) {
            m.restart_at[dev] = None;
            m.running[dev] = true;
            out.push(Step {
                op: Op::Restart { dev },
                pause_ms: pause(&mut rng),
            });
            continue;
        }
        let running = m.running();
        let dev = *running.choose(&mut rng).expect("a device runs");
        let path = *FILES.choose(&mut rng).expect("files");
        let range = if od.is_some() { 0..111 } else { 0..95 };
        let op = match rng.gen_range(range) {
            // Most writes on a running device; some on a stopped one.
            0..=27 => {
                let dev = match m.stopped().choose(&mut rng) {
                    Some(&s) if rng.gen_bool(0.15) && Some(s) != od => s,
                    _ => dev,
                };
                let atomic = rng.gen_bool(0.3);
                m.free(dev, path).then_some(Op::Write { dev, path, atomic })
            }
            28..=34 => m.free(dev, path).then_some(Op::Delete { dev, path }),
            35..=36 => {
                let dir = *DIRS.choose(&mut rng).expect("dirs");
                m.free(dev, dir).then_some(Op::RemoveDir { dev, dir })
            }
            37..=43 => {
                let to = *FILES.choose(&mut rng).expect("files");
                (to != path && m.free(dev, path) && m.free(dev, to)).then_some(Op::Rename {
                    dev,
                    from: path,
                    to,
                })
            }
            44..=61 => {
                let to = m.reachable(dev).choose(&mut rng).copied();
                to.map(|to| {
                    let k = rng.gen_range(1..=3);
                    let mut paths: Vec<&'static str> = FILES
                        .choose_multiple(&mut rng, k)
                        .copied()
                        .filter(|p| m.free(dev, p) && m.free(to, p))
                        .collect();
                    paths.sort();
                    Op::Race {
                        from: dev,
                        to,
                        paths,
                    }
                })
                .filter(|op| matches!(op, Op::Race { paths, .. } if !paths.is_empty()))
            }
            62..=64 => (m.held.len() < 2 && m.free(dev, path)).then(|| {
                m.held.push((dev, path));
                Op::Hold { dev, path }
            }),
            65..=69 => (!m.held.is_empty()).then(|| {
                let k = rng.gen_range(0..m.held.len());
                let (dev, path) = m.held.remove(k);
                Op::Release { dev, path }
            }),
            70..=76 => {
                let a = rng.gen_range(0..n);
                let b = (a + rng.gen_range(1..n)) % n;
                m.up[a][b].then(|| {
                    m.set_link(a, b, false);
                    Op::Cut { a, b }
                })
            }
            77..=82 => {
                let a = rng.gen_range(0..n);
                let b = (a + rng.gen_range(1..n)) % n;
                (!m.up[a][b]).then(|| {
                    m.set_link(a, b, true);
                    Op::Mend { a, b }
                })
            }
            83..=85 => {
                let mut side: Vec<bool> = (0..n).map(|_| rng.gen_bool(0.5)).collect();
                if side.iter().all(|&s| s) || side.iter().all(|&s| !s) {
                    let k = rng.gen_range(0..n);
                    side[k] = !side[k];
                }
                for a in 0..n {
                    for b in a + 1..n {
                        if side[a] != side[b] {
                            m.set_link(a, b, false);
                        }
                    }
                }
                Some(Op::Split { side })
            }
            86..=88 => m.any_down().then(|| {
                for a in 0..n {
                    for b in 0..n {
                        m.up[a][b] = true;
                    }
                }
                Op::Heal
            }),
            // Reads through the on-demand device's mount, and evictions.
            95..=104 => od
                .filter(|&o| m.running[o])
                .map(|dev| Op::Read { dev, path }),
            105..=107 => od.filter(|&o| m.running[o]).map(|dev| {
                let path = match rng.gen_range(0..4) {
                    0 => ".",
                    1 => *DIRS.choose(&mut rng).expect("dirs"),
                    _ => path,
                };
                Op::Evict { dev, path }
            }),
            _ => (m.stopped().len() < max_down && running.len() > 1).then(|| {
                m.running[dev] = false;
                m.restart_at[dev] = Some(i + rng.gen_range(2..=8));
                Op::Kill { dev }
            }),
        };
        if let Some(op) = op {
            out.push(Step {
                op,
                pause_ms: pause(&mut rng),
            });
        }
    }
    out
}
