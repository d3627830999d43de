//! Disk room promised to what is being received: a running reservation per filesystem.
//!
//! A peer declares a version's size in a few bytes of record (one chunk listed a million
//! times), so the room a version needs is claimed when it is decided, before anything is
//! written, and held until it is installed or dropped. The check is against every claim in
//! flight on the same filesystem, not against the free space alone: batch N+1 is decided while
//! batch N is still being fetched, and two versions each declaring 60 % of the free space
//! must not both pass. A claim shrinks as its bytes are written (they are then in the free
//! space statistic already) and lets go of the rest when it is dropped: installed, discarded,
//! superseded, failed. [`reserve_of`] of every filesystem is never promised: the journal lives
//! on the same disk, and a journal that cannot commit stops every folder.
//!
//! What it never does: write or delete anything, or decide what is received (a claim refused
//! is the caller's to report).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a reading of a filesystem's free space stands in for a new one (less what was
/// written since): an apply claims room for every file it receives, and a `statvfs` per file
/// was 3 % of a receiving daemon's CPU in a sync of 10,000 small files. A claim the reading
/// would refuse is checked against a new reading first, so only another program's writes
/// within this time go unseen, which the reserve covers.
pub const READING_FRESH: Duration = Duration::from_millis(100);

/// Room kept free on every filesystem: 2 % of it, at least 4 MiB and at most 256 MiB.
pub fn reserve_of(total: u64) -> u64 {
    (total / 50).clamp(4 << 20, 256 << 20)
}

/// A filesystem claims are made on: its device number, and a path on it to ask for its free
/// space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Place {
    dev: u64,
    probe: PathBuf,
}

impl Place {
    /// The filesystem holding `path`.
    pub fn of(path: &Path) -> std::io::Result<Place> {
        use std::os::unix::fs::MetadataExt;
        Ok(Place {
            dev: std::fs::metadata(path)?.dev(),
            probe: path.to_path_buf(),
        })
    }

    /// The filesystem of device `dev` (known from a descriptor's stat), asked for its free
    /// space at `probe`.
    pub fn on(dev: u64, probe: &Path) -> Place {
        Place {
            dev,
            probe: probe.to_path_buf(),
        }
    }

    /// Its device number.
    pub fn dev(&self) -> u64 {
        self.dev
    }
}

/// Why a claim was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{wanted} bytes do not fit: {free} free, {claimed} promised to versions being received, {reserve} kept in reserve")]
pub struct NoRoom {
    /// What was asked for on the filesystem that has no room.
    pub wanted: u64,
    /// Free bytes there for unprivileged writers.
    pub free: u64,
    /// Bytes already promised there and not written yet.
    pub claimed: u64,
    /// Bytes never promised there.
    pub reserve: u64,
}

/// (free bytes for unprivileged writers, total bytes) of the filesystem holding a path, if
/// they can be read.
pub type Space = fn(&Path) -> Option<(u64, u64)>;

/// The claims of one daemon, by filesystem. See the module's documentation.
#[derive(Debug)]
pub struct Room {
    ledger: Mutex<Ledger>,
    /// How free and total bytes are read (`statvfs`; a table in tests).
    space: Space,
    /// How long a reading stands ([`READING_FRESH`]).
    fresh: Duration,
}

#[derive(Debug, Default)]
struct Ledger {
    /// Bytes promised and not yet written (nor let go of), by device.
    claimed: HashMap<u64, u64>,
    /// The last reading of each device's space ([`READING_FRESH`]).
    readings: HashMap<u64, Reading>,
}

#[derive(Debug, Clone, Copy)]
struct Reading {
    free: u64,
    total: u64,
    at: Instant,
    /// Claimed bytes written since: no longer free, no longer claimed.
    written: u64,
}

impl Room {
    /// No claims yet; `space` reads a filesystem's free and total bytes.
    pub fn new(space: Space) -> Arc<Room> {
        Room::with_fresh(space, READING_FRESH)
    }

    fn with_fresh(space: Space, fresh: Duration) -> Arc<Room> {
        Arc::new(Room {
            ledger: Mutex::default(),
            space,
            fresh,
        })
    }

    /// Claims `wants` (bytes on each place), all or none: each filesystem must keep its
    /// [`reserve_of`] free beyond what is claimed there already and what is asked now. A
    /// filesystem whose free space cannot be read is given the benefit of the doubt.
    pub fn claim(self: &Arc<Self>, wants: &[(&Place, u64)]) -> Result<Vec<Claim>, NoRoom> {
        let mut ledger = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
        let mut asked: HashMap<u64, (u64, &Path)> = HashMap::new();
        for (place, bytes) in wants {
            let e = asked.entry(place.dev).or_insert((0, &place.probe));
            e.0 = e.0.saturating_add(*bytes);
        }
        let now = Instant::now();
        for (dev, (wanted, probe)) in &asked {
            let already = ledger.claimed.get(dev).copied().unwrap_or(0);
            let fits = |(free, total): (u64, u64)| {
                let reserve = reserve_of(total);
                match free.saturating_sub(reserve).saturating_sub(already) < *wanted {
                    true => Err(NoRoom {
                        wanted: *wanted,
                        free,
                        claimed: already,
                        reserve,
                    }),
                    false => Ok(()),
                }
            };
            let recent = ledger
                .readings
                .get(dev)
                .filter(|r| now.saturating_duration_since(r.at) < self.fresh)
                .map(|r| (r.free.saturating_sub(r.written), r.total));
            if recent.is_some_and(|space| fits(space).is_ok()) {
                continue;
            }
            let Some((free, total)) = self.space_of(probe) else {
                continue;
            };
            let reading = Reading {
                free,
                total,
                at: now,
                written: 0,
            };
            ledger.readings.insert(*dev, reading);
            fits((free, total))?;
        }
        let mut out = Vec::with_capacity(wants.len());
        for (place, bytes) in wants {
            let c = ledger.claimed.entry(place.dev).or_insert(0);
            *c = c.saturating_add(*bytes);
            out.push(Claim {
                room: self.clone(),
                dev: place.dev,
                left: AtomicU64::new(*bytes),
            });
        }
        Ok(out)
    }

    /// Bytes promised on `place`'s filesystem and not written yet.
    pub fn claimed(&self, place: &Place) -> u64 {
        let ledger = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
        ledger.claimed.get(&place.dev).copied().unwrap_or(0)
    }

    fn space_of(&self, probe: &Path) -> Option<(u64, u64)> {
        (self.space)(probe)
    }

    /// `bytes` promised on `dev` are no longer: `written` (then they are no longer free
    /// either), or let go of.
    fn release(&self, dev: u64, bytes: u64, written: bool) {
        if bytes == 0 {
            return;
        }
        let mut ledger = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = ledger.claimed.get_mut(&dev) {
            *c = c.saturating_sub(bytes);
            if *c == 0 {
                ledger.claimed.remove(&dev);
            }
        }
        if let Some(r) = ledger.readings.get_mut(&dev).filter(|_| written) {
            r.written = r.written.saturating_add(bytes);
        }
    }
}

/// Bytes promised on one filesystem. Writing them lets go of them ([`Claim::written`]: they
/// are counted by the filesystem's free space from then on); dropping the claim lets go of
/// the rest.
#[derive(Debug)]
pub struct Claim {
    room: Arc<Room>,
    dev: u64,
    left: AtomicU64,
}

impl Claim {
    /// `n` of its bytes were written.
    pub fn written(&self, n: u64) {
        let mut taken = 0;
        let _ = self
            .left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| {
                taken = left.min(n);
                Some(left - taken)
            });
        self.room.release(self.dev, taken, true);
    }

    /// Bytes still promised.
    pub fn left(&self) -> u64 {
        self.left.load(Ordering::Relaxed)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let left = self.left.swap(0, Ordering::Relaxed);
        self.room.release(self.dev, left, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A filesystem of 1,000 MiB with 500 MiB free (reserve: 20 MiB).
    fn disk(_: &Path) -> Option<(u64, u64)> {
        Some((500 * MIB, 1000 * MIB))
    }

    fn room() -> (Arc<Room>, Place) {
        let room = Room::new(disk);
        let place = Place {
            dev: 7,
            probe: PathBuf::from("/x"),
        };
        (room, place)
    }

    #[test]
    fn two_versions_that_do_not_fit_together_cannot_both_be_claimed() {
        let (room, place) = room();
        let first = room.claim(&[(&place, 300 * MIB)]).unwrap();
        let refused = room.claim(&[(&place, 300 * MIB)]).unwrap_err();
        assert_eq!(
            refused,
            NoRoom {
                wanted: 300 * MIB,
                free: 500 * MIB,
                claimed: 300 * MIB,
                reserve: 20 * MIB
            }
        );
        // The first is installed (or dropped): the room is free again.
        drop(first);
        assert_eq!(room.claimed(&place), 0);
        assert!(room.claim(&[(&place, 300 * MIB)]).is_ok());
    }

    #[test]
    fn the_reserve_is_never_promised_and_written_bytes_let_go_of_their_claim() {
        let (room, place) = room();
        assert!(room.claim(&[(&place, 481 * MIB)]).is_err());
        let c = room.claim(&[(&place, 480 * MIB)]).unwrap();
        c[0].written(100 * MIB);
        assert_eq!(room.claimed(&place), 380 * MIB);
        c[0].written(1000 * MIB);
        assert_eq!((c[0].left(), room.claimed(&place)), (0, 0));
        drop(c);
        assert_eq!(room.claimed(&place), 0);
    }

    #[test]
    fn a_claim_on_two_filesystems_is_all_or_none() {
        let (room, place) = room();
        let other = Place {
            dev: 8,
            probe: PathBuf::from("/y"),
        };
        assert!(room
            .claim(&[(&place, 10 * MIB), (&other, 490 * MIB)])
            .is_err());
        assert_eq!((room.claimed(&place), room.claimed(&other)), (0, 0));
        let both = room
            .claim(&[(&place, 10 * MIB), (&other, 10 * MIB)])
            .unwrap();
        assert_eq!(both.len(), 2);
        // Two parts on one filesystem are checked together.
        assert!(room
            .claim(&[(&place, 300 * MIB), (&place, 200 * MIB)])
            .is_err());
    }

    #[test]
    fn a_recent_reading_stands_less_what_was_written_and_a_refusal_reads_again() {
        use std::sync::atomic::AtomicUsize;
        static FREE: AtomicU64 = AtomicU64::new(500 * MIB);
        static READS: AtomicUsize = AtomicUsize::new(0);
        fn disk(_: &Path) -> Option<(u64, u64)> {
            READS.fetch_add(1, Ordering::Relaxed);
            Some((FREE.load(Ordering::Relaxed), 1000 * MIB))
        }
        // Readings that stand for an hour: nothing here depends on how fast the test runs.
        let room = Room::with_fresh(disk, Duration::from_secs(3600));
        let place = Place {
            dev: 7,
            probe: PathBuf::from("/x"),
        };
        let small: Vec<_> = (0..100)
            .map(|_| room.claim(&[(&place, MIB)]).unwrap())
            .collect();
        assert_eq!(READS.load(Ordering::Relaxed), 1, "one reading for a batch");
        // Written bytes are no longer free: 100 MiB written leaves 400 - 20 for claims.
        for c in &small {
            c[0].written(MIB);
        }
        FREE.store(400 * MIB, Ordering::Relaxed);
        let most = room.claim(&[(&place, 380 * MIB)]).unwrap();
        assert_eq!(READS.load(Ordering::Relaxed), 1);
        // What the reading would refuse is read again: something was deleted meanwhile.
        FREE.store(450 * MIB, Ordering::Relaxed);
        let more = room.claim(&[(&place, 40 * MIB)]).unwrap();
        assert_eq!(READS.load(Ordering::Relaxed), 2);
        let refused = room.claim(&[(&place, 40 * MIB)]).unwrap_err();
        assert_eq!((refused.free, refused.claimed), (450 * MIB, 420 * MIB));
        assert_eq!(READS.load(Ordering::Relaxed), 3);
        drop((most, more));
        // A reading that no longer stands: even a claim it would allow reads again (another
        // program filled the disk).
        let room = Room::with_fresh(disk, Duration::ZERO);
        FREE.store(500 * MIB, Ordering::Relaxed);
        assert!(room.claim(&[(&place, MIB)]).is_ok());
        FREE.store(10 * MIB, Ordering::Relaxed);
        assert!(room.claim(&[(&place, MIB)]).is_err());
        assert_eq!(READS.load(Ordering::Relaxed), 5);
    }

    #[test]
    fn the_reserve_grows_with_the_disk_within_bounds() {
        assert_eq!(reserve_of(40 * MIB), 4 * MIB);
        assert_eq!(reserve_of(1000 * MIB), 20 * MIB);
        assert_eq!(reserve_of(1 << 40), 256 * MIB);
    }
}
