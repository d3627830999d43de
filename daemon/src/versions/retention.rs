//! Carrying out the retention policy ([`super::policy`]) on a folder: the versions it retires
//! leave the journal (each one a `pruned` row, shown by `meshfs journal --all`), then the vault
//! drops every chunk no remaining version (nor, in a folder no peer shares, a recent file held
//! ahead: D68) names; and the history is thinned the same way and compacted past its window
//! (docs/decisions.md, D64, D67), so the journal stays bounded under an editing run that never
//! stops.
//!
//! The order is what makes a crash harmless: the journal's rows go first (one transaction),
//! then the vault's chunks (one transaction). Killed in between, the vault holds chunks no
//! version names, which the next run drops; it never lacks a chunk a remaining version needs,
//! because the chunks kept are computed from the journal after its rows went, under the
//! vault's gate, which the keeper also holds while it adds chunks ([`crate::vault::Vault::gate`]).

use super::policy::{self, Candidate, Policy, DAY_NS, HOUR_NS};
use crate::folder::{FolderError, FolderPolicy, FolderRt, Folders};
use crate::journal::Retired;
use serde::Serialize;
use std::collections::{HashMap, HashSet};

/// How many days each change stays in the history: `history_retention_days` if set, else as
/// long as past versions are kept (`versions_days`; where keeping is off, its default).
pub fn history_days(p: &FolderPolicy) -> i64 {
    let days = match (p.history_days, p.versions_days) {
        (0, 0) => crate::config::VERSIONS_DAYS,
        (0, v) => v,
        (h, _) => h,
    };
    days.clamp(1, 100_000) as i64
}

/// History rows compacted per transaction at most.
const PRUNE_BATCH: usize = 5_000;

/// What one retention run did to a folder.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Pruned {
    /// Versions retired (journal rows).
    pub versions: u64,
    /// Chunks dropped from the vault, and their bytes as stored.
    pub chunks: u64,
    /// Bytes dropped from the vault.
    pub bytes: u64,
    /// History rows thinned, and pruning rows forgotten.
    pub history: u64,
}

/// Applies `rt`'s retention at `now_ns`: retires versions, sweeps the vault, thins the history.
/// `room`: the free space of the vault's filesystem (the budget is its share of that plus what
/// the vault takes).
pub fn run(
    folders: &Folders,
    rt: &FolderRt,
    now_ns: i64,
    room: Option<u64>,
) -> Result<Pruned, FolderError> {
    let folder = &rt.id;
    let mut out = Pruned::default();
    let p = rt.policy();
    let vault = rt.vault().cloned();
    let stored_bytes = vault.as_ref().map_or(0, |v| v.stored_bytes());
    let policy = Policy::new(
        p.versions_days,
        p.versions_space_percent,
        room.unwrap_or(u64::MAX / 200).saturating_add(stored_bytes),
        p.versions_max_mib.map(|m| m.saturating_mul(1 << 20)),
    );
    if let Some(v) = &vault {
        v.set_budget(policy.budget_bytes);
    }
    {
        let _gate = vault.as_ref().map(|v| v.gate());
        let versions = folders.journal()?.all_versions(folder)?;
        // A folder no peer shares holds its own files changed within the age limit (D68).
        let own = match policy.max_age_ns {
            Some(age) if p.alone => folders
                .journal()?
                .own_files_since(folder, now_ns.saturating_sub(age))?,
            _ => Vec::new(),
        };
        let stored: HashMap<_, _> = match &vault {
            Some(v) => v.chunk_sizes().unwrap_or_default().into_iter().collect(),
            None => HashMap::new(),
        };
        let mut candidates: Vec<Candidate<'_>> = versions
            .iter()
            .map(|v| Candidate {
                id: v.id,
                path: &v.record.path,
                left_ns: v.left_ns,
                chunks: v.record.chunks.iter().map(|c| c.hash).collect(),
                live: false,
            })
            .chain(own.iter().map(|(id, changed, record)| Candidate {
                // Below every versions row's id: the two never meet.
                id: -1 - id,
                path: &record.path,
                left_ns: *changed,
                chunks: record.chunks.iter().map(|c| c.hash).collect(),
                live: true,
            }))
            .collect();
        candidates.sort_by_key(|c| c.left_ns);
        let gone_all = policy::retire(&policy, &candidates, &stored, now_ns);
        let retired: Vec<Retired> = gone_all
            .iter()
            .filter(|(id, _)| *id > 0)
            .map(|&(id, reason)| Retired { id, reason })
            .collect();
        if !retired.is_empty() {
            out.versions = folders
                .journal()?
                .retire_versions(folder, &retired, now_ns)?;
            crate::failpoint::hit("prune.retired", "");
        }
        let gone: HashSet<i64> = gone_all.iter().map(|g| g.0).collect();
        let keep = policy::needed(&candidates, &gone);
        if let Some(v) = &vault {
            match v.sweep(|h| keep.contains(h)) {
                Ok((chunks, bytes)) => {
                    out.chunks = chunks;
                    out.bytes = bytes;
                }
                Err(e) => {
                    tracing::warn!(%folder, error = %e, "cannot drop pruned chunks from the vault; tried again at the next run")
                }
            }
        }
    }
    // The history: whole for an hour, then one modification per path and hour for a day,
    // then one per day; past its window (`history_retention_days`, else as long as versions
    // are kept), only each path's newest row.
    let mut j = folders.journal()?;
    out.history += j.thin_history(folder, now_ns - DAY_NS, now_ns - HOUR_NS, HOUR_NS)?;
    out.history += j.thin_history(folder, 0, now_ns - DAY_NS, DAY_NS)?;
    drop(j);
    // In batches, the journal let go between them: applies and captures go on meanwhile.
    loop {
        let n = folders.journal()?.prune_history(
            folder,
            now_ns - history_days(&p) * DAY_NS,
            PRUNE_BATCH,
        )?;
        out.history += n;
        if n < PRUNE_BATCH as u64 {
            break;
        }
    }
    // Prunings are shown as long as what they retired would have been kept, a day at least.
    let days = p.versions_days.clamp(1, 100_000) as i64;
    out.history += folders
        .journal()?
        .forget_pruned(folder, now_ns - days * DAY_NS)?;
    if out != Pruned::default() {
        tracing::info!(%folder, versions = out.versions, chunks = out.chunks, bytes = out.bytes, history = out.history, "retention pruned");
    }
    Ok(out)
}
