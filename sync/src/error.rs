//! The one error the pure core knows: its driver could not read this replica's records.

/// Reading this replica's records failed (the journal could not be read). A decision or a
/// session step that meets one is abandoned, never taken as "no record" or "nothing to send":
/// either would make a folder look in sync, or make a remote version look new.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot read this replica's records: {0}")]
pub struct ReadError(pub String);

impl ReadError {
    /// A read error from anything that displays.
    pub fn from_display(e: impl std::fmt::Display) -> ReadError {
        ReadError(e.to_string())
    }
}
