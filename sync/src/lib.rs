//! # meshfs-sync: the pure sync core
//!
//! Everything that decides, and nothing that does: the reconciler ([`reconcile`]), the peer
//! session state machine ([`session`]) with its address exchange ([`rendezvous`]), the apply
//! planner ([`plan`]) and the deterministic
//! simulation ([`sim`]) that drives all three with many replicas in one thread.
//!
//! **Architecture invariant:** no IO, no clock, no async runtime. Purity is enforced by this
//! crate's dependencies (no tokio, quinn or rusqlite), as it is for `meshfs-protocol`. The
//! daemon drives the same code with sockets, SQLite and files; the simulation with a seeded
//! RNG and in-memory replicas. Only the executors of a plan differ.
#![deny(missing_docs)]

pub mod error;
pub mod pipeline;
pub mod plan;
pub mod reconcile;
pub mod rendezvous;
pub mod role;
pub mod session;
pub mod sim;
#[cfg(test)]
mod testing;
