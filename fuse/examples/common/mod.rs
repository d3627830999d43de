//! What the mount examples share: stopping on SIGINT or SIGTERM.

/// SIGINT and SIGTERM, blocked in the calling thread; call it before any thread starts (they
/// inherit the mask), so that only [`StopSignals::wait`] receives them.
pub struct StopSignals(libc::sigset_t);

impl StopSignals {
    pub fn block() -> StopSignals {
        // SAFETY: a sigset_t is plain data; these calls only read and write the local set and
        // this thread's mask.
        let set = unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            set
        };
        StopSignals(set)
    }

    /// Returns once one of them arrives.
    pub fn wait(&self) {
        let mut sig: libc::c_int = 0;
        // SAFETY: the set is the initialised one above; `sig` is a valid out-pointer.
        unsafe { libc::sigwait(&self.0, &mut sig) };
    }
}
