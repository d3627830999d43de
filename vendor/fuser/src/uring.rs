//! FUSE over io_uring (meshfs addition; kernel `Documentation/filesystems/fuse-io-uring.rst`,
//! libfuse's `lib/fuse_uring.c`).
//!
//! One queue per possible CPU, each served by one thread pinned to that CPU. The kernel puts
//! a request on the queue of the CPU its caller runs on, so the caller and the thread that
//! answers share a CPU: the hand-over is a context switch on that CPU, not a wake-up of
//! another (on a VM, often a halted vCPU). Each queue registers `depth` entries (a header and
//! a payload buffer each) with `FUSE_IO_URING_CMD_REGISTER`; the kernel completes an entry's
//! command when it has put a request into its buffers, and the reply goes back in the same
//! buffers with `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`, which also hands the entry back for the
//! next request.
//!
//! Once FUSE_INIT has agreed to io_uring, the kernel holds every new request until every
//! queue has registered (FORGET, INTERRUPT and notification replies still come through
//! `/dev/fuse` to the session's ordinary threads). So the session asks for io_uring only where
//! a probe ring with `URING_CMD` can be made ([`usable`]), and [`crate::UringQueues`] tells the
//! filesystem whether the queues came up, so that it can give up on a connection whose queues
//! did not (meshfs mounts again without io_uring).
//!
//! A request is reassembled into the layout a `/dev/fuse` read gives (in-header, the
//! operation's own header, the rest) and dispatched through the same code; the reply the
//! filesystem sends is caught in a [`RingReply`] slot and copied into the entry. So the
//! filesystem must reply before its method returns, which meshfs's does.

use std::io;
use std::os::fd::AsRawFd;
use std::os::fd::FromRawFd;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use io_uring::IoUring;
use io_uring::cqueue;
use io_uring::opcode;
use io_uring::squeue;
use io_uring::types;
use log::debug;
use log::error;
use log::warn;

use crate::Filesystem;
use crate::UringQueues;
use crate::channel::ChannelSender;
use crate::channel::RingReply;
use crate::dev_fuse::DevFuse;
use crate::request::RequestWithSender;
use crate::session::SessionEventLoop;

/// `FUSE_IO_URING_CMD_REGISTER`: register an entry's buffers and wait for a request.
const CMD_REGISTER: u32 = 1;
/// `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`: reply to the entry's request and wait for the next.
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// `struct fuse_uring_req_header`: `in_out[128]`, `op_in[128]`, `fuse_uring_ent_in_out`.
const OP_IN: usize = 128;
const OP_IN_MAX: usize = 128;
const ENT_COMMIT_ID: usize = 256 + 8;
const ENT_PAYLOAD_SZ: usize = 256 + 16;
/// The header buffer: the structure is 288 bytes; a page, as libfuse allocates it.
const HEADER_BUF: usize = 4096;
/// `struct fuse_in_header` and `struct fuse_out_header`.
const IN_HEADER: usize = 40;
const OUT_HEADER: usize = 16;

/// Entries per queue. One thread serves a queue one request at a time; more entries let the
/// kernel queue background requests (releases) beside a waiting caller's.
pub(crate) const DEPTH: usize = 8;

/// The `user_data` of the stop eventfd's poll.
const STOP: u64 = u64::MAX;

/// The CPUs the kernel makes queues for (`num_possible_cpus()`).
pub(crate) fn possible_cpus() -> usize {
    let parsed = std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| {
            // Ranges like "0-3,8-11": the highest CPU number plus one.
            let mut n = 0;
            for part in s.trim().split(',') {
                let last = part.rsplit('-').next()?.parse::<usize>().ok()?;
                n = n.max(last + 1);
            }
            Some(n)
        });
    parsed.unwrap_or_else(|| {
        // SAFETY: sysconf reads a configuration value and touches no memory of ours.
        let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
        usize::try_from(n).unwrap_or(1).max(1)
    })
}

/// Whether this process can make a ring with 128-byte entries that takes `URING_CMD`.
pub(crate) fn usable() -> bool {
    let Ok(ring) = IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(2) else {
        return false;
    };
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe).is_ok()
        && probe.is_supported(opcode::UringCmd80::CODE)
}

/// A buffer the kernel writes into between a command's submission and its completion: a
/// raw allocation, never borrowed as a Rust slice while the kernel owns it.
struct KernelBuf {
    ptr: *mut u8,
    len: usize,
}

impl KernelBuf {
    fn new(len: usize) -> io::Result<KernelBuf> {
        let layout = std::alloc::Layout::from_size_align(len, 4096)
            .map_err(|_| io::Error::other("io_uring buffer layout"))?;
        // SAFETY: the layout has a non-zero size (callers pass at least a page).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(io::Error::new(io::ErrorKind::OutOfMemory, "io_uring buffer"));
        }
        Ok(KernelBuf { ptr, len })
    }

    /// Copies `len` bytes at `at` out (the entry is ours: its command completed).
    fn read(&self, at: usize, out: &mut Vec<u8>, len: usize) -> bool {
        if at.checked_add(len).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: in bounds (checked above); the kernel does not write this entry's buffers
        // between the command's completion and our next submission of it.
        unsafe { out.extend_from_slice(std::slice::from_raw_parts(self.ptr.add(at), len)) };
        true
    }

    fn write(&self, at: usize, data: &[u8]) -> bool {
        if at.checked_add(data.len()).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: in bounds (checked above), and the kernel does not touch the buffer while
        // the entry is ours.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(at), data.len()) };
        true
    }

    fn u32_at(&self, at: usize) -> u32 {
        if at + 4 > self.len {
            return 0;
        }
        // SAFETY: in bounds (checked above); an unaligned read of plain bytes.
        unsafe { std::ptr::read_unaligned(self.ptr.add(at).cast::<u32>()) }
    }

    fn u64_at(&self, at: usize) -> u64 {
        if at + 8 > self.len {
            return 0;
        }
        // SAFETY: in bounds (checked above); an unaligned read of plain bytes.
        unsafe { std::ptr::read_unaligned(self.ptr.add(at).cast::<u64>()) }
    }
}

impl Drop for KernelBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout (which was valid then).
        unsafe {
            std::alloc::dealloc(
                self.ptr,
                std::alloc::Layout::from_size_align_unchecked(self.len, 4096),
            )
        };
    }
}

/// One ring entry: its buffers, the iovecs that name them to the kernel, and the request it
/// holds.
struct Entry {
    header: KernelBuf,
    payload: KernelBuf,
    iov: Box<[libc::iovec; 2]>,
    /// The command last submitted for it (resubmitted as is after `EAGAIN`/`EINTR`).
    last_cmd: u32,
    commit_id: u64,
}

/// Stops a queue thread: wakes it through its eventfd.
#[derive(Debug)]
pub(crate) struct QueueStop(OwnedFd);

impl QueueStop {
    pub(crate) fn stop(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local buffer to our eventfd.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }
}

/// Starts the thread serving queue `qid`. Returns its handle and its stop switch.
pub(crate) fn spawn_queue<FS: Filesystem>(
    qid: usize,
    payload_size: usize,
    device: Arc<DevFuse>,
    event_loop: SessionEventLoop<FS>,
    counts: UringQueues,
) -> io::Result<(std::thread::JoinHandle<()>, QueueStop)> {
    // SAFETY: eventfd takes two integers; a negative result is an error, checked below.
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if efd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: eventfd returned a new descriptor that nothing else owns.
    let efd = unsafe { OwnedFd::from_raw_fd(efd) };
    let wake = efd.try_clone()?;
    let handle = std::thread::Builder::new()
        .name(format!("fuse-ring-{qid}"))
        .spawn(move || {
            if let Err(e) = serve_queue(qid, payload_size, &device, &event_loop, &efd, &counts) {
                warn!("FUSE io_uring queue {qid} stopped: {e}");
            }
            counts.ended();
        })?;
    Ok((handle, QueueStop(wake)))
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: a cpu_set_t is plain data; CPU_SET writes into the local set, and
    // sched_setaffinity reads it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        debug!(
            "FUSE io_uring queue {cpu}: not pinned to its CPU: {}",
            io::Error::last_os_error()
        );
    }
}

/// The nice value of a queue thread where this process may raise it (root).
const QUEUE_NICE: i32 = -5;

/// A queue thread runs only while a caller on its CPU waits for it; at the default weight the
/// scheduler would often run something else on that CPU first. Measured with 10,000 creates
/// through the mount (backing on tmpfs): 0.68 s at nice 0, 0.51-0.52 s at -5, -10 or -20.
fn raise_priority(qid: usize) {
    // SAFETY: gettid and setpriority take integers and touch no memory of ours.
    let rc = unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, QUEUE_NICE)
    };
    if rc != 0 {
        debug!(
            "FUSE io_uring queue {qid}: priority not raised: {}",
            io::Error::last_os_error()
        );
    }
}

fn serve_queue<FS: Filesystem>(
    qid: usize,
    payload_size: usize,
    device: &Arc<DevFuse>,
    event_loop: &SessionEventLoop<FS>,
    stop: &OwnedFd,
    counts: &UringQueues,
) -> io::Result<()> {
    pin_to_cpu(qid);
    raise_priority(qid);
    // Fault injection for meshfs's tests: a queue that cannot start.
    if std::env::var_os("FUSER_URING_FAIL_QUEUES").is_some() {
        return Err(io::Error::other("FUSER_URING_FAIL_QUEUES is set"));
    }
    let depth = DEPTH;
    // Declared before the ring, so dropped after it: closing the ring cancels the commands
    // that name these buffers.
    let mut entries = Vec::with_capacity(depth);
    for _ in 0..depth {
        let header = KernelBuf::new(HEADER_BUF)?;
        let payload = KernelBuf::new(payload_size)?;
        let iov = Box::new([
            libc::iovec {
                iov_base: header.ptr.cast(),
                iov_len: header.len,
            },
            libc::iovec {
                iov_base: payload.ptr.cast(),
                iov_len: payload.len,
            },
        ]);
        entries.push(Entry {
            header,
            payload,
            iov,
            last_cmd: CMD_REGISTER,
            commit_id: 0,
        });
    }
    let mut ring: IoUring<squeue::Entry128, cqueue::Entry> = IoUring::builder()
        .setup_cqsize(2 * (depth as u32 + 1))
        .build(depth as u32 + 1)?;
    ring.submitter().register_files(&[device.as_raw_fd()])?;
    let qid16 = u16::try_from(qid).map_err(|_| io::Error::other("queue id"))?;

    for idx in 0..depth {
        push(&mut ring, &entries[idx], idx, qid16)?;
    }
    let poll = opcode::PollAdd::new(types::Fd(stop.as_raw_fd()), libc::POLLIN as u32)
        .build()
        .user_data(STOP);
    // SAFETY: the poll names our eventfd, which outlives the ring (dropped after it).
    unsafe { ring.submission().push(&squeue::Entry128::from(poll)) }
        .map_err(|_| io::Error::other("io_uring submission queue full"))?;

    let slot = Arc::new(RingReply::default());
    let mut bufs = Buffers {
        request: Vec::with_capacity(IN_HEADER + OP_IN_MAX + payload_size),
        reply: Vec::new(),
    };
    debug!("FUSE io_uring queue {qid}: {depth} entries of {payload_size} bytes registered");
    let mut held = depth;
    counts.started();
    let end = run_queue(
        &mut ring,
        &mut entries,
        &mut held,
        qid16,
        device,
        event_loop,
        &slot,
        &mut bufs,
    );
    counts.stopped_serving();
    drop(ring);
    if held > 0 {
        // The kernel may still write into entries it holds after the ring closes (its
        // cancellation runs later): leave their buffers allocated.
        debug!("FUSE io_uring queue {qid}: {held} entries still held by the kernel at exit");
        std::mem::forget(entries);
    }
    end
}

#[allow(clippy::too_many_arguments)]
fn run_queue<FS: Filesystem>(
    ring: &mut IoUring<squeue::Entry128, cqueue::Entry>,
    entries: &mut [Entry],
    held: &mut usize,
    qid: u16,
    device: &Arc<DevFuse>,
    event_loop: &SessionEventLoop<FS>,
    slot: &Arc<RingReply>,
    bufs: &mut Buffers,
) -> io::Result<()> {
    let mut done = Vec::with_capacity(entries.len() + 1);
    loop {
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => return Err(e),
        }
        done.clear();
        done.extend(ring.completion().map(|c| (c.user_data(), c.result())));
        for &(user_data, res) in &done {
            if user_data == STOP {
                return Ok(());
            }
            let idx = usize::try_from(user_data).unwrap_or(usize::MAX);
            let Some(ent) = entries.get_mut(idx) else {
                error!("FUSE io_uring queue {qid}: completion for unknown entry {user_data}");
                continue;
            };
            if res < 0 {
                match -res {
                    libc::EAGAIN | libc::EINTR => {
                        push(ring, ent, idx, qid)?;
                        continue;
                    }
                    // The connection is gone (unmounted or aborted), or the ring is closing:
                    // this entry is back for good.
                    libc::ENOTCONN | libc::ENODEV | libc::ECANCELED => {
                        *held -= 1;
                        if *held == 0 {
                            return Ok(());
                        }
                        continue;
                    }
                    e => {
                        *held -= 1;
                        return Err(io::Error::from_raw_os_error(e));
                    }
                }
            }
            answer(ent, device, event_loop, slot, bufs);
            ent.last_cmd = CMD_COMMIT_AND_FETCH;
            push(ring, ent, idx, qid)?;
        }
    }
}

/// Queues `ent`'s command (its `last_cmd`) for submission.
fn push(
    ring: &mut IoUring<squeue::Entry128, cqueue::Entry>,
    ent: &Entry,
    idx: usize,
    qid: u16,
) -> io::Result<()> {
    // struct fuse_uring_cmd_req { u64 flags; u64 commit_id; u16 qid; u8 padding[6]; }
    let mut cmd = [0u8; 80];
    let commit_id = if ent.last_cmd == CMD_REGISTER {
        0
    } else {
        ent.commit_id
    };
    cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    cmd[16..18].copy_from_slice(&qid.to_ne_bytes());
    let mut builder = opcode::UringCmd80::new(types::Fixed(0), ent.last_cmd).cmd(cmd);
    if ent.last_cmd == CMD_REGISTER {
        builder = builder.addr(Some(ent.iov.as_ptr() as u64));
    }
    let mut sqe = builder.build().user_data(idx as u64);
    if ent.last_cmd == CMD_REGISTER {
        // The kernel wants the iovec count in `len`, which `UringCmd80` has no setter for.
        sqe = with_len(sqe, 2);
    }
    // SAFETY: a REGISTER names the entry's iovecs and buffers, which live as long as the
    // ring's owner keeps `entries` (the whole of `serve_queue`, past the ring's drop, which
    // cancels what the kernel still holds); a COMMIT names no memory.
    unsafe { ring.submission().push(&sqe) }
        .map_err(|_| io::Error::other("io_uring submission queue full"))
}

/// Sets the `len` field (bytes 24..28) of a 128-byte submission entry.
fn with_len(sqe: squeue::Entry128, len: u32) -> squeue::Entry128 {
    // SAFETY: `Entry128` is `repr(C)`, 128 bytes of `io_uring_sqe` and its extension, so it
    // round-trips through a byte array of its size; `len` is a u32 at offset 24 of
    // `struct io_uring_sqe`.
    unsafe {
        let mut raw: [u8; 128] = std::mem::transmute(sqe);
        raw[24..28].copy_from_slice(&len.to_ne_bytes());
        std::mem::transmute::<[u8; 128], squeue::Entry128>(raw)
    }
}

/// Dispatches the request in `ent` and writes the reply into it.
fn answer<FS: Filesystem>(
    ent: &mut Entry,
    device: &Arc<DevFuse>,
    event_loop: &SessionEventLoop<FS>,
    slot: &Arc<RingReply>,
    bufs: &mut Buffers,
) {
    let Buffers { request, reply } = bufs;
    ent.commit_id = ent.header.u64_at(ENT_COMMIT_ID);
    let len = ent.header.u32_at(0) as usize;
    let unique = ent.header.u64_at(8);
    let payload_sz = ent.header.u32_at(ENT_PAYLOAD_SZ) as usize;
    request.clear();
    let op_in = len.checked_sub(IN_HEADER + payload_sz);
    let ok = op_in.is_some_and(|op_in| {
        op_in <= OP_IN_MAX
            && ent.header.read(0, request, IN_HEADER)
            && ent.header.read(OP_IN, request, op_in)
            && ent.payload.read(0, request, payload_sz)
    });
    slot.clear();
    if ok {
        let sender = ChannelSender::for_ring(device.clone(), slot.clone());
        match RequestWithSender::new(sender, request) {
            Some(req) => req.dispatch(event_loop),
            None => error!("FUSE io_uring: a request that does not parse (unique {unique})"),
        }
    } else {
        error!(
            "FUSE io_uring: request {unique} of {len} bytes with a payload of {payload_sz} does not fit its entry"
        );
    }
    if !slot.take_into(reply) {
        // Nothing was sent before the method returned: the request fails rather than
        // holding its caller (and this entry) forever.
        error!("FUSE io_uring: no reply to request {unique}; answering EIO");
        reply.clear();
        reply.extend_from_slice(&eio_reply(unique));
    }
    let (head, body) = reply.split_at(OUT_HEADER.min(reply.len()));
    let written = ent.header.write(0, head)
        && ent.payload.write(0, body)
        && ent
            .header
            .write(ENT_PAYLOAD_SZ, &(body.len() as u32).to_ne_bytes());
    if !written {
        error!(
            "FUSE io_uring: reply to request {unique} ({} bytes) does not fit its entry",
            reply.len()
        );
        let _ = ent.header.write(0, &eio_reply(unique))
            && ent.header.write(ENT_PAYLOAD_SZ, &0u32.to_ne_bytes());
    }
}

/// A queue thread's buffers, reused from request to request.
struct Buffers {
    /// The request reassembled as a `/dev/fuse` read gives it.
    request: Vec<u8>,
    /// The reply, swapped out of the [`RingReply`] slot.
    reply: Vec<u8>,
}

/// `struct fuse_out_header` answering request `unique` with `EIO`.
fn eio_reply(unique: u64) -> [u8; OUT_HEADER] {
    let mut h = [0u8; OUT_HEADER];
    h[0..4].copy_from_slice(&(OUT_HEADER as u32).to_ne_bytes());
    h[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
    h[8..16].copy_from_slice(&unique.to_ne_bytes());
    h
}
