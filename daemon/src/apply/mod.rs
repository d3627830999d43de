//! Applying a peer's records: the real executor of the sync core's plans
//! ([`meshfs_sync::plan`]) against the store and the journal. The simulation executes the
//! same plans against its model; only the executors differ. The numbered commit order:
//!
//! 1. [`decide`]: plan every record against the journal (under the folder's lock); steps
//!    without content (metadata, directories, symlinks, deletions, conflict siblings of local
//!    content) are done and journaled at once;
//! 2. [`assemble`]: file contents are assembled in temp files from local chunks (chunk index)
//!    and chunks fetched from the peer, each verified by blake3 (no lock held: local edits go
//!    on);
//! 3. every temp file is checked to be exactly covered by its verified chunks (the record's
//!    hash is its chunk list's, checked when the record was decoded, so the file is not read
//!    again), and the batch's temp files are made durable together (`syncfs`; still no lock);
//! 4. [`install`] (lock): the records are journaled as *pending* in one transaction;
//! 5. each target is checked against the stat the journal expects (and the journal against the
//!    record the decision saw), and the temp file renamed over it; each touched directory is
//!    fsynced once;
//! 6. the applied records are committed in one transaction, which also clears their pending
//!    rows. A crash between 4 and 6 is completed at start-up ([`recover_pending`]).
//!
//! A target that changed on disk since it was last scanned is not replaced: the path is
//! rescanned (its local edit becomes a version) and the record planned again, up to
//! [`meshfs_sync::pipeline::MAX_ROUNDS`] times; then it is skipped (shown in `status`) and the
//! rest of the batch is applied and acknowledged.
//!
//! Which batch does what when — a session's batches in order, one step under the folder's lock
//! at a time, a record another session has in flight held back, rounds, acknowledgements — is
//! the sync core's receive pipeline ([`meshfs_sync::pipeline`]); [`driver`] executes its
//! actions with the steps above.

mod assemble;
mod decide;
mod driver;
mod fill;
mod install;
mod stream;
mod transfer;

pub use driver::{Receiver, Reply};
pub use fill::{FillError, STALL};
pub use install::recover_pending;
pub use meshfs_sync::pipeline::Source;
pub use stream::{drive, Conns, Streamed};
pub use transfer::ApplyError;

/// Runs a step that blocks (SQLite, the disk) on a blocking thread, off the runtime's workers.
async fn on_blocking<T: Send + 'static>(
    step: impl FnOnce() -> Result<T, ApplyError> + Send + 'static,
) -> Result<T, ApplyError> {
    tokio::task::spawn_blocking(step)
        .await
        .map_err(|e| ApplyError::Task(e.to_string()))?
}
