//! Folder roles: what a device does with its peers' versions and with its own changes.
//!
//! - **send-receive** (the default): both ways, every concurrent change reconciled
//!   ([`crate::reconcile`]).
//! - **send-only**: this device's changes are sent; a peer's version that this device's does
//!   not already include is not applied here, only *held* (listed by `status`), until
//!   `override` makes this device's state win everywhere ([`overriding`]).
//! - **receive-only**: a peer's versions are applied; this device's own changes are not sent.
//!   Where a local change and a peer's version meet, the peer's is taken as it is (the shared
//!   state wins, the local content is kept as a past version), never resolved into a new
//!   version that only this device would have. `revert` puts the shared state back.
//!
//! The roles change neither the session nor the receive pipeline: a send-only folder's held
//! records are decided (as "nothing to apply here") and acknowledged like any other, and a
//! receive-only folder's own records are left out where the driver reads what to send
//! (`IndexSource::records_since`). What they change is decided here, purely.
//!
//! **Architecture invariant:** pure, like the reconciler it sits beside.

use meshfs_protocol::{FileRecord, ShortId, VersionVector, VvOrdering};

/// A folder's role on this device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Role {
    /// Send and receive (the default).
    #[default]
    SendReceive,
    /// Send this device's changes; hold the peers' (not applied).
    SendOnly,
    /// Apply the peers' changes; do not send this device's.
    ReceiveOnly,
}

impl Role {
    /// Its name in the config and in `status`: `send-receive`, `send-only`, `receive-only`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::SendReceive => "send-receive",
            Role::SendOnly => "send-only",
            Role::ReceiveOnly => "receive-only",
        }
    }

    /// The inverse of [`Role::as_str`].
    pub fn parse(s: &str) -> Option<Role> {
        Some(match s {
            "send-receive" => Role::SendReceive,
            "send-only" => Role::SendOnly,
            "receive-only" => Role::ReceiveOnly,
            _ => return None,
        })
    }
}

/// What a folder does with a peer's record ([`intake`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Intake {
    /// Decide it as usual ([`crate::plan::plan`]).
    Decide,
    /// Send-only: a version this device's does not include is not applied; it is held.
    Hold,
    /// Receive-only: a version concurrent with a local change is taken as it is
    /// ([`crate::plan::plan_taking`]), not resolved.
    Take,
}

/// What a folder of `role` does with `remote`, given its own record `local` at that path.
pub fn intake(role: Role, local: Option<&FileRecord>, remote: &FileRecord) -> Intake {
    let order = local.map(|l| l.version.compare(&remote.version));
    match role {
        Role::SendReceive => Intake::Decide,
        // Ours is the same or newer: deciding does nothing, and the peer gets ours.
        Role::SendOnly => match order {
            Some(VvOrdering::Equal | VvOrdering::After) => Intake::Decide,
            _ => Intake::Hold,
        },
        Role::ReceiveOnly => match order {
            Some(VvOrdering::Concurrent) => Intake::Take,
            _ => Intake::Decide,
        },
    }
}

/// Whether a folder of `role` sends one of its records; `made_here`: this device made it (its
/// journal names no peer it came from). A receive-only folder relays its peers' versions and
/// keeps its own changes.
pub fn sends(role: Role, made_here: bool) -> bool {
    !(role == Role::ReceiveOnly && made_here)
}

/// The version vector with which a send-only device's state at a path wins over `held`, the
/// peer's version held there, when `override` is asked: both merged, incremented by this
/// device (`local`) with floor `now_secs` (as any version made here). Every device that has
/// `held` (or anything `held` included) then takes this device's version as the newer one.
pub fn overriding(
    ours: Option<&VersionVector>,
    held: &VersionVector,
    local: ShortId,
    now_secs: u64,
) -> VersionVector {
    ours.map_or_else(|| held.clone(), |o| o.merge(held))
        .incremented(local, now_secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshfs_protocol::{FileKind, Hash, RelPath};

    fn rec(v: &[(u64, u64)]) -> FileRecord {
        FileRecord {
            path: RelPath::new("f").unwrap(),
            kind: FileKind::File,
            deleted: false,
            mode: 0o644,
            mtime_ns: 1,
            size: 0,
            hash: Hash::of(b""),
            chunks: Vec::new(),
            target: String::new(),
            version: VersionVector::from_pairs(v.iter().map(|&(d, c)| (ShortId(d), c))),
            modified_by: ShortId(v[0].0),
            sequence: 0,
        }
    }

    #[test]
    fn roles_round_trip_their_names() {
        for r in [Role::SendReceive, Role::SendOnly, Role::ReceiveOnly] {
            assert_eq!(Role::parse(r.as_str()), Some(r));
        }
        assert_eq!(Role::parse("receive"), None);
        assert_eq!(Role::default(), Role::SendReceive);
    }

    #[test]
    fn a_send_only_folder_holds_every_version_its_own_does_not_include() {
        let ours = rec(&[(1, 5)]);
        let newer = rec(&[(1, 5), (2, 1)]);
        let concurrent = rec(&[(2, 1)]);
        let older = rec(&[(1, 4)]);
        assert_eq!(intake(Role::SendOnly, Some(&ours), &newer), Intake::Hold);
        assert_eq!(
            intake(Role::SendOnly, Some(&ours), &concurrent),
            Intake::Hold
        );
        assert_eq!(intake(Role::SendOnly, None, &newer), Intake::Hold);
        assert_eq!(intake(Role::SendOnly, Some(&ours), &older), Intake::Decide);
        assert_eq!(intake(Role::SendOnly, Some(&ours), &ours), Intake::Decide);
    }

    #[test]
    fn a_receive_only_folder_takes_a_concurrent_version_and_decides_the_rest() {
        let shared = rec(&[(2, 3)]);
        let local_edit = rec(&[(2, 3), (1, 9)]);
        let theirs = rec(&[(2, 4)]);
        assert_eq!(
            intake(Role::ReceiveOnly, Some(&local_edit), &theirs),
            Intake::Take
        );
        assert_eq!(
            intake(Role::ReceiveOnly, Some(&shared), &theirs),
            Intake::Decide
        );
        assert_eq!(intake(Role::ReceiveOnly, None, &theirs), Intake::Decide);
        assert_eq!(
            intake(Role::ReceiveOnly, Some(&local_edit), &shared),
            Intake::Decide
        );
        assert!(!sends(Role::ReceiveOnly, true));
        assert!(sends(Role::ReceiveOnly, false));
        assert!(sends(Role::SendOnly, true) && sends(Role::SendReceive, true));
    }

    #[test]
    fn an_override_dominates_both_the_held_version_and_its_own() {
        let ours = rec(&[(1, 5)]).version;
        let held = rec(&[(2, 7), (3, 1)]).version;
        let v = overriding(Some(&ours), &held, ShortId(1), 100);
        assert_eq!(v.compare(&ours), VvOrdering::After);
        assert_eq!(v.compare(&held), VvOrdering::After);
        let v = overriding(None, &held, ShortId(1), 100);
        assert_eq!(v.compare(&held), VvOrdering::After);
    }
}
