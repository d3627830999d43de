//! `meshfs config check`: everything the daemon checks at start that can be checked without
//! starting it — the config's fields, the identity, the listen address, every folder path and
//! mount point — so an edit by hand is proven before the daemon (or systemd) trips on it.

use anyhow::{anyhow, bail};
use meshfs_daemon::config::{Config, Home};
use meshfs_daemon::identity::Identity;

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
