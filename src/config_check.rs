//! `meshfs config check`: everything the daemon checks at start that can be checked without
//! starting it — the config's fields, the identity, the listen address, every folder path and
//! mount point — so an edit by hand is proven before the daemon (or systemd) trips on it.

use anyhow::{anyhow, bail};
use meshfs_daemon::config::{Config, Home};
use meshfs_daemon::identity::Identity;
use meshfs_daemon::mounts::{fuse_conf_allows_other, FUSE_CONF};

/// Runs the check; prints what was checked, or fails naming the file and field at fault.
pub fn run(home: &Home) -> anyhow::Result<u8> {
    let config = Config::load(home)?;
    let file = home.config_file();
    let identity = Identity::load(&home.identity_dir()).map_err(|e| {
        anyhow!(
            "{e}: the identity in {} is missing or damaged (run `meshfs init` on a new home)",
            home.identity_dir().display()
        )
    })?;
    let listen = config.listen_addr(home)?;
    for (i, f) in config.folders.iter().enumerate() {
        match std::fs::metadata(&f.path) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => bail!(
                "{}: field `folder[{i}].path`: {} is not a directory",
                file.display(),
                f.path.display()
            ),
            Err(e) => bail!(
                "{}: field `folder[{i}].path`: {}: {e} (recreate it, or `meshfs folder remove {}`)",
                file.display(),
                f.path.display(),
                f.id
            ),
        }
        if let Some(m) = &f.mount {
            if !m.is_dir() {
                bail!(
                    "{}: field `folder[{i}].mount`: {} is not an existing directory",
                    file.display(),
                    m.display()
                );
            }
        }
        // SAFETY: geteuid cannot fail and touches no memory.
        let root = unsafe { libc::geteuid() } == 0;
        if f.allow_other && !root {
            let conf = std::fs::read_to_string(FUSE_CONF).unwrap_or_default();
            if !fuse_conf_allows_other(&conf) {
                bail!(
                    "{}: field `folder[{i}].allow_other`: letting other users into the mount as an ordinary user needs the line `user_allow_other` in {}; add it there (as root), or remove allow_other",
                    file.display(),
                    FUSE_CONF
                );
            }
        }
    }
    println!(
        "{}: ok (device {:?} {}, listen {listen}, {} folder(s), {} peer(s))",
        file.display(),
        config.device.name,
        identity.device_id.short().display7(),
        config.folders.len(),
        config.peers.len()
    );
    Ok(0)
}
