//! The user's configuration (`config.toml`) and where meshfs keeps its files.
//!
//! `--home DIR` / `MESHFS_HOME` puts everything under one directory (config, identity, journal,
//! control socket), so tests and several daemons can share a machine; without it meshfs uses
//! the XDG config and data directories. The config is validated when loaded, and errors name
//! the field. Writes are atomic (temp file + rename), so a crash never leaves half a config.

use meshfs_protocol::{DeviceId, FolderId};
use meshfs_sync::role::Role;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Default QUIC listen address: every address, IPv4 and IPv6 (one dual-stack socket).
pub const DEFAULT_LISTEN: &str = "[::]:7788";

/// The word in a peer's `addresses` for "wherever it is found": on the LAN, from its own
/// connections, from other peers.
pub const DYNAMIC: &str = "dynamic";

/// Where this device's files live.
#[derive(Clone, Debug)]
pub struct Home {
    /// `config.toml`'s directory.
    pub config_dir: PathBuf,
    /// Identity, journal and control socket.
    pub state_dir: PathBuf,
}

impl Home {
    /// `--home DIR` if given (or `MESHFS_HOME`), else the XDG directories.
    pub fn resolve(home: Option<&Path>) -> Home {
        if let Some(h) = home {
            return Home {
                config_dir: h.to_path_buf(),
                state_dir: h.join("state"),
            };
        }
        let user_home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/root"));
        let config = std::env::var_os("XDG_CONFIG_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| user_home.join(".config"));
        let data = std::env::var_os("XDG_DATA_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| user_home.join(".local/share"));
        Home {
            config_dir: config.join("meshfs"),
            state_dir: data.join("meshfs"),
        }
    }

    /// The config file.
    pub fn config_file(&self) -> PathBuf {
        self.config_dir.join("config.toml")
    }

    /// The directory of the local ignore files (`ignore/FOLDER-ID`, rules no peer can change).
    pub fn local_ignore_dir(&self) -> PathBuf {
        self.config_dir.join("ignore")
    }

    /// The journal database.
    pub fn journal_file(&self) -> PathBuf {
        self.state_dir.join("journal.db")
    }

    /// The directory holding `cert.der` and `key.der`.
    pub fn identity_dir(&self) -> PathBuf {
        self.state_dir.clone()
    }

    /// The vault of `folder`: the chunks of its past versions ([`crate::vault`]).
    pub fn vault_file(&self, folder: &meshfs_protocol::FolderId) -> PathBuf {
        self.state_dir
            .join("versions")
            .join(format!("{}.db", folder.as_str()))
    }

    /// Where the store assembles `folder`'s incoming files (see [`crate::store::Store`]).
    pub fn staging_dir(&self, folder: &meshfs_protocol::FolderId) -> PathBuf {
        self.state_dir.join("staging").join(folder.as_str())
    }

    /// The daemon's control socket.
    pub fn control_socket(&self) -> PathBuf {
        self.state_dir.join("control.sock")
    }

    /// The page's token while the daemon serves it (`meshfs ui`; mode 0600 in the 0700 state
    /// directory, so only the owner reads it).
    pub fn ui_token_file(&self) -> PathBuf {
        self.state_dir.join("ui-token")
    }

    /// meshfs's own directory that `path` is, contains or lies inside, if any: a folder
    /// there would replicate the private key and journal the journal's own writes.
    /// Compares real paths (symlinks resolved as far as the paths exist).
    pub fn overlap(&self, path: &Path) -> Option<PathBuf> {
        let path = real_path(path);
        [&self.config_dir, &self.state_dir]
            .into_iter()
            .map(|d| real_path(d))
            .find(|d| path.starts_with(d) || d.starts_with(&path))
    }
}

/// `path` made absolute with symlinks resolved for the part that exists; the rest (which
/// cannot hold a symlink) is normalised lexically. Creates nothing.
pub fn real_path(path: &Path) -> PathBuf {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut existing = abs.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(real) = existing.canonicalize() {
            let mut out = real;
            for c in rest.iter().rev() {
                match c {
                    std::path::Component::ParentDir => {
                        out.pop();
                    }
                    std::path::Component::Normal(n) => out.push(n),
                    _ => {}
                }
            }
            return out;
        }
        match (existing.parent(), existing.components().next_back()) {
            (Some(parent), Some(last)) => {
                rest.push(last);
                existing = parent;
            }
            _ => return abs,
        }
    }
}

/// Makes `dir` (and its missing parents) and gives it mode 0700, whatever it had: meshfs's
/// config and local ignore rules are the owner's alone.
pub fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// The umask a folder applies to remote versions unless its config says otherwise: no
/// group or world write.
pub const DEFAULT_UMASK: u32 = 0o022;

/// Why a config could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// No config file: `meshfs init` has not run for this home.
    #[error("no meshfs config at {0}: run `meshfs init` first (or pass the right --home)")]
    Missing(PathBuf),
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// Which file.
        path: PathBuf,
        /// What happened.
        source: std::io::Error,
    },
    /// The file is not valid TOML for a meshfs config (this includes a malformed folder or
    /// device id).
    #[error("{path}: {source}")]
    Parse {
        /// Which file.
        path: PathBuf,
        /// The parser's explanation, with the line and the value at fault.
        source: toml::de::Error,
    },
    /// The config could not be written as TOML.
    #[error("cannot write the config {path}: {source}")]
    Encode {
        /// Which file.
        path: PathBuf,
        /// What the encoder refused.
        source: toml::ser::Error,
    },
    /// `device.listen` is not an address this device can listen on.
    #[error("{path}: field `device.listen`: {source}")]
    Listen {
        /// Which file.
        path: PathBuf,
        /// What is wrong with the address.
        source: ListenError,
    },
    /// A field has a value meshfs cannot use.
    #[error("{path}: field `{field}`: {message}")]
    Invalid {
        /// Which file.
        path: PathBuf,
        /// The field, e.g. `peer[1].id`.
        field: String,
        /// What is wrong and what to do.
        message: String,
    },
}

/// The whole config file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// This device.
    pub device: DeviceConfig,
    /// Tuning knobs (all optional).
    #[serde(default)]
    pub options: Options,
    /// How this device finds its peers and is found.
    #[serde(default)]
    pub discovery: DiscoveryConfig,
    /// The page (`meshfs ui`); left out of the file while it is the default.
    #[serde(default, skip_serializing_if = "UiConfig::is_default")]
    pub ui: UiConfig,
    /// Replicated folders. Never written as an empty `folder = []`: a `[[folder]]` table
    /// appended by hand after it would be a duplicate key.
    #[serde(default, rename = "folder", skip_serializing_if = "Vec::is_empty")]
    pub folders: Vec<FolderConfig>,
    /// Known peers (the only devices this one talks to).
    #[serde(default, rename = "peer", skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<PeerConfig>,
}

/// `[device]`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    /// Human name of this device.
    pub name: String,
    /// UDP address the QUIC endpoint listens on: `IP:PORT` or `HOST:PORT` (resolved at
    /// start, see [`Config::listen_addr`]).
    pub listen: String,
}

/// `[options]`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Options {
    /// How long changes to one path are coalesced before they are journaled, in ms.
    pub coalesce_ms: u64,
    /// How long each change stays in the history, in days; after that only each path's
    /// latest. 0: as long as each folder keeps past versions (`versions_days`).
    pub history_retention_days: u64,
    /// How long tombstones are kept, in days: a peer offline longer than this may bring a
    /// deleted file back (it is never lost). 0: forever.
    pub tombstone_retention_days: u64,
    /// Seconds between dial attempts to a disconnected peer, at most.
    pub max_redial_secs: u64,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            coalesce_ms: 5,
            history_retention_days: 0,
            tombstone_retention_days: 365,
            max_redial_secs: 1,
        }
    }
}

/// `[discovery]`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// Local discovery: announce this device on every local network and listen for others'
    /// announcements (on by default; off for a locked-down server: nothing is broadcast and
    /// nothing is listened for).
    pub local: bool,
    /// The UDP port announcements are sent to and listened for on.
    pub port: u16,
}

impl Default for DiscoveryConfig {
    fn default() -> DiscoveryConfig {
        DiscoveryConfig {
            local: true,
            port: meshfs_protocol::DISCOVERY_PORT,
        }
    }
}

/// `[ui]`: the page the daemon serves on `127.0.0.1` (see `docs/ui.md`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct UiConfig {
    /// Serve the page from the start; without it only `meshfs ui` starts serving.
    pub enabled: bool,
    /// The TCP port on `127.0.0.1`; 0: a free port chosen at each start.
    pub port: u16,
}

impl UiConfig {
    fn is_default(&self) -> bool {
        self == &UiConfig::default()
    }
}

/// One `[[folder]]`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FolderConfig {
    /// The folder id shared with peers (a malformed one is refused when the file is read).
    pub id: FolderId,
    /// The replica directory.
    pub path: PathBuf,
    /// Watch the directory with inotify (on by default). The mount reports its own changes;
    /// the watcher is the net for writes that bypass it. Turning it off is meant for proving
    /// that capture through the mount needs no watcher.
    #[serde(default = "yes")]
    pub watch: bool,
    /// Mount the folder here when the daemon starts (`meshfs mount` does it at runtime).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount: Option<PathBuf>,
    /// Permission bits a peer's version never gets here (`umask = 0o027`); unset: no group or
    /// world write ([`DEFAULT_UMASK`]). Group and world bits only: the owner
    /// keeps what meshfs needs to read and apply (`Store::local_mode`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub umask: Option<u32>,
    /// Let other users into that mount (`allow_other`, the kernel checking modes). For a
    /// daemon run as an ordinary user, `/etc/fuse.conf` must say `user_allow_other`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub allow_other: bool,
    /// What this device does with the folder's changes: `send-receive` (the default),
    /// `send-only` or `receive-only` ([`meshfs_sync::role`]).
    #[serde(default, with = "role_text", skip_serializing_if = "is_send_receive")]
    pub role: Role,
    /// How long the content of past versions is kept, in days; 0: none is kept (off).
    #[serde(default = "versions_days", skip_serializing_if = "is_versions_days")]
    pub versions_days: u64,
    /// The most the kept versions may take, as a percentage of the free space of the state
    /// directory's filesystem (what they take counted as free); the oldest go first.
    #[serde(
        default = "versions_space_percent",
        skip_serializing_if = "is_versions_space_percent"
    )]
    pub versions_space_percent: u8,
    /// And at most this many MiB, if set (the smaller of the two limits holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub versions_max_mib: Option<u64>,
    /// Files on demand (docs/decisions.md, D90–D94): a peer's new files are journaled and shown
    /// in the mount without their content, which is fetched when a file is opened.
    #[serde(default, skip_serializing_if = "is_false")]
    pub on_demand: bool,
    /// The most bytes of file content an on-demand folder keeps here; the least recently used
    /// files are evicted beyond it (never a pinned, open or last copy). Unset: no budget.
    #[serde(default, with = "worded", skip_serializing_if = "Option::is_none")]
    pub cache_max: Option<u64>,
    /// How much of the disk holding an on-demand folder is kept free by evicting its least
    /// recently used files (docs/decisions.md, D97): a share (`"5%"`) or a size (`"2GiB"`).
    /// Unset: [`DEFAULT_MIN_FREE`].
    #[serde(default, with = "worded", skip_serializing_if = "Option::is_none")]
    pub min_free: Option<FreeFloor>,
    /// With `on_demand`: only these subtrees (paths relative to the folder) are on demand;
    /// everything outside them is kept here as a pinned path is (docs/decisions.md, D77).
    /// Empty: the whole folder.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on_demand_under: Vec<String>,
}

/// How much of a disk is kept free (an on-demand folder's `min_free`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeFloor {
    /// This share of the filesystem's size, in percent (0–90).
    Percent(u8),
    /// These many bytes.
    Bytes(u64),
}

/// The free floor of an on-demand folder that sets none: 5 % of its disk.
pub const DEFAULT_MIN_FREE: FreeFloor = FreeFloor::Percent(5);

impl FreeFloor {
    /// `N%` (0 to 90) or a size (`2GiB`, bytes; `0`: no floor).
    pub fn parse(text: &str) -> Result<FreeFloor, String> {
        let t = text.trim();
        if let Some(n) = t.strip_suffix('%') {
            return match n.trim().parse::<u8>() {
                Ok(p) if p <= 90 => Ok(FreeFloor::Percent(p)),
                _ => Err(format!(
                    "{text:?}: a share of the disk from 0% to 90%, or a size (2GiB)"
                )),
            };
        }
        parse_size(t).map(FreeFloor::Bytes)
    }

    /// As the user writes it.
    pub fn text(&self) -> String {
        match self {
            FreeFloor::Percent(p) => format!("{p}%"),
            FreeFloor::Bytes(b) => format_size(*b),
        }
    }

    /// The bytes to keep free on a filesystem of `total` bytes.
    pub fn bytes(&self, total: u64) -> u64 {
        match self {
            FreeFloor::Percent(p) => total / 100 * u64::from(*p),
            FreeFloor::Bytes(b) => *b,
        }
    }
}

/// A config value written as bytes (`65536`) or in words (`64MiB`, `5%`): the cache budget
/// (a size) and the free floor.
trait Worded: Sized {
    fn from_bytes(b: u64) -> Self;
    fn parse_words(text: &str) -> Result<Self, String>;
    fn words(&self) -> String;
}

impl Worded for u64 {
    fn from_bytes(b: u64) -> Self {
        b
    }
    fn parse_words(text: &str) -> Result<Self, String> {
        parse_size(text)
    }
    fn words(&self) -> String {
        format_size(*self)
    }
}

impl Worded for FreeFloor {
    fn from_bytes(b: u64) -> Self {
        FreeFloor::Bytes(b)
    }
    fn parse_words(text: &str) -> Result<Self, String> {
        FreeFloor::parse(text)
    }
    fn words(&self) -> String {
        self.text()
    }
}

/// Serde for an optional [`Worded`] value: written in words, read from either.
mod worded {
    use super::Worded;
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub fn serialize<T: Worded, S: Serializer>(v: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.serialize_str(&v.words()),
            None => s.serialize_none(),
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Text {
        Bytes(u64),
        Words(String),
    }

    pub fn deserialize<'de, T: Worded, D: Deserializer<'de>>(d: D) -> Result<Option<T>, D::Error> {
        match Text::deserialize(d)? {
            Text::Bytes(b) => Ok(Some(T::from_bytes(b))),
            Text::Words(w) => T::parse_words(&w).map(Some).map_err(D::Error::custom),
        }
    }
}

/// A size as the user writes it: bytes (`65536`), or a number with a unit of 1024s (`64KiB`,
/// `512MiB`, `2GiB`, `1TiB`; `K`, `M`, `G`, `T` and `KB`… mean the same).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let shift = match unit.as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(format!(
                "{text:?} is not a size: use bytes or a number with KiB, MiB, GiB or TiB"
            ))
        }
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a size: no number before the unit"))?;
    let bytes = n * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("{text:?} is not a size this device can count"));
    }
    Ok(bytes as u64)
}

/// A size written back: in the largest unit that shows it whole.
pub fn format_size(bytes: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// Days past versions are kept unless a folder says otherwise.
pub const VERSIONS_DAYS: u64 = 30;
/// The share of free space past versions may take unless a folder says otherwise, in percent.
pub const VERSIONS_SPACE_PERCENT: u8 = 10;

fn versions_days() -> u64 {
    VERSIONS_DAYS
}

fn is_versions_days(d: &u64) -> bool {
    *d == VERSIONS_DAYS
}

fn versions_space_percent() -> u8 {
    VERSIONS_SPACE_PERCENT
}

fn is_versions_space_percent(p: &u8) -> bool {
    *p == VERSIONS_SPACE_PERCENT
}

fn is_send_receive(r: &Role) -> bool {
    *r == Role::SendReceive
}

impl FolderConfig {
    /// Folder `id` at `path`, with every option at its default.
    pub fn new(id: FolderId, path: PathBuf) -> FolderConfig {
        FolderConfig {
            id,
            path,
            watch: true,
            mount: None,
            umask: None,
            allow_other: false,
            role: Role::SendReceive,
            versions_days: VERSIONS_DAYS,
            versions_space_percent: VERSIONS_SPACE_PERCENT,
            versions_max_mib: None,
            on_demand: false,
            cache_max: None,
            min_free: None,
            on_demand_under: Vec::new(),
        }
    }

    /// The subtrees on demand (`on_demand_under`), checked; those that do not parse are left
    /// out (`Config::validate` refuses them).
    pub fn on_demand_subtrees(&self) -> Vec<meshfs_protocol::RelPath> {
        self.on_demand_under
            .iter()
            .filter_map(|t| subtree(t).ok())
            .collect()
    }
}

/// A subtree of a folder as the user writes it (`photos`, `./archive/2019/`): a path relative
/// to the folder, not the folder itself.
pub fn subtree(text: &str) -> Result<meshfs_protocol::RelPath, String> {
    let t = text.trim_start_matches("./").trim_end_matches('/');
    if t.is_empty() || t == "." {
        return Err(format!(
            "{text:?} is the whole folder: leave on_demand_under empty (`--on-demand`) to have all of it on demand"
        ));
    }
    meshfs_protocol::RelPath::normalized(t).map_err(|e| format!("{text:?}: {e}"))
}

/// A role in the config is its name (`send-only`); another word fails the parse, naming it.
mod role_text {
    use meshfs_sync::role::Role;
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(r: &Role, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(r.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Role, D::Error> {
        let text = String::deserialize(d)?;
        Role::parse(&text).ok_or_else(|| {
            D::Error::custom(format!(
                "{text:?} is not a role: use send-receive, send-only or receive-only"
            ))
        })
    }
}

impl FolderConfig {
    /// The umask applied to this folder's remote versions.
    pub fn umask(&self) -> u32 {
        self.umask.unwrap_or(DEFAULT_UMASK)
    }
}

fn yes() -> bool {
    true
}

fn is_false(b: &bool) -> bool {
    !b
}

/// One `[[peer]]`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, try_from = "RawPeerConfig")]
pub struct PeerConfig {
    /// The peer's device id, written as `meshfs id` prints it on that device.
    #[serde(with = "device_id_text")]
    pub id: DeviceId,
    /// A name for people.
    #[serde(default)]
    pub name: String,
    /// Where to dial it: `HOST:PORT`s, and [`DYNAMIC`] for wherever it is found (the LAN, its
    /// own connections, other peers). Default: `["dynamic"]`. Empty: never dialed (it dials
    /// us).
    pub addresses: Vec<String>,
    /// Folder ids shared with it.
    #[serde(default)]
    pub folders: Vec<FolderId>,
}

impl PeerConfig {
    /// A peer dialed wherever it is found (`addresses = ["dynamic"]`).
    pub fn new(id: DeviceId) -> PeerConfig {
        PeerConfig {
            id,
            name: String::new(),
            addresses: vec![DYNAMIC.to_string()],
            folders: Vec::new(),
        }
    }

    /// It is dialed at addresses found or learned, not only at fixed ones.
    pub fn is_dynamic(&self) -> bool {
        self.addresses.iter().any(|a| a == DYNAMIC)
    }

    /// Its fixed addresses (`HOST:PORT`), in config order.
    pub fn static_addrs(&self) -> impl Iterator<Item = &str> {
        self.addresses
            .iter()
            .filter(|a| *a != DYNAMIC)
            .map(String::as_str)
    }

    /// Whether it is ever dialed (it has a fixed address or is dynamic).
    pub fn is_dialed(&self) -> bool {
        !self.addresses.is_empty()
    }
}

/// A `[[peer]]` as written: `addresses`, or the older single `addr` (`""`: dynamic; a
/// `HOST:PORT`: that address only).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPeerConfig {
    #[serde(with = "device_id_text")]
    id: DeviceId,
    #[serde(default)]
    name: String,
    #[serde(default)]
    addresses: Option<Vec<String>>,
    #[serde(default)]
    addr: Option<String>,
    #[serde(default)]
    folders: Vec<FolderId>,
}

impl TryFrom<RawPeerConfig> for PeerConfig {
    type Error = String;

    fn try_from(raw: RawPeerConfig) -> Result<PeerConfig, String> {
        let addresses = match (raw.addresses, raw.addr) {
            (Some(_), Some(_)) => {
                return Err(format!(
                    "peer {} has both `addresses` and the older `addr`: keep `addresses`",
                    raw.id
                ))
            }
            (Some(list), None) => list,
            (None, Some(a)) if !a.is_empty() => vec![a],
            (None, _) => vec![DYNAMIC.to_string()],
        };
        Ok(PeerConfig {
            id: raw.id,
            name: raw.name,
            addresses,
            folders: raw.folders,
        })
    }
}

/// A [`DeviceId`] in the config is the text `meshfs id` prints, not the bytes the wire
/// carries; a malformed one fails the parse with the value quoted (the parser adds the file's
/// line).
mod device_id_text {
    use meshfs_protocol::DeviceId;
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(id: &DeviceId, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(id)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DeviceId, D::Error> {
        let text = String::deserialize(d)?;
        text.parse()
            .map_err(|e| D::Error::custom(format!("{text:?} is not a device id: {e}")))
    }
}

impl Config {
    /// A fresh config for `init`.
    pub fn new(name: &str, listen: &str) -> Config {
        Config {
            device: DeviceConfig {
                name: name.to_string(),
                listen: listen.to_string(),
            },
            options: Options::default(),
            discovery: DiscoveryConfig::default(),
            ui: UiConfig::default(),
            folders: Vec::new(),
            peers: Vec::new(),
        }
    }

    /// Reads and validates `home`'s config.
    pub fn load(home: &Home) -> Result<Config, ConfigError> {
        let path = home.config_file();
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ConfigError::Missing(path))
            }
            Err(source) => return Err(ConfigError::Io { path, source }),
        };
        let config: Config = toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.clone(),
            source,
        })?;
        config.validate(home)?;
        Ok(config)
    }

    /// Writes the config atomically (temp file, fsync, rename), the owner's alone whatever
    /// the umask: the file 0600, its directory and the local ignore rules' directory 0700
    /// (the config names every peer and folder; the ignore files say what is secret).
    pub fn save(&self, home: &Home) -> Result<(), ConfigError> {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let path = home.config_file();
        let io = |source| ConfigError::Io {
            path: path.clone(),
            source,
        };
        private_dir(&home.config_dir).map_err(io)?;
        private_dir(&home.local_ignore_dir()).map_err(io)?;
        let text = toml::to_string_pretty(self).map_err(|source| ConfigError::Encode {
            path: path.clone(),
            source,
        })?;
        let tmp = home.config_dir.join(".config.toml.tmp");
        {
            use std::io::Write;
            let _ = std::fs::remove_file(&tmp);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(io)?;
            // The mode given at creation is cut by the umask; 0600 is set whatever it was.
            f.set_permissions(std::fs::Permissions::from_mode(0o600))
                .map_err(io)?;
            f.write_all(text.as_bytes()).map_err(io)?;
            f.sync_all().map_err(io)?;
        }
        std::fs::rename(&tmp, &path).map_err(io)?;
        Ok(())
    }

    /// Checks every field; the error names the file and the field. Touches no disk except
    /// to resolve symlinks when comparing folder paths with `home`'s directories.
    pub fn validate(&self, home: &Home) -> Result<(), ConfigError> {
        let path = home.config_file();
        let invalid = |field: String, message: String| ConfigError::Invalid {
            path: path.clone(),
            field,
            message,
        };
        if self.device.name.trim().is_empty() {
            return Err(invalid("device.name".into(), "must not be empty".into()));
        }
        if self.discovery.port == 0 {
            return Err(invalid(
                "discovery.port".into(),
                "must be a UDP port, 1-65535".into(),
            ));
        }
        if self.device.listen.parse::<SocketAddr>().is_err()
            && !looks_like_host_port(&self.device.listen)
        {
            return Err(ConfigError::Listen {
                path: path.clone(),
                source: ListenError::NotHostPort(self.device.listen.clone()),
            });
        }
        let mut seen = std::collections::HashSet::new();
        for (i, f) in self.folders.iter().enumerate() {
            if !seen.insert(&f.id) {
                return Err(invalid(
                    format!("folder[{i}].id"),
                    format!("folder {:?} is listed twice", f.id.as_str()),
                ));
            }
            if !f.path.is_absolute() {
                return Err(invalid(
                    format!("folder[{i}].path"),
                    "must be an absolute path".into(),
                ));
            }
            if let Some(u) = f.umask.filter(|u| *u & !0o077 != 0) {
                return Err(invalid(
                    format!("folder[{i}].umask"),
                    format!(
                        "{u:#o} masks more than group and world bits (write it in octal, e.g. 0o027); the owner's are kept so that meshfs can read and apply every path"
                    ),
                ));
            }
            if let Some(own) = home.overlap(&f.path) {
                return Err(invalid(
                    format!("folder[{i}].path"),
                    format!(
                        "{} overlaps meshfs's own directory {} (its keys and journal); choose a folder outside it",
                        f.path.display(),
                        own.display()
                    ),
                ));
            }
            for (j, t) in f.on_demand_under.iter().enumerate() {
                if let Err(e) = subtree(t) {
                    return Err(invalid(format!("folder[{i}].on_demand_under[{j}]"), e));
                }
            }
            if !f.on_demand_under.is_empty() && !f.on_demand {
                return Err(invalid(
                    format!("folder[{i}].on_demand_under"),
                    "is set but on_demand is not: set on_demand = true too, or remove it".into(),
                ));
            }
            if f.versions_space_percent > 90 {
                return Err(invalid(
                    format!("folder[{i}].versions_space_percent"),
                    format!(
                        "{} is more than 90 (a share of the free space, in percent)",
                        f.versions_space_percent
                    ),
                ));
            }
            if let Some(other) = self.folders[..i]
                .iter()
                .find(|o| o.path.starts_with(&f.path) || f.path.starts_with(&o.path))
            {
                return Err(invalid(
                    format!("folder[{i}].path"),
                    format!(
                        "{} overlaps folder {:?} at {}; folders must not nest",
                        f.path.display(),
                        other.id.as_str(),
                        other.path.display()
                    ),
                ));
            }
        }
        let mut seen = std::collections::HashSet::new();
        for (i, p) in self.peers.iter().enumerate() {
            if !seen.insert(p.id) {
                return Err(invalid(
                    format!("peer[{i}].id"),
                    "this peer is listed twice".into(),
                ));
            }
            for (j, a) in p.addresses.iter().enumerate() {
                if a != DYNAMIC && !looks_like_host_port(a) {
                    return Err(invalid(
                        format!("peer[{i}].addresses[{j}]"),
                        format!("{a:?} is neither HOST:PORT nor \"{DYNAMIC}\""),
                    ));
                }
            }
            for (j, f) in p.folders.iter().enumerate() {
                if self.folder(f).is_none() {
                    return Err(invalid(
                        format!("peer[{i}].folders[{j}]"),
                        format!(
                            "no folder {:?} in this config (add it with `meshfs folder add`)",
                            f.as_str()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The folder with this id.
    pub fn folder(&self, id: &FolderId) -> Option<&FolderConfig> {
        self.folders.iter().find(|f| &f.id == id)
    }

    /// The peers this device shares `folder` with.
    pub fn sharing<'a>(&'a self, folder: &'a FolderId) -> impl Iterator<Item = &'a PeerConfig> {
        self.peers
            .iter()
            .filter(move |p| p.folders.contains(folder))
    }

    /// The peer with this device id.
    pub fn peer(&self, id: &DeviceId) -> Option<&PeerConfig> {
        self.peers.iter().find(|p| &p.id == id)
    }

    /// Mutable access to the peer with this device id.
    pub fn peer_mut(&mut self, id: &DeviceId) -> Option<&mut PeerConfig> {
        self.peers.iter_mut().find(|p| &p.id == id)
    }

    /// The address to listen on: `device.listen` as an IP address, or its host name resolved
    /// (the first IPv4 address, else the first one).
    pub fn listen_addr(&self, home: &Home) -> Result<SocketAddr, ConfigError> {
        resolve_listen(&self.device.listen).map_err(|source| ConfigError::Listen {
            path: home.config_file(),
            source,
        })
    }

    /// Every configured peer's id.
    pub fn peer_ids(&self) -> Vec<DeviceId> {
        self.peers.iter().map(|p| p.id).collect()
    }
}

/// Why a listen address cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// Not of the form `HOST:PORT`.
    #[error("{0:?} is not HOST:PORT (e.g. 0.0.0.0:7788, [::]:7788 or localhost:7900)")]
    NotHostPort(String),
    /// The host name could not be resolved.
    #[error("cannot resolve {addr:?}: {source}")]
    Resolve {
        /// The address as given.
        addr: String,
        /// The resolver's error.
        source: std::io::Error,
    },
    /// The host name resolves to nothing.
    #[error("{0:?} resolves to no address")]
    NoAddress(String),
}

/// `IP:PORT`, or `HOST:PORT` resolved (IPv4 preferred, so `localhost` binds where peers given
/// `127.0.0.1` reach it).
pub fn resolve_listen(s: &str) -> Result<SocketAddr, ListenError> {
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Ok(sa);
    }
    if !looks_like_host_port(s) {
        return Err(ListenError::NotHostPort(s.to_string()));
    }
    use std::net::ToSocketAddrs;
    let all: Vec<SocketAddr> = s
        .to_socket_addrs()
        .map_err(|source| ListenError::Resolve {
            addr: s.to_string(),
            source,
        })?
        .collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or(all.first())
        .copied()
        .ok_or_else(|| ListenError::NoAddress(s.to_string()))
}

/// Whether `s` has the shape `HOST:PORT` (IPv6 in brackets).
pub fn looks_like_host_port(s: &str) -> bool {
    match s.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok(),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_validates() {
        let dir = tempfile::tempdir().unwrap();
        let home = Home::resolve(Some(dir.path()));
        let mut c = Config::new("a", "127.0.0.1:7788");
        c.folders.push(FolderConfig::new(
            FolderId::new("work").unwrap(),
            "/tmp/w".into(),
        ));
        c.save(&home).unwrap();
        assert_eq!(Config::load(&home).unwrap(), c);
        std::fs::write(home.config_file(), "[device]\nname='a'\nlisten='nope'\n").unwrap();
        let err = Config::load(&home).unwrap_err().to_string();
        assert!(err.contains("device.listen"), "{err}");
    }

    #[test]
    fn a_free_floor_is_a_share_of_the_disk_or_a_size_and_round_trips() {
        assert_eq!(FreeFloor::parse("5%"), Ok(FreeFloor::Percent(5)));
        assert_eq!(FreeFloor::parse("2GiB"), Ok(FreeFloor::Bytes(2 << 30)));
        assert_eq!(FreeFloor::parse("0"), Ok(FreeFloor::Bytes(0)));
        assert!(FreeFloor::parse("95%").is_err());
        assert!(FreeFloor::parse("lots").is_err());
        assert_eq!(FreeFloor::Percent(10).bytes(1000), 100);
        assert_eq!(FreeFloor::Bytes(7).bytes(1000), 7);
        let dir = tempfile::tempdir().unwrap();
        let home = Home::resolve(Some(dir.path()));
        let mut c = Config::new("a", "127.0.0.1:7788");
        let mut f = FolderConfig::new(FolderId::new("work").unwrap(), "/tmp/w".into());
        f.on_demand = true;
        f.min_free = Some(FreeFloor::Percent(12));
        c.folders.push(f);
        c.save(&home).unwrap();
        let text = std::fs::read_to_string(home.config_file()).unwrap();
        assert!(text.contains("min_free = \"12%\""), "{text}");
        assert_eq!(Config::load(&home).unwrap(), c);
    }

    #[test]
    fn on_demand_subtrees_round_trip_and_a_bad_one_or_one_without_on_demand_is_refused() {
        assert_eq!(subtree("./photos/").unwrap().as_str(), "photos");
        assert!(subtree(".").is_err());
        assert!(subtree("../x").is_err());
        let dir = tempfile::tempdir().unwrap();
        let home = Home::resolve(Some(dir.path()));
        let mut c = Config::new("a", "127.0.0.1:7788");
        let mut f = FolderConfig::new(FolderId::new("work").unwrap(), "/tmp/w".into());
        f.on_demand = true;
        f.on_demand_under = vec!["big".into(), "archive/2019".into()];
        c.folders.push(f);
        c.save(&home).unwrap();
        let text = std::fs::read_to_string(home.config_file()).unwrap();
        assert!(text.contains("on_demand_under = ["), "{text}");
        assert_eq!(Config::load(&home).unwrap(), c);
        assert_eq!(c.folders[0].on_demand_subtrees().len(), 2);
        std::fs::write(home.config_file(), text.replace("\"big\"", "\"../up\"")).unwrap();
        let err = Config::load(&home).unwrap_err().to_string();
        assert!(err.contains("on_demand_under[0]"), "{err}");
        std::fs::write(home.config_file(), text.replace("on_demand = true", "")).unwrap();
        let err = Config::load(&home).unwrap_err().to_string();
        assert!(err.contains("on_demand = true"), "{err}");
    }

    #[test]
    fn a_budget_is_read_in_bytes_or_with_a_unit_and_written_back_in_the_largest_whole_unit() {
        assert_eq!(parse_size("65536"), Ok(65536));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("2 GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1.5g"), Ok(3 << 29));
        assert_eq!(parse_size("10K"), Ok(10 << 10));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert_eq!(format_size(64 << 20), "64MiB");
        assert_eq!(format_size((64 << 20) + 1), ((64u64 << 20) + 1).to_string());
        let dir = tempfile::tempdir().unwrap();
        let home = Home::resolve(Some(dir.path()));
        let mut c = Config::new("a", "127.0.0.1:7788");
        let mut f = FolderConfig::new(FolderId::new("work").unwrap(), "/tmp/w".into());
        f.on_demand = true;
        f.cache_max = Some(3 << 30);
        c.folders.push(f);
        c.save(&home).unwrap();
        let text = std::fs::read_to_string(home.config_file()).unwrap();
        assert!(text.contains("on_demand = true"), "{text}");
        assert!(text.contains("cache_max = \"3GiB\""), "{text}");
        assert_eq!(Config::load(&home).unwrap(), c);
        std::fs::write(home.config_file(), text.replace("\"3GiB\"", "1073741824")).unwrap();
        assert_eq!(
            Config::load(&home).unwrap().folders[0].cache_max,
            Some(1 << 30)
        );
        std::fs::write(home.config_file(), text.replace("\"3GiB\"", "\"much\"")).unwrap();
        let err = Config::load(&home).unwrap_err().to_string();
        assert!(err.contains("not a size"), "{err}");
    }

    #[test]
    fn ids_are_written_as_text_and_read_back_typed() {
        let dir = tempfile::tempdir().unwrap();
        let home = Home::resolve(Some(dir.path()));
        let peer = DeviceId::from_bytes([9; 32]);
        let work = FolderId::new("work").unwrap();
        let mut c = Config::new("a", "127.0.0.1:7788");
        c.folders
            .push(FolderConfig::new(work.clone(), "/tmp/w".into()));
        c.peers.push(PeerConfig {
            name: "b".into(),
            folders: vec![work.clone()],
            ..PeerConfig::new(peer)
        });
        c.save(&home).unwrap();
        let text = std::fs::read_to_string(home.config_file()).unwrap();
        assert!(text.contains(&format!("id = \"{peer}\"")), "{text}");
        assert!(
            text.contains("id = \"work\"") && text.contains("folders = [\"work\"]"),
            "{text}"
        );
        let back = Config::load(&home).unwrap();
        assert_eq!(
            back.peer(&peer).map(|p| &p.folders),
            Some(&vec![work.clone()])
        );
        assert!(back.folder(&work).is_some());
        assert_eq!(back.peer_ids(), vec![peer]);
    }

    #[test]
    fn a_malformed_id_in_the_file_is_refused_naming_the_file_and_the_value() {
        let dir = tempfile::tempdir().unwrap();
        let home = Home::resolve(Some(dir.path()));
        Config::new("a", "127.0.0.1:7788").save(&home).unwrap();
        let good = std::fs::read_to_string(home.config_file()).unwrap();
        let peer = DeviceId::from_bytes([9; 32]).to_string();
        let typo = format!("{}B{}", &peer[..3], &peer[4..]);
        assert_ne!(typo, peer);
        let cases = [
            (
                "[[folder]]\nid = \"no/slash\"\npath = \"/srv/w\"\n".to_string(),
                "\"no/slash\"",
            ),
            (format!("[[peer]]\nid = \"{typo}\"\n"), typo.as_str()),
            (
                "[[peer]]\nid = \"ABC\"\n".to_string(),
                "\"ABC\" is not a device id",
            ),
            (
                format!("[[peer]]\nid = \"{peer}\"\nfolders = [\".hidden\"]\n"),
                "\".hidden\"",
            ),
        ];
        for (table, value) in cases {
            std::fs::write(home.config_file(), format!("{good}\n{table}")).unwrap();
            let err = Config::load(&home).unwrap_err();
            assert!(matches!(err, ConfigError::Parse { .. }), "{err:?}");
            let shown = err.to_string();
            assert!(
                shown.contains(home.config_file().to_str().unwrap()) && shown.contains(value),
                "{shown}"
            );
        }
    }

    #[test]
    fn a_folder_takes_a_role_and_a_version_policy_and_writes_only_what_is_not_the_default() {
        let dir = tempfile::tempdir().unwrap();
        let home = Home::resolve(Some(dir.path()));
        Config::new("a", "127.0.0.1:7788").save(&home).unwrap();
        let mut text = std::fs::read_to_string(home.config_file()).unwrap();
        text.push_str(
            "\n[[folder]]\nid = \"work\"\npath = \"/srv/work\"\nrole = \"receive-only\"\nversions_days = 0\n",
        );
        std::fs::write(home.config_file(), &text).unwrap();
        let c = Config::load(&home).unwrap();
        assert_eq!(c.folders[0].role, Role::ReceiveOnly);
        assert_eq!(c.folders[0].versions_days, 0);
        assert_eq!(c.folders[0].versions_space_percent, VERSIONS_SPACE_PERCENT);
        c.save(&home).unwrap();
        let saved = std::fs::read_to_string(home.config_file()).unwrap();
        assert!(saved.contains("role = \"receive-only\"") && saved.contains("versions_days = 0"));
        assert!(!saved.contains("versions_space_percent"), "{saved}");
        std::fs::write(home.config_file(), text.replace("receive-only", "mirror")).unwrap();
        let err = Config::load(&home).unwrap_err().to_string();
        assert!(err.contains("\"mirror\" is not a role"), "{err}");
    }

    #[test]
    fn a_fresh_config_takes_folder_and_peer_tables_appended_by_hand() {
        let dir = tempfile::tempdir().unwrap();
        let home = Home::resolve(Some(dir.path()));
        Config::new("a", "127.0.0.1:7788").save(&home).unwrap();
        let mut text = std::fs::read_to_string(home.config_file()).unwrap();
        assert!(!text.contains("folder"), "{text}");
        text.push_str("\n[[folder]]\nid = \"work\"\npath = \"/srv/work\"\n");
        std::fs::write(home.config_file(), text).unwrap();
        let c = Config::load(&home).unwrap();
        assert_eq!(c.folders[0].path, Path::new("/srv/work"));
    }

    #[test]
    fn nested_folders_and_folders_over_the_home_are_refused_by_field() {
        let dir = tempfile::tempdir().unwrap();
        let home = Home::resolve(Some(&dir.path().join("home")));
        let folder = |id: &str, path: PathBuf| FolderConfig::new(FolderId::new(id).unwrap(), path);
        let mut c = Config::new("a", "127.0.0.1:7788");
        c.folders.push(folder("a", dir.path().join("files")));
        c.folders.push(folder("b", dir.path().join("files/inner")));
        let err = c.validate(&home).unwrap_err().to_string();
        assert!(
            err.contains("folder[1].path") && err.contains("must not nest"),
            "{err}"
        );
        for bad in [
            dir.path().to_path_buf(),
            dir.path().join("home"),
            dir.path().join("home/state/x"),
        ] {
            c.folders = vec![folder("a", bad)];
            let err = c.validate(&home).unwrap_err().to_string();
            assert!(
                err.contains("folder[0].path") && err.contains("meshfs's own directory"),
                "{err}"
            );
        }
    }

    #[test]
    fn a_peer_is_dynamic_unless_given_addresses_and_the_older_addr_still_reads() {
        let dir = tempfile::tempdir().unwrap();
        let home = Home::resolve(Some(dir.path()));
        Config::new("a", "127.0.0.1:7788").save(&home).unwrap();
        let good = std::fs::read_to_string(home.config_file()).unwrap();
        let peer = DeviceId::from_bytes([9; 32]);
        let read = |table: &str| {
            std::fs::write(
                home.config_file(),
                format!("{good}\n[[peer]]\nid = \"{peer}\"\n{table}"),
            )
            .unwrap();
            Config::load(&home)
        };
        let addresses = |table: &str| read(table).unwrap().peers[0].addresses.clone();
        assert_eq!(addresses(""), vec!["dynamic"]);
        assert_eq!(addresses("addr = \"\""), vec!["dynamic"]);
        assert_eq!(addresses("addr = \"s.lan:7788\""), vec!["s.lan:7788"]);
        assert_eq!(
            addresses("addresses = [\"s.lan:7788\", \"dynamic\"]"),
            vec!["s.lan:7788", "dynamic"]
        );
        assert!(addresses("addresses = []").is_empty());
        let p = read("addresses = [\"10.0.0.1:1\", \"dynamic\"]")
            .unwrap()
            .peers[0]
            .clone();
        assert!(p.is_dynamic() && p.is_dialed());
        assert_eq!(p.static_addrs().collect::<Vec<_>>(), vec!["10.0.0.1:1"]);
        let err = read("addresses = [\"nope\"]").unwrap_err().to_string();
        assert!(
            err.contains("peer[0].addresses[0]") && err.contains("\"nope\""),
            "{err}"
        );
        let err = read("addr = \"a:1\"\naddresses = []")
            .unwrap_err()
            .to_string();
        assert!(err.contains("keep `addresses`"), "{err}");
        // Written back as `addresses`.
        let c = read("addr = \"s.lan:7788\"").unwrap();
        c.save(&home).unwrap();
        let text = std::fs::read_to_string(home.config_file()).unwrap();
        assert!(
            text.contains("addresses = [\"s.lan:7788\"]") && !text.contains("addr ="),
            "{text}"
        );
    }

    #[test]
    fn discovery_is_on_by_default_and_can_be_switched_off() {
        let dir = tempfile::tempdir().unwrap();
        let home = Home::resolve(Some(dir.path()));
        let mut c = Config::new("a", "127.0.0.1:7788");
        assert!(c.discovery.local);
        assert_eq!(c.discovery.port, meshfs_protocol::DISCOVERY_PORT);
        c.discovery.local = false;
        c.save(&home).unwrap();
        let text = std::fs::read_to_string(home.config_file()).unwrap();
        assert!(text.contains("[discovery]\nlocal = false"), "{text}");
        assert!(!Config::load(&home).unwrap().discovery.local);
        // A config written before discovery existed reads with it on.
        std::fs::write(
            home.config_file(),
            "[device]\nname = 'a'\nlisten = '127.0.0.1:1'\n",
        )
        .unwrap();
        assert!(Config::load(&home).unwrap().discovery.local);
    }

    #[test]
    fn listen_takes_a_host_name_and_names_the_field_when_it_is_malformed() {
        assert_eq!(
            resolve_listen("localhost:7900").unwrap(),
            "127.0.0.1:7900".parse::<SocketAddr>().unwrap()
        );
        assert!(resolve_listen("[::1]:7900").unwrap().is_ipv6());
        let dir = tempfile::tempdir().unwrap();
        let home = Home::resolve(Some(dir.path()));
        let c = Config::new("a", "localhost");
        let err = c.validate(&home).unwrap_err().to_string();
        assert!(
            err.contains("device.listen") && err.contains("HOST:PORT"),
            "{err}"
        );
        let err = c.listen_addr(&home).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Listen { source: ListenError::NotHostPort(a), .. } if a == "localhost"),
            "{err:?}"
        );
        let shown = err.to_string();
        assert!(
            shown.contains(home.config_file().to_str().unwrap())
                && shown.contains("field `device.listen`: \"localhost\" is not HOST:PORT"),
            "{shown}"
        );
    }
}
