//! Past versions: what leaves this device's tree is kept, listed and brought back.
//!
//! - [`keeper`]: the content of a version an apply replaces or deletes, read from the old file
//!   (the store hands it over as it keeps it aside) into the folder's vault, only the chunks
//!   nothing else holds; and, in a folder no peer shares, this device's own new versions held
//!   ahead (D68);
//! - [`content`]: a past version's chunks, from the vault, the live tree or a connected peer
//!   (which serves them from its own vault: `crate::chunks`);
//! - [`restore`]: `meshfs restore`, through the store's safe path and the capture path;
//! - [`policy`] and [`retention`]: what is kept how long, in how much space, and the pruning;
//! - [`listing`]: what `meshfs versions` and the marks of `meshfs journal` show;
//! - [`snapshot`]: the folder as it was at a time, for `meshfs mount --at`.
//!
//! The journal records every version that leaves the tree (`versions` rows, written by the
//! commit that replaced it); the vault holds content. Which of a version's chunks are here is
//! never stored, only looked up: a version is restorable here when every chunk is in the
//! vault or in a live file.
//!
//! **What it never does:** write into a replica except through the store's safe path, or send
//! anything of the vault but chunks a peer asks for by hash.

pub mod content;
pub mod keeper;
pub mod listing;
pub mod policy;
pub mod restore;
pub mod retention;
pub mod snapshot;

use crate::folder::{FolderPolicy, FolderRt, Folders};
use crate::vault::Vault;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How often retention runs on every folder (and once at start).
pub const RETENTION_EVERY: Duration = Duration::from_secs(300);

/// Woken when the keeper has added to a vault: retention runs soon, so a budget holds within
/// seconds, not at the next round.
static PRUNE_SOON: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Gives a starting folder its policy, its vault (`vault_path`) and the keeper of what its
/// applies displace. Without a vault (it cannot be opened) the folder syncs and keeps no
/// versions, and says so in the log.
pub fn start_folder(
    folders: &Arc<Folders>,
    rt: &Arc<FolderRt>,
    policy: FolderPolicy,
    vault_path: &Path,
) {
    rt.set_policy(policy);
    let vault = match Vault::open(vault_path) {
        Ok(v) => Arc::new(v),
        Err(e) => {
            tracing::error!(folder = %rt.id, error = %e, "cannot open the folder's version vault; past versions are not kept");
            return;
        }
    };
    rt.set_vault(vault.clone());
    let (on, ahead) = (Arc::downgrade(rt), Arc::downgrade(rt));
    let switches = keeper::Switches {
        on: Box::new(move || on.upgrade().is_some_and(|rt| rt.policy().versions_days > 0)),
        ahead: Box::new(move || ahead.upgrade().is_some_and(|rt| rt.policy().alone)),
    };
    let (displaced, local) = keeper::start(folders.clone(), rt.id.clone(), vault, switches, |_| {
        PRUNE_SOON.notify_one()
    });
    rt.store.on_displaced(displaced);
    rt.on_local(local);
}

/// Runs every folder's retention at start, every [`RETENTION_EVERY`], and a second after the
/// keeper added to a vault, until `stopping`.
pub async fn retention_loop(
    folders: Arc<Folders>,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        for rt in folders.all() {
            let f = folders.clone();
            let now_ns = crate::clock::now_ns();
            let room = rt
                .vault()
                .and_then(|v| v.path().parent().and_then(crate::store::free_bytes));
            let ran =
                tokio::task::spawn_blocking(move || retention::run(&f, &rt, now_ns, room)).await;
            if let Ok(Err(e)) = ran {
                tracing::warn!(error = %e, "version retention failed; tried again at the next round");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(crate::clock::real(RETENTION_EVERY)) => {}
            _ = PRUNE_SOON.notified() => {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            _ = stopping.changed() => return,
        }
    }
}

/// Most paths a folder's `not_applied` or `not_sent` lists in `status`.
const STATUS_ITEMS: usize = 200;

/// A folder's role and past versions for `status`: counts read from the journal (held by the
/// caller), the vault's size from its running count.
pub fn status_of(j: &crate::journal::Journal, rt: &FolderRt) -> crate::status::VersionsStatus {
    use crate::status::PathList;
    use meshfs_sync::role::Role;
    let p = rt.policy();
    let mut out = crate::status::VersionsStatus {
        role: p.role.as_str(),
        count: j.version_count(&rt.id).unwrap_or(0),
        bytes: rt.vault().map_or(0, |v| v.stored_bytes()),
        max_age_days: p.versions_days,
        ..Default::default()
    };
    match p.role {
        Role::SendOnly => {
            let held = j.held(&rt.id).unwrap_or_default();
            out.not_applied = PathList {
                count: held.len() as u64,
                items: held
                    .iter()
                    .take(STATUS_ITEMS)
                    .map(|(r, _)| r.path.to_string())
                    .collect(),
            };
        }
        Role::ReceiveOnly => {
            let local = j.local_only(&rt.id).unwrap_or_default();
            out.not_sent = PathList {
                count: local.len() as u64,
                items: local
                    .iter()
                    .take(STATUS_ITEMS)
                    .map(|(p, _)| p.to_string())
                    .collect(),
            };
        }
        Role::SendReceive => {}
    }
    out
}
