//! This device's identity: its self-signed certificate, its private key, and the
//! [`DeviceId`] derived from them.
//!
//! Owns generating the key pair (rcgen, ECDSA P-256), storing it as `cert.der` (0644) and
//! `key.der` (0600, PKCS#8) in the directory it is given, loading it back, and computing the
//! device id of any certificate: blake3 of its SubjectPublicKeyInfo DER (docs/design.md, "Data model"), found
//! by a small DER walker rather than a full X.509 parser, because that one field is all
//! meshfs reads from a certificate.
//!
//! A certificate names no device: its subject and issuer are [`CERT_NAME`] on every device,
//! since peers pin keys, not names, and a listener shows its certificate to anyone who starts
//! a handshake. (Certificates made before named the device, by default its hostname; such an
//! identity is loaded with a certificate issued afresh from the same key, so the same id.)
//!
//! It never overwrites an existing identity (a lost key is a new device to every peer), never
//! creates the key file with wider permissions than 0600, not even for an instant, and does
//! no networking.

use meshfs_protocol::DeviceId;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// File name of the certificate (DER) inside the identity directory.
pub const CERT_FILE: &str = "cert.der";
/// File name of the private key (PKCS#8 DER) inside the identity directory.
pub const KEY_FILE: &str = "key.der";

/// The common name of every certificate meshfs makes, as subject and issuer.
pub const CERT_NAME: &str = "meshfs";
/// The subject (and issuer) DER of a certificate made with [`CERT_NAME`]: one relative name,
/// the common name (2.5.4.3) as a UTF8String.
const CERT_SUBJECT: &[u8] = &[
    0x30, 0x11, 0x31, 0x0f, 0x30, 0x0d, 0x06, 0x03, 0x55, 0x04, 0x03, 0x0c, 0x06, b'm', b'e', b's',
    b'h', b'f', b's',
];

/// Certificates are pinned by key hash, so expiry protects nothing; it only has to lie far
/// enough in the future never to be reached.
const VALIDITY_YEARS: i32 = 100;

/// Why bytes are not a certificate (or public key) that meshfs can read: what the small DER
/// walker below found instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DerError {
    /// The data ends inside an element.
    #[error("unexpected end of data")]
    Truncated,
    /// A tag of more than one byte: X.509 uses none.
    #[error("multi-byte tags do not occur in a certificate")]
    MultiByteTag,
    /// A length in a form DER does not allow, or longer than 4 bytes.
    #[error("unsupported DER length form 0x{0:02x}")]
    LengthForm(u8),
    /// An element's length runs past the end of what contains it.
    #[error("element longer than its container")]
    Overlong,
    /// Another element than the one the structure has at this place.
    #[error("expected {what} (tag 0x{expected:02x}), found tag 0x{found:02x}")]
    Tag {
        /// The element expected.
        what: &'static str,
        /// Its tag.
        expected: u8,
        /// The tag found.
        found: u8,
    },
    /// Bytes after the certificate.
    #[error("{0} bytes after the certificate")]
    Trailing(usize),
    /// Bytes after the public key in a SubjectPublicKeyInfo.
    #[error("unexpected data after the public key")]
    AfterKey,
    /// The public key is empty or does not fill whole bytes.
    #[error("empty or non-octet public key")]
    BadKey,
}

/// A device's certificate, key and id. A value of this type always holds a certificate whose
/// SPKI hashes to `device_id`.
#[derive(Clone)]
pub struct Identity {
    /// The self-signed X.509 certificate, DER.
    pub cert_der: Vec<u8>,
    /// The private key, PKCS#8 DER.
    pub key_der: Vec<u8>,
    /// blake3 of the certificate's SubjectPublicKeyInfo.
    pub device_id: DeviceId,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("Identity")
            .field("device_id", &self.device_id.to_string())
            .finish_non_exhaustive()
    }
}

/// Why an identity could not be generated, saved or loaded.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// `save` found a certificate or key already in place.
    #[error("an identity already exists at {0}; refusing to overwrite it")]
    Exists(PathBuf),
    /// `load` found no identity file.
    #[error("no identity at {0}: run `meshfs init` to create one")]
    Missing(PathBuf),
    /// Reading a file failed.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// Writing a file or creating the directory failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// rcgen could not generate the key pair or certificate.
    #[error("cannot generate a device certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// Bytes that should be a certificate are not one meshfs can read.
    #[error("not a valid device certificate: {0}")]
    Certificate(#[from] DerError),
    /// A file on disk is not what it should be.
    #[error("{path} is damaged: {reason}; restore it from a backup or move the directory away and run `meshfs init` (this device then gets a new id)")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

impl Identity {
    /// A new identity: a fresh ECDSA P-256 key and a self-signed certificate named
    /// [`CERT_NAME`] (not after the device), valid for a century.
    pub fn generate() -> Result<Identity, IdentityError> {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let cert_der = certificate_for(&key)?;
        let key_der = key.serialize_der();
        let device_id = device_id_of_cert(&cert_der)?;
        debug_assert_eq!(
            device_id,
            DeviceId::from_spki(&rcgen::PublicKeyData::subject_public_key_info(&key))
        );
        Ok(Identity {
            cert_der,
            key_der,
            device_id,
        })
    }

    /// Stores the identity as `dir/cert.der` (0644) and `dir/key.der` (0600), creating `dir`
    /// (0700) if needed.
    ///
    /// Steps: (1) refuse with [`IdentityError::Exists`] if either file exists; (2) write each
    /// file under a temporary name created with `O_EXCL` and its final mode, then fsync it;
    /// (3) hard-link it to its final name, which fails instead of replacing an existing file;
    /// (4) remove the temporary names and fsync the directory. A crash therefore never leaves
    /// a half-written `key.der` or `cert.der`, and a concurrent `save` cannot be overwritten.
    pub fn save(&self, dir: &Path) -> Result<(), IdentityError> {
        let cert_path = dir.join(CERT_FILE);
        let key_path = dir.join(KEY_FILE);
        for path in [&key_path, &cert_path] {
            if path.symlink_metadata().is_ok() {
                return Err(IdentityError::Exists(path.clone()));
            }
        }
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| IdentityError::Write {
                path: dir.to_path_buf(),
                source,
            })?;

        place_new_file(&key_path, &self.key_der, 0o600)?;
        if let Err(e) = place_new_file(&cert_path, &self.cert_der, 0o644) {
            // The key was placed by us a moment ago; without its certificate it is useless.
            let _ = fs::remove_file(&key_path);
            return Err(e);
        }
        fsync_dir(dir)
    }

    /// Loads the identity stored by [`Identity::save`] in `dir`, recomputing the device id
    /// from the certificate and checking that the key belongs to it.
    pub fn load(dir: &Path) -> Result<Identity, IdentityError> {
        let cert_path = dir.join(CERT_FILE);
        let key_path = dir.join(KEY_FILE);
        let cert_der = read_file(&cert_path)?;
        let key_der = read_file(&key_path)?;
        let corrupt = |path: &Path, reason: String| IdentityError::Corrupt {
            path: path.to_path_buf(),
            reason,
        };
        let spki = spki_of_cert(&cert_der).map_err(|e| corrupt(&cert_path, e.to_string()))?;
        let key = rcgen::KeyPair::try_from(key_der.as_slice())
            .map_err(|e| corrupt(&key_path, format!("not a PKCS#8 private key ({e})")))?;
        let cert_key = subject_public_key(spki).map_err(|e| corrupt(&cert_path, e.to_string()))?;
        if key.public_key_raw() != cert_key {
            return Err(corrupt(
                &key_path,
                format!(
                    "this key does not belong to the certificate {}",
                    cert_path.display()
                ),
            ));
        }
        let device_id = DeviceId::from_spki(spki);
        // A certificate made before CERT_NAME names the device: present one issued afresh
        // from the same key instead (same SPKI, same id). The file stays as it was.
        let cert_der = match subject_of_cert(&cert_der) {
            Ok(CERT_SUBJECT) => cert_der,
            _ => certificate_for(&key)?,
        };
        debug_assert_eq!(device_id_of_cert(&cert_der).ok(), Some(device_id));
        Ok(Identity {
            cert_der,
            key_der,
            device_id,
        })
    }

    /// Whether `dir` holds an identity (or part of one, which [`Identity::save`] would refuse
    /// to overwrite).
    pub fn exists(dir: &Path) -> bool {
        [CERT_FILE, KEY_FILE]
            .iter()
            .any(|f| dir.join(f).symlink_metadata().is_ok())
    }
}

/// A self-signed certificate for `key` named [`CERT_NAME`], valid from yesterday for a
/// century.
fn certificate_for(key: &rcgen::KeyPair) -> Result<Vec<u8>, IdentityError> {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, CERT_NAME);
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now.replace_year(now.year() + VALIDITY_YEARS).unwrap_or(
        // 29 February without a leap year in a century: one day later is fine.
        now + time::Duration::days(365 * i64::from(VALIDITY_YEARS) + 25),
    );
    Ok(params.self_signed(key)?.der().to_vec())
}

/// The device id of the device presenting `cert_der`: blake3 of its SubjectPublicKeyInfo.
pub fn device_id_of_cert(cert_der: &[u8]) -> Result<DeviceId, IdentityError> {
    Ok(DeviceId::from_spki(spki_of_cert(cert_der)?))
}

fn read_file(path: &Path) -> Result<Vec<u8>, IdentityError> {
    fs::read(path).map_err(|source| {
        if source.kind() == io::ErrorKind::NotFound {
            IdentityError::Missing(path.to_path_buf())
        } else {
            IdentityError::Read {
                path: path.to_path_buf(),
                source,
            }
        }
    })
}

/// Writes `bytes` to a new file at `path` with `mode`, never replacing an existing file and
/// never exposing a partial file under `path`.
fn place_new_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), IdentityError> {
    let write_err = |p: &Path| {
        let p = p.to_path_buf();
        move |source| IdentityError::Write { path: p, source }
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    // A leftover of this very process id can only come from a crashed earlier run.
    let _ = fs::remove_file(&tmp);
    let result = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)
            .map_err(write_err(&tmp))?;
        // The umask may have removed bits from a 0644 certificate; set exactly what we want.
        // (It can only remove bits, so the key is never more than 0600.)
        file.set_permissions(fs::Permissions::from_mode(mode))
            .map_err(write_err(&tmp))?;
        file.write_all(bytes).map_err(write_err(&tmp))?;
        file.sync_all().map_err(write_err(&tmp))?;
        fs::hard_link(&tmp, path).map_err(|source| {
            if source.kind() == io::ErrorKind::AlreadyExists {
                IdentityError::Exists(path.to_path_buf())
            } else {
                IdentityError::Write {
                    path: path.to_path_buf(),
                    source,
                }
            }
        })
    })();
    let _ = fs::remove_file(&tmp);
    result
}

fn fsync_dir(dir: &Path) -> Result<(), IdentityError> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| IdentityError::Write {
            path: dir.to_path_buf(),
            source,
        })
}

/// One DER element: its tag, its whole encoding (tag, length and content) and its content.
struct Tlv<'a> {
    tag: u8,
    whole: &'a [u8],
    content: &'a [u8],
}

/// Reads the DER element at the start of `input`; returns it and the bytes after it.
fn next_tlv(input: &[u8]) -> Result<(Tlv<'_>, &[u8]), DerError> {
    let (&tag, rest) = input.split_first().ok_or(DerError::Truncated)?;
    if tag & 0x1f == 0x1f {
        return Err(DerError::MultiByteTag);
    }
    let (&first, rest) = rest.split_first().ok_or(DerError::Truncated)?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return Err(DerError::LengthForm(first));
        }
        let bytes = rest.get(..n).ok_or(DerError::Truncated)?;
        let len = bytes
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        (len, &rest[n..])
    };
    let content = rest.get(..len).ok_or(DerError::Overlong)?;
    let header = input.len() - rest.len();
    let tlv = Tlv {
        tag,
        whole: &input[..header + len],
        content,
    };
    Ok((tlv, &rest[len..]))
}

fn expect_tag<'a>(
    input: &'a [u8],
    tag: u8,
    what: &'static str,
) -> Result<(Tlv<'a>, &'a [u8]), DerError> {
    let (tlv, rest) = next_tlv(input)?;
    if tlv.tag != tag {
        return Err(DerError::Tag {
            what,
            expected: tag,
            found: tlv.tag,
        });
    }
    Ok((tlv, rest))
}

const SEQUENCE: u8 = 0x30;
const INTEGER: u8 = 0x02;
const BIT_STRING: u8 = 0x03;
/// `[0] EXPLICIT Version` in a TBSCertificate.
const VERSION_TAG: u8 = 0xa0;

/// The SubjectPublicKeyInfo element (whole DER encoding) of an X.509 certificate:
/// `Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { [0] version OPTIONAL,
/// serialNumber INTEGER, signature SEQUENCE, issuer SEQUENCE, validity SEQUENCE,
/// subject SEQUENCE, subjectPublicKeyInfo SEQUENCE, … }, … }` (RFC 5280 §4.1).
fn spki_of_cert(cert_der: &[u8]) -> Result<&[u8], DerError> {
    Ok(subject_and_spki(cert_der)?.1)
}

/// The subject element (whole DER encoding) of an X.509 certificate.
fn subject_of_cert(cert_der: &[u8]) -> Result<&[u8], DerError> {
    Ok(subject_and_spki(cert_der)?.0)
}

/// The subject and SubjectPublicKeyInfo elements of a certificate (see [`spki_of_cert`]).
fn subject_and_spki(cert_der: &[u8]) -> Result<(&[u8], &[u8]), DerError> {
    let (cert, trailing) = expect_tag(cert_der, SEQUENCE, "Certificate")?;
    if !trailing.is_empty() {
        return Err(DerError::Trailing(trailing.len()));
    }
    let (tbs, _) = expect_tag(cert.content, SEQUENCE, "TBSCertificate")?;
    let mut rest = tbs.content;
    if rest.first() == Some(&VERSION_TAG) {
        rest = next_tlv(rest)?.1;
    }
    rest = expect_tag(rest, INTEGER, "serialNumber")?.1;
    for what in ["signature", "issuer", "validity"] {
        rest = expect_tag(rest, SEQUENCE, what)?.1;
    }
    let (subject, rest) = expect_tag(rest, SEQUENCE, "subject")?;
    let (spki, _) = expect_tag(rest, SEQUENCE, "subjectPublicKeyInfo")?;
    subject_public_key(spki.whole)?;
    Ok((subject.whole, spki.whole))
}

/// The key bytes of a SubjectPublicKeyInfo: `SEQUENCE { algorithm SEQUENCE,
/// subjectPublicKey BIT STRING }`, without the BIT STRING's unused-bits byte.
fn subject_public_key(spki_der: &[u8]) -> Result<&[u8], DerError> {
    let (spki, _) = expect_tag(spki_der, SEQUENCE, "subjectPublicKeyInfo")?;
    let (_, rest) = expect_tag(spki.content, SEQUENCE, "algorithm")?;
    let (key, rest) = expect_tag(rest, BIT_STRING, "subjectPublicKey")?;
    if !rest.is_empty() {
        return Err(DerError::AfterKey);
    }
    match key.content.split_first() {
        Some((0, bits)) if !bits.is_empty() => Ok(bits),
        _ => Err(DerError::BadKey),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_id_is_the_hash_of_the_certificate_spki() {
        let id = Identity::generate().unwrap();
        let key = rcgen::KeyPair::try_from(id.key_der.as_slice()).unwrap();
        let spki = rcgen::PublicKeyData::subject_public_key_info(&key);
        assert_eq!(id.device_id, DeviceId::from_spki(&spki));
        assert_eq!(device_id_of_cert(&id.cert_der).unwrap(), id.device_id);
    }

    #[test]
    fn truncated_or_garbage_certificates_are_errors_not_panics() {
        let id = Identity::generate().unwrap();
        for cut in 0..id.cert_der.len() {
            assert!(device_id_of_cert(&id.cert_der[..cut]).is_err());
        }
        assert!(matches!(
            device_id_of_cert(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]),
            Err(IdentityError::Certificate(DerError::Overlong))
        ));
        assert!(device_id_of_cert(b"not a certificate").is_err());
        assert!(matches!(
            device_id_of_cert(&[0x02, 0x01, 0x07]),
            Err(IdentityError::Certificate(DerError::Tag {
                what: "Certificate",
                expected: 0x30,
                found: 0x02,
            }))
        ));
        let mut trailing = id.cert_der.clone();
        trailing.push(0);
        assert!(matches!(
            device_id_of_cert(&trailing),
            Err(IdentityError::Certificate(DerError::Trailing(1)))
        ));
    }

    /// An identity as versions before [`CERT_NAME`] made it: the device name in the
    /// certificate.
    fn named(device_name: &str) -> Identity {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, device_name);
        let cert_der = params.self_signed(&key).unwrap().der().to_vec();
        Identity {
            device_id: device_id_of_cert(&cert_der).unwrap(),
            cert_der,
            key_der: key.serialize_der(),
        }
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    #[test]
    fn a_certificate_names_no_device() {
        let id = Identity::generate().unwrap();
        assert_eq!(subject_of_cert(&id.cert_der), Ok(CERT_SUBJECT));
        // Self-signed: the issuer is the same fixed name.
        assert_eq!(
            id.cert_der
                .windows(CERT_SUBJECT.len())
                .filter(|w| *w == CERT_SUBJECT)
                .count(),
            2
        );
        let dir = tempfile::tempdir().unwrap();
        id.save(dir.path()).unwrap();
        let loaded = Identity::load(dir.path()).unwrap();
        assert_eq!(
            loaded.cert_der, id.cert_der,
            "a current certificate is kept as it is"
        );
    }

    #[test]
    fn an_identity_whose_certificate_named_the_device_keeps_its_id_and_presents_no_name() {
        let old = named("laptop-of-alice");
        assert!(contains(&old.cert_der, b"laptop-of-alice"));
        let dir = tempfile::tempdir().unwrap();
        old.save(dir.path()).unwrap();
        let loaded = Identity::load(dir.path()).unwrap();
        assert_eq!(loaded.device_id, old.device_id);
        assert_eq!(loaded.key_der, old.key_der);
        assert!(!contains(&loaded.cert_der, b"laptop-of-alice"));
        assert_eq!(subject_of_cert(&loaded.cert_der), Ok(CERT_SUBJECT));
        assert_eq!(device_id_of_cert(&loaded.cert_der).unwrap(), old.device_id);
        // The stored file is left alone.
        assert_eq!(
            std::fs::read(dir.path().join(CERT_FILE)).unwrap(),
            old.cert_der
        );
    }
}
