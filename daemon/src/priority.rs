//! The engine's threads run at a lower priority than the mount's request threads (D107).
//!
//! A program working in a mounted folder waits on the mount's request threads at every
//! `unlink`, `create` or `stat`; the engine's capture, journal and transfers can come a moment
//! later. So the daemon's runtime threads (`tokio`'s workers and blocking threads) and the
//! threads they start (the watcher's) lower themselves by [`BACKGROUND_NICE`], and a mount is
//! made on a thread kept at the daemon's own priority, whose threads (the kernel's requests,
//! invalidations, read-ahead) inherit it. On Linux a nice value is per thread and inherited
//! by the threads a thread starts; without privilege it can only be raised, so the foreground
//! thread is started before any thread is lowered ([`init`]) and never lowered itself.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Mutex, OnceLock};

/// How much lower (in nice steps) than the daemon's own priority its engine threads run.
pub const BACKGROUND_NICE: i32 = 10;

type Job = Box<dyn FnOnce() + Send>;

static FOREGROUND: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();

/// The daemon's own nice value, read by [`init`].
static BASE: OnceLock<i32> = OnceLock::new();

/// Starts the thread that keeps the daemon's priority. Call on the main thread before any
/// thread is lowered; without it [`in_foreground`] runs its work where it is called.
pub fn init() {
    let _ = BASE.set(meshfs_sys::thread_nice().unwrap_or(0));
    let (tx, rx) = mpsc::channel::<Job>();
    let started = std::thread::Builder::new()
        .name("meshfs-foreground".into())
        .spawn(move || {
            for job in rx {
                job();
            }
        });
    match started {
        Ok(_) => {
            let _ = FOREGROUND.set(Mutex::new(tx));
        }
        Err(e) => {
            tracing::warn!(error = %e, "no foreground thread: mounts run at the engine's priority")
        }
    }
}

/// Lowers the calling thread to [`BACKGROUND_NICE`] below the daemon's own priority (at most
/// to 19), once: for the runtime's `on_thread_start` and the watcher's thread. A thread started
/// by one already lowered is left as it is. Best effort: a thread left where it was only
/// competes as before.
pub fn background() {
    thread_local! {
        static LOWERED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if LOWERED.with(|l| l.replace(true)) {
        return;
    }
    let lowered = meshfs_sys::thread_nice().and_then(|now| {
        let target = (BASE.get().copied().unwrap_or(now) + BACKGROUND_NICE).min(19);
        match now >= target {
            true => Ok(()),
            false => meshfs_sys::set_thread_nice(target),
        }
    });
    if let Err(e) = lowered {
        tracing::debug!(error = %e, "an engine thread keeps the daemon's priority");
    }
}

/// Runs `f` on the foreground thread (see [`init`]), so that the threads it starts run at the
/// daemon's own priority, and returns what it returns (a panic in `f` is resumed here).
/// Blocks the caller until `f` is done.
pub fn in_foreground<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (rtx, rrx) = mpsc::sync_channel(1);
    let job: Job = Box::new(move || {
        let _ = rtx.send(catch_unwind(AssertUnwindSafe(f)));
    });
    let sent = match FOREGROUND.get() {
        Some(tx) => tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(job)
            .map_err(|mpsc::SendError(job)| job),
        None => Err(job),
    };
    if let Err(job) = sent {
        job();
    }
    match rrx.recv() {
        Ok(Ok(v)) => v,
        Ok(Err(panic)) => resume_unwind(panic),
        // The job always sends before it is dropped; a foreground thread gone mid-job has
        // panicked outside `f`, which catch_unwind rules out.
        Err(_) => unreachable!("the foreground job ended without an answer"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_started_in_the_foreground_keeps_the_priority_a_background_thread_gave_up() {
        init();
        let mine = meshfs_sys::thread_nice().unwrap();
        let (lowered, started_in_foreground, started_here) = std::thread::spawn(|| {
            background();
            let lowered = meshfs_sys::thread_nice().unwrap();
            let fg = in_foreground(|| {
                std::thread::spawn(|| meshfs_sys::thread_nice().unwrap())
                    .join()
                    .unwrap()
            });
            let here = std::thread::spawn(|| meshfs_sys::thread_nice().unwrap())
                .join()
                .unwrap();
            (lowered, fg, here)
        })
        .join()
        .unwrap();
        assert_eq!(lowered, (mine + BACKGROUND_NICE).min(19));
        assert_eq!(started_in_foreground, mine);
        assert_eq!(
            started_here, lowered,
            "a thread inherits its starter's value"
        );
        let again = std::thread::spawn(|| {
            background();
            std::thread::spawn(|| {
                background();
                meshfs_sys::thread_nice().unwrap()
            })
            .join()
            .unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(
            again, lowered,
            "a lowered thread's thread is not lowered twice"
        );
        assert_eq!(
            meshfs_sys::thread_nice().unwrap(),
            mine,
            "only the lowered thread moved"
        );
        let caught = catch_unwind(|| in_foreground(|| panic!("inside")));
        assert!(caught.is_err(), "a panic comes back to the caller");
        assert_eq!(in_foreground(|| 7), 7, "and the foreground thread lives on");
    }
}
