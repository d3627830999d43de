//! # meshfs-daemon: the engine
//!
//! The journal (SQLite), the replica store (safe apply), capture (scanner and watcher), the
//! reconciler and the peer session (pure state machines), the QUIC transport, and the engine
//! that drives them all, with its control socket. See `docs/architecture.md` for the map.
#![deny(missing_docs)]

pub mod apply;
pub mod capture;
pub mod chunker;
pub mod config;
pub mod conflicts;
pub mod control;
pub mod engine;
pub mod identity;
pub mod ignore;
pub mod journal;
pub(crate) mod mapped;
pub mod mounts;
pub mod peers;
pub mod reconcile;
pub mod scanner;
pub mod session;
pub mod sim;
pub mod store;
pub(crate) mod sys;
pub mod traffic;
pub mod transport;
