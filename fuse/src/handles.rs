//! Open handles and the per-inode open state.
//!
//! Owns the descriptors of open files (the only per-file descriptors the mount holds;
//! directories are not opened: the mount answers OPENDIR with `ENOSYS`, see `fs`), which inode each belongs to, how many of an inode's opens may write (the
//! engine's writer registry), and the kernel-passthrough backing id an inode's opens share.
//!
//! **Invariants:** while an inode has opens, they are all passthrough (sharing one backing
//! id, kept alive by every handle that uses it) or all forwarded: the kernel refuses to mix
//! the two on one inode, so the mode is chosen at the first open and kept until the last
//! release. `opens`/`writers` count exactly the handles in the map.

use crate::lock;
use fuser::BackingId;
use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Registers a descriptor with the kernel as a passthrough backing file (`None`: refused).
pub(crate) type MakeBacking<'a> = &'a mut dyn FnMut(BorrowedFd<'_>) -> Option<BackingId>;

/// An open regular file (or fifo, socket…).
#[derive(Debug)]
pub(crate) struct Handle {
    /// The node it was opened through.
    pub ino: u64,
    /// The backing inode its descriptor holds (the node's, but for an open that made a
    /// placeholder's content local: the new file's, D92).
    pub backing_ino: u64,
    /// The backing descriptor.
    pub fd: OwnedFd,
    /// Opened for writing (O_WRONLY or O_RDWR).
    pub writable: bool,
    /// A write, fallocate or copy into it went through the mount.
    pub wrote: AtomicBool,
    /// When a write through it last marked its path a recent change of the mount's own
    /// (`Shared::writing`), in ms of [`crate::recent::ms_now`]; 0: never.
    pub told_ms: AtomicU64,
    /// Reads and writes go through kernel passthrough (the mount never sees them).
    pub passthrough: bool,
    /// Held so the kernel's backing file lives as long as this open.
    _backing: Option<Arc<BackingId>>,
    /// The open of a placeholder being assembled (D95): each read waits on it first.
    pub stream: Option<Box<dyn crate::ContentStream>>,
}

impl Handle {
    /// The backing descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[derive(Debug, Default)]
struct InodeOpens {
    opens: u32,
    writers: u32,
    passthrough: bool,
    backing: Option<Weak<BackingId>>,
    /// The open handles of the inode.
    handles: Vec<u64>,
}

/// What [`Handles::release`] took out.
pub(crate) struct Released {
    /// The handle (its descriptor closes when this drops).
    pub handle: Arc<Handle>,
    /// It was the last handle that could write its inode.
    pub last_writer: bool,
}

/// Every open handle of the mount.
#[derive(Debug)]
pub(crate) struct Handles {
    next: AtomicU64,
    map: Mutex<HashMap<u64, Arc<Handle>>>,
    inodes: Mutex<HashMap<u64, InodeOpens>>,
    /// Open handles by the backing inode their descriptor holds.
    backing: Mutex<HashMap<u64, u32>>,
}

impl Handles {
    /// No handles.
    pub fn new() -> Handles {
        Handles {
            next: AtomicU64::new(1),
            map: Mutex::new(HashMap::new()),
            inodes: Mutex::new(HashMap::new()),
            backing: Mutex::new(HashMap::new()),
        }
    }

    /// Registers an open file of node `ino` whose descriptor `fd` holds the backing inode
    /// `backing_ino`. `stream`: the open reads a placeholder being assembled. `make_backing` (when passthrough is wanted) registers `fd`
    /// with the kernel; it is only called for the first open of an inode, whose mode the
    /// later opens then share. Returns the handle id and the backing id to reply with.
    pub fn add_file(
        &self,
        ino: u64,
        backing_ino: u64,
        fd: OwnedFd,
        writable: bool,
        make_backing: Option<MakeBacking<'_>>,
        stream: Option<Box<dyn crate::ContentStream>>,
    ) -> (u64, Option<Arc<BackingId>>) {
        let fh = self.next.fetch_add(1, Ordering::Relaxed);
        let backing = {
            let mut inodes = lock(&self.inodes);
            let st = inodes.entry(ino).or_default();
            let backing = if st.opens > 0 {
                if st.passthrough {
                    let b = st.backing.as_ref().and_then(Weak::upgrade);
                    debug_assert!(b.is_some(), "a passthrough open holds the backing id");
                    b
                } else {
                    None
                }
            } else {
                // The kernel call runs under this lock so two first opens of one inode
                // cannot register two backing files (the kernel would refuse the second).
                let b = make_backing.and_then(|make| make(fd.as_fd())).map(Arc::new);
                st.passthrough = b.is_some();
                st.backing = b.as_ref().map(Arc::downgrade);
                b
            };
            st.opens += 1;
            if writable {
                st.writers += 1;
            }
            st.handles.push(fh);
            backing
        };
        *lock(&self.backing).entry(backing_ino).or_default() += 1;
        // Inserted after the inode's bookkeeping: `any_file_of` may see an id not yet in
        // the map (and then finds nothing), never a handle its inode does not count.
        lock(&self.map).insert(
            fh,
            Arc::new(Handle {
                ino,
                backing_ino,
                fd,
                writable,
                wrote: AtomicBool::new(false),
                told_ms: AtomicU64::new(0),
                passthrough: backing.is_some(),
                _backing: backing.clone(),
                stream,
            }),
        );
        (fh, backing)
    }

    /// The handle `fh`.
    pub fn get(&self, fh: u64) -> Option<Arc<Handle>> {
        lock(&self.map).get(&fh).cloned()
    }

    /// Takes `fh` out.
    pub fn release(&self, fh: u64) -> Option<Released> {
        let handle = lock(&self.map).remove(&fh)?;
        let mut last_writer = false;
        {
            let mut inodes = lock(&self.inodes);
            if let Some(st) = inodes.get_mut(&handle.ino) {
                st.opens = st.opens.saturating_sub(1);
                st.handles.retain(|&h| h != fh);
                if handle.writable {
                    st.writers = st.writers.saturating_sub(1);
                    last_writer = st.writers == 0;
                }
                if st.opens == 0 {
                    inodes.remove(&handle.ino);
                }
            }
        }
        {
            let mut b = lock(&self.backing);
            if let Some(n) = b.get_mut(&handle.backing_ino) {
                *n -= 1;
                if *n == 0 {
                    b.remove(&handle.backing_ino);
                }
            }
        }
        Some(Released {
            handle,
            last_writer,
        })
    }

    /// Whether a handle that may write `ino` is open.
    pub fn has_writer(&self, ino: u64) -> bool {
        lock(&self.inodes).get(&ino).is_some_and(|s| s.writers > 0)
    }

    /// Whether a handle whose descriptor holds the backing inode `backing_ino` is open.
    pub fn holds_backing(&self, backing_ino: u64) -> bool {
        lock(&self.backing).contains_key(&backing_ino)
    }

    /// Any open file of `ino` (to reach an unlinked or replaced inode), but a stream's: the
    /// descriptor of a file being assembled is not the node's (its size and holes are not the
    /// file's, D95).
    pub fn any_file_of(&self, ino: u64) -> Option<Arc<Handle>> {
        let fhs = lock(&self.inodes).get(&ino)?.handles.clone();
        fhs.into_iter()
            .filter_map(|fh| self.get(fh))
            .find(|h| h.stream.is_none())
    }

    /// How many handles are open.
    pub fn count(&self) -> usize {
        lock(&self.map).len()
    }
}
