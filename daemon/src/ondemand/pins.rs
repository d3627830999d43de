//! Pins (docs/decisions.md, D94): a path kept local, recorded in the journal, and what is not
//! local below it fetched now. The decide step and eviction read the pins from the folder's
//! demand, which follows the journal here. What lies outside a folder's subtrees on demand
//! (D77) is kept the same way: its placeholders are fetched here too ([`make_whole`],
//! [`keep_outside`]).

use super::{errno_name, make_local, Peers};
use crate::folder::{FolderError, FolderRt, Folders};
use meshfs_protocol::RelPath;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// Why a pin or an unpin was refused.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// Nothing is journaled at or below the path.
    #[error("{0}: no such file or directory in the folder")]
    NothingThere(RelPath),
    /// The journal or the folder failed.
    #[error(transparent)]
    Folder(#[from] FolderError),
}

impl From<crate::journal::JournalError> for PinError {
    fn from(e: crate::journal::JournalError) -> Self {
        PinError::Folder(e.into())
    }
}

/// What `meshfs pin` did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PinReport {
    /// The pinned path.
    pub path: String,
    /// Files below it fetched now.
    pub fetched: usize,
    /// Files below it that could not be fetched (they are fetched at their next open, or by
    /// `meshfs pin` again), and why.
    pub failed: Vec<PinFailure>,
}

/// A file a pin could not fetch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PinFailure {
    /// The path.
    pub path: String,
    /// Why, in words.
    pub error: String,
    /// The errno an open of it fails with now, by name.
    pub errno: &'static str,
}

/// Pins `path` of `rt` and fetches what is not local at or below it, one file after another.
pub async fn pin(
    folders: &Arc<Folders>,
    rt: &Arc<FolderRt>,
    peers: &Peers,
    path: RelPath,
) -> Result<PinReport, PinError> {
    if !rt.policy().on_demand {
        return Err(FolderError::NotOnDemand(rt.id.clone()).into());
    }
    let (f, r, p) = (folders.clone(), rt.clone(), path.clone());
    let online = tokio::task::spawn_blocking(move || -> Result<Vec<RelPath>, PinError> {
        {
            let reader = f.reader()?;
            let here = reader.get(&r.id, &p)?.is_some_and(|s| !s.record.deleted)
                || reader.has_live_below(&r.id, &p)?;
            if !here {
                return Err(PinError::NothingThere(p));
            }
        }
        let mut j = f.journal()?;
        j.pin(&r.id, &p)?;
        r.demand.set_pins(j.pins(&r.id)?);
        drop(j);
        Ok(f.reader()?.online(&r.id, Some(&p))?)
    })
    .await
    .map_err(|e| FolderError::Task(e.to_string()))??;
    let (fetched, failed) = fetch_all(folders, rt, peers, online).await;
    Ok(PinReport {
        path: path.as_str().to_string(),
        fetched,
        failed,
    })
}

/// Makes `files` (placeholders) local, one after another: how many were, and those that could
/// not be.
pub async fn fetch_all(
    folders: &Arc<Folders>,
    rt: &Arc<FolderRt>,
    peers: &Peers,
    files: Vec<RelPath>,
) -> (usize, Vec<PinFailure>) {
    let mut fetched = 0;
    let mut failed = Vec::new();
    for file in files {
        match make_local(folders, rt, peers, &file, 0).await {
            Ok(()) => fetched += 1,
            Err(f) => failed.push(PinFailure {
                path: file.as_str().to_string(),
                error: f.why,
                errno: errno_name(f.errno),
            }),
        }
    }
    (fetched, failed)
}

/// A folder that stopped being on demand, or whose subtrees on demand shrank (D77): every
/// placeholder that is to be local now (all of them, or those outside the subtrees) is
/// fetched, in the background. What cannot be is tried again after 1, 2, 4 … 32 s (turning
/// on demand off closes the links that share the folder, so that their next hello says it,
/// D99: the first try may find no peer), then fetched when opened, as with a pin.
pub async fn make_whole(folders: Arc<Folders>, rt: Arc<FolderRt>, peers: Peers) {
    let mut wait = Duration::from_secs(1);
    loop {
        let whole = !rt.policy().on_demand;
        if !whole && rt.demand.under().is_empty() {
            // The whole folder is on demand (again): nothing is to be fetched.
            return;
        }
        let (f, r) = (folders.clone(), rt.clone());
        let online = tokio::task::spawn_blocking(move || {
            f.reader().and_then(|j| Ok(j.online(&r.id, None)?))
        })
        .await;
        let Ok(Ok(mut online)) = online else {
            return;
        };
        if !whole {
            online.retain(|p| rt.demand.outside(p));
        }
        if online.is_empty() {
            return;
        }
        let why = if whole {
            "no longer on demand"
        } else {
            "outside the on-demand subtrees"
        };
        tracing::info!(folder = %rt.id, files = online.len(), "{why}: fetching what is not here");
        let (fetched, failed) = fetch_all(&folders, &rt, &peers, online).await;
        tracing::info!(folder = %rt.id, fetched, failed = failed.len(), "{why}: fetched");
        if failed.is_empty() || wait > Duration::from_secs(32) {
            return;
        }
        tokio::time::sleep(wait).await;
        wait *= 2;
    }
}

/// How often [`keep_outside`] looks for placeholders outside the subtrees on demand before a
/// pass found a connected peer, and after.
const OUTSIDE_SOON: Duration = Duration::from_secs(2);
const OUTSIDE_TICK: Duration = super::budget::BUDGET_TICK;

/// While `folder` runs with subtrees on demand (D77): what lies outside them and is still a
/// placeholder (the subtrees changed while the daemon was stopped, or its fetch failed) is
/// fetched once a peer that shares the folder is connected, and again every
/// [`OUTSIDE_TICK`]. Ends when the folder stops.
pub async fn keep_outside(
    folders: std::sync::Weak<Folders>,
    folder: meshfs_protocol::FolderId,
    peers: Peers,
) {
    let mut wait = OUTSIDE_SOON;
    loop {
        tokio::time::sleep(wait).await;
        let Some(f) = folders.upgrade() else {
            return;
        };
        let Some(rt) = f.get(&folder) else {
            return;
        };
        if !rt.policy().on_demand || rt.demand.under().is_empty() {
            wait = OUTSIDE_TICK;
            continue;
        }
        if peers(&folder).is_empty() {
            wait = OUTSIDE_SOON;
            continue;
        }
        make_whole(f, rt, peers.clone()).await;
        wait = OUTSIDE_TICK;
    }
}

/// Drops the pin of `path` (its files stay local until the budget needs the room); whether
/// there was one.
pub fn unpin(folders: &Folders, rt: &FolderRt, path: &RelPath) -> Result<bool, PinError> {
    let mut j = folders.journal()?;
    let was = j.unpin(&rt.id, path)?;
    rt.demand.set_pins(j.pins(&rt.id)?);
    drop(j);
    if was {
        // What it kept may be over the budget now.
        rt.demand.arrived.notify_one();
    }
    Ok(was)
}
