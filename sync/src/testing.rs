//! What the core's unit tests share: a replica held as a map, which cannot fail to read.

use crate::reconcile::{ReadError, ReplicaView};
use meshfs_protocol::{FileRecord, RelPath};
use std::collections::BTreeMap;

/// A replica's current records, by path.
#[derive(Default, Clone)]
pub(crate) struct MapView(pub(crate) BTreeMap<RelPath, FileRecord>);

impl MapView {
    /// A replica holding exactly `records`.
    pub(crate) fn with(records: &[&FileRecord]) -> MapView {
        MapView(
            records
                .iter()
                .map(|r| (r.path.clone(), (*r).clone()))
                .collect(),
        )
    }
}

impl ReplicaView for MapView {
    fn get(&self, path: &RelPath) -> Result<Option<FileRecord>, ReadError> {
        Ok(self.0.get(path).cloned())
    }
    fn has_live_below(&self, dir: &RelPath) -> Result<bool, ReadError> {
        Ok(self
            .0
            .values()
            .any(|r| !r.deleted && r.path != *dir && r.path.is_within(dir)))
    }
}
