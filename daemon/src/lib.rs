//! # meshfs-daemon: the engine
//!
//! The journal (SQLite), the replica store (safe apply), capture (scanner and watcher), the
//! folder runtime, the QUIC transport and the peers, and the engine that wires them, with its
//! control socket: everything that does IO around the pure sync core (`meshfs-sync`). See
//! `docs/architecture.md` for the map.
#![deny(missing_docs)]

pub mod apply;
pub mod assembly;
pub mod bulk;
pub mod capture;
pub mod chunker;
pub mod chunks;
pub mod clock;
pub mod config;
pub mod conflicts;
pub mod control;
pub mod demand;
pub mod dialer;
pub mod discovery;
pub mod engine;
pub mod failpoint;
pub mod folder;
pub mod identity;
pub mod ignore;
pub mod journal;
pub mod last_error;
pub mod lock;
pub(crate) mod mapped;
pub mod mounts;
pub mod ondemand;
pub mod outbox;
pub mod peers;
pub mod pending;
pub mod priority;
pub mod progress;
pub mod readout;
pub mod resume_points;
pub mod roles;
pub mod room;
pub mod scanner;
pub mod status;
pub mod store;
pub mod traffic;
pub mod transport;
pub mod ui;
pub mod vault;
pub mod versions;
