//! Device and folder identities.
//!
//! A [`DeviceId`] is the blake3 hash of a device certificate's public key (SPKI DER). Humans
//! see it as base32 in eight dash-separated groups of seven characters; every 13 characters of
//! the id carry one Luhn mod 32 check character, so any single mistyped character is detected
//! and reported with its position instead of silently naming another device.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
/// Characters of base32 data per check group.
const GROUP: usize = 13;
/// Base32 characters of a 32-byte id without padding.
const DATA_CHARS: usize = 52;
/// Characters of the displayed form without dashes (52 data + 4 check).
const FULL_CHARS: usize = 56;

/// A device's identity: blake3 of its certificate's SubjectPublicKeyInfo.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceId([u8; 32]);

/// The first 8 bytes of a [`DeviceId`]: the key of version vectors and the name in conflicts.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
pub struct ShortId(pub u64);

/// Why a string is not a device id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceIdError {
    /// Wrong number of characters once dashes and spaces are removed.
    #[error("a device id has {FULL_CHARS} characters (without dashes), this one has {0}")]
    Length(usize),
    /// A character outside the base32 alphabet A–Z, 2–7.
    #[error("character {position} ({ch:?}) is not a base32 letter (A-Z, 2-7)")]
    Character {
        /// 1-based position in the id without dashes.
        position: usize,
        /// The offending character.
        ch: char,
    },
    /// A check character does not match: a character in that group was mistyped.
    #[error("characters {first}-{last} fail their check: one of them is mistyped (compare with `meshfs id` on that device)")]
    Check {
        /// 1-based position of the group's first character (without dashes).
        first: usize,
        /// 1-based position of the group's check character.
        last: usize,
    },
}

impl DeviceId {
    /// The id of a device whose certificate has this SubjectPublicKeyInfo (DER).
    pub fn from_spki(spki_der: &[u8]) -> DeviceId {
        DeviceId(*blake3::hash(spki_der).as_bytes())
    }

    /// Wraps raw id bytes (as received in a hash or from storage).
    pub fn from_bytes(bytes: [u8; 32]) -> DeviceId {
        DeviceId(bytes)
    }

    /// The raw 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The short id: the key of this device in version vectors.
    pub fn short(&self) -> ShortId {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.0[..8]);
        ShortId(u64::from_be_bytes(b))
    }

    fn data_chars(&self) -> Vec<u8> {
        let enc = data_encoding::BASE32_NOPAD.encode(&self.0);
        debug_assert_eq!(enc.len(), DATA_CHARS);
        enc.into_bytes()
    }
}

fn value(c: u8) -> Option<u32> {
    ALPHABET.iter().position(|&a| a == c).map(|p| p as u32)
}

/// Luhn mod 32 check character over base32 characters.
fn luhn32(chars: &[u8]) -> u8 {
    let n = 32u32;
    let mut factor = 1;
    let mut sum = 0u32;
    for &c in chars {
        let code = value(c).unwrap_or(0);
        let mut addend = factor * code;
        factor = if factor == 2 { 1 } else { 2 };
        addend = addend / n + addend % n;
        sum += addend;
    }
    let remainder = sum % n;
    let check = (n - remainder) % n;
    ALPHABET[check as usize]
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let data = self.data_chars();
        let mut full = Vec::with_capacity(FULL_CHARS);
        for group in data.chunks(GROUP) {
            full.extend_from_slice(group);
            full.push(luhn32(group));
        }
        for (i, part) in full.chunks(7).enumerate() {
            if i > 0 {
                f.write_str("-")?;
            }
            f.write_str(std::str::from_utf8(part).map_err(|_| fmt::Error)?)?;
        }
        Ok(())
    }
}

impl fmt::Debug for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceId({})", self.short())
    }
}

impl FromStr for DeviceId {
    type Err = DeviceIdError;

    fn from_str(s: &str) -> Result<DeviceId, DeviceIdError> {
        let mut chars = Vec::with_capacity(FULL_CHARS);
        for ch in s.trim().chars() {
            if ch == '-' || ch == ' ' {
                continue;
            }
            let up = ch.to_ascii_uppercase();
            if !up.is_ascii() || value(up as u8).is_none() {
                return Err(DeviceIdError::Character {
                    position: chars.len() + 1,
                    ch,
                });
            }
            chars.push(up as u8);
        }
        if chars.len() != FULL_CHARS {
            return Err(DeviceIdError::Length(chars.len()));
        }
        let mut data = Vec::with_capacity(DATA_CHARS);
        for (g, group) in chars.chunks(GROUP + 1).enumerate() {
            let (body, check) = group.split_at(GROUP);
            if luhn32(body) != check[0] {
                let first = g * (GROUP + 1) + 1;
                return Err(DeviceIdError::Check {
                    first,
                    last: first + GROUP,
                });
            }
            data.extend_from_slice(body);
        }
        let bytes = data_encoding::BASE32_NOPAD
            .decode(&data)
            .map_err(|_| DeviceIdError::Length(chars.len()))?;
        let arr: [u8; 32] = bytes
            .try_into()
            .map_err(|_| DeviceIdError::Length(chars.len()))?;
        Ok(DeviceId(arr))
    }
}

impl Serialize for DeviceId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for DeviceId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <[u8; 32]>::deserialize(d).map(DeviceId)
    }
}

impl ShortId {
    /// Seven base32 characters: the form shown in logs and conflict file names.
    pub fn display7(&self) -> String {
        let enc = data_encoding::BASE32_NOPAD.encode(&self.0.to_be_bytes());
        enc[..7].to_string()
    }
}

impl fmt::Display for ShortId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.display7())
    }
}

impl fmt::Debug for ShortId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.display7())
    }
}

/// A replicated folder's id, shared by every device that replicates it.
///
/// 1 to 64 characters of `A-Z a-z 0-9 . _ -`, not starting with `.` or `-`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct FolderId(String);

/// Why a string is not a folder id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid folder id {id:?}: use 1 to 64 characters of A-Z, a-z, 0-9, '.', '_', '-', not starting with '.' or '-'")]
pub struct FolderIdError {
    /// The rejected text.
    pub id: String,
}

impl FolderId {
    /// Validates a folder id.
    pub fn new(id: &str) -> Result<FolderId, FolderIdError> {
        let ok = !id.is_empty()
            && id.len() <= 64
            && !id.starts_with('.')
            && !id.starts_with('-')
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
        if ok {
            Ok(FolderId(id.to_string()))
        } else {
            Err(FolderIdError { id: id.to_string() })
        }
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for FolderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for FolderId {
    type Err = FolderIdError;
    fn from_str(s: &str) -> Result<FolderId, FolderIdError> {
        FolderId::new(s)
    }
}

impl Serialize for FolderId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for FolderId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        FolderId::new(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn device_id_display_parse_round_trip(bytes in any::<[u8; 32]>()) {
            let id = DeviceId::from_bytes(bytes);
            let shown = id.to_string();
            prop_assert_eq!(shown.len(), 63);
            prop_assert_eq!(shown.parse::<DeviceId>().unwrap(), id);
            prop_assert_eq!(shown.to_lowercase().parse::<DeviceId>().unwrap(), id);
        }

        #[test]
        fn device_id_single_typo_is_detected(bytes in any::<[u8; 32]>(), pos in 0usize..56, delta in 1u8..32) {
            let id = DeviceId::from_bytes(bytes);
            let mut chars: Vec<u8> = id.to_string().bytes().filter(|&b| b != b'-').collect();
            let old = value(chars[pos]).unwrap() as u8;
            chars[pos] = ALPHABET[((old + delta) % 32) as usize];
            let typo = String::from_utf8(chars).unwrap();
            prop_assert!(typo.parse::<DeviceId>().is_err());
        }

        #[test]
        fn folder_id_accepts_its_alphabet(s in "[A-Za-z0-9_][A-Za-z0-9._-]{0,63}") {
            let id = FolderId::new(&s).unwrap();
            prop_assert_eq!(id.as_str(), s.as_str());
        }
    }

    #[test]
    fn device_id_errors_say_what_is_wrong() {
        let id = DeviceId::from_bytes([7; 32]).to_string();
        assert!(matches!(
            "ABC".parse::<DeviceId>(),
            Err(DeviceIdError::Length(3))
        ));
        let bad = id.replacen('A', "1", 1);
        if bad != id {
            assert!(matches!(
                bad.parse::<DeviceId>(),
                Err(DeviceIdError::Character { ch: '1', .. })
            ));
        }
    }

    #[test]
    fn folder_id_rejects_bad_ids() {
        for bad in ["", ".hidden", "-x", "a/b", "a b", &"x".repeat(65)] {
            assert!(FolderId::new(bad).is_err(), "{bad:?}");
        }
    }
}
