//! The address each peer was last reached at, kept across restarts in
//! `STATE_DIR/addresses.json`, so that after a restart (or a resume) a device dials first where
//! its peers were, before any announcement is heard.
//!
//! **What it owns.** The file: read once at start, written (temp file, fsync, rename) whenever a
//! peer's remembered address changes. A file that cannot be read is logged and taken as empty:
//! it is only a head start, never a source of truth (the handshake proves who answers).

use meshfs_protocol::DeviceId;
use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The file under `state_dir`.
pub fn file(state_dir: &Path) -> PathBuf {
    state_dir.join("addresses.json")
}

/// What the file holds (an empty list when it is missing or unreadable).
pub fn load(path: &Path) -> Vec<(DeviceId, SocketAddr)> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the remembered peer addresses; starting without them");
            return Vec::new();
        }
    };
    let map: BTreeMap<String, String> = match serde_json::from_str(&text) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "the remembered peer addresses are not valid; starting without them");
            return Vec::new();
        }
    };
    map.into_iter()
        .filter_map(|(id, addr)| Some((id.parse().ok()?, addr.parse().ok()?)))
        .collect()
}

/// Writes `entries` atomically.
pub fn save(path: &Path, entries: &[(DeviceId, SocketAddr)]) -> std::io::Result<()> {
    let map: BTreeMap<String, String> = entries
        .iter()
        .map(|(d, a)| (d.to_string(), a.to_string()))
        .collect();
    let text = serde_json::to_string_pretty(&map).map_err(std::io::Error::other)?;
    let tmp = path.with_extension("json.tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_read_back_as_written_and_a_damaged_file_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = file(dir.path());
        assert!(load(&path).is_empty());
        let entries = vec![
            (
                DeviceId::from_bytes([1; 32]),
                "10.0.0.1:7788".parse().unwrap(),
            ),
            (
                DeviceId::from_bytes([2; 32]),
                "[fd00::2]:7788".parse().unwrap(),
            ),
        ];
        save(&path, &entries).unwrap();
        assert_eq!(load(&path), entries);
        std::fs::write(&path, "{not json").unwrap();
        assert!(load(&path).is_empty());
    }
}
