//! The last error of a folder or a peer, kept with its time, so `status` can say what went
//! wrong and when after the log line has scrolled away. Only the last one is kept: the log has
//! the history.

use serde::Serialize;
use std::sync::Mutex;

/// An error and when it happened.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LastError {
    /// What failed, on which path or peer, as the log says it.
    pub message: String,
    /// When (Unix seconds).
    pub unix: u64,
}

impl LastError {
    /// `message`, happening now.
    pub fn now(message: impl std::fmt::Display) -> LastError {
        let unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        LastError {
            message: message.to_string(),
            unix,
        }
    }
}

/// Where a folder keeps its last error.
#[derive(Debug, Default)]
pub struct LastErrorSlot(Mutex<Option<LastError>>);

impl LastErrorSlot {
    /// `message` happened now; it replaces the one before.
    pub fn set(&self, message: impl std::fmt::Display) {
        let e = LastError::now(message);
        if let Ok(mut slot) = self.0.lock() {
            *slot = Some(e);
        }
    }

    /// The last error, if there was one since the daemon started.
    pub fn get(&self) -> Option<LastError> {
        self.0.lock().ok().and_then(|e| e.clone())
    }
}
