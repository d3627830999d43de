//! Trust: who may connect. The store of accepted device ids, the rustls verifiers that pin
//! a peer's id on both sides of the handshake (a listener refuses an unknown dialer, a dialer
//! a listener that is not the device it meant), and the bounded, rate-limited log of refusals.
//! It never opens a socket or reads a frame.

use super::*;

/// How many recently refused devices [`TrustStore::refused`] remembers.
pub(super) const REFUSED_CAPACITY: usize = 32;
/// A device refused again within this time is logged at debug level, not as a warning.
pub(super) const REFUSAL_WARN_INTERVAL: Duration = Duration::from_secs(300);
/// Most refusal warnings in one [`REFUSAL_LOG_WINDOW`]: a device that makes a new key for
/// every attempt is news every time. Refusals past it are counted, and one line at the end of
/// the window says how many.
pub(super) const REFUSAL_WARNINGS_PER_WINDOW: u32 = 5;
/// See [`REFUSAL_WARNINGS_PER_WINDOW`].
pub(super) const REFUSAL_LOG_WINDOW: Duration = Duration::from_secs(60);
/// Marker in the TLS error text by which [`accept`] recognizes our own refusal.
pub(super) const UNTRUSTED_MARKER: &str = "untrusted device ";

/// The set of device ids this daemon accepts; cheap to clone (all clones share one set),
/// updated at runtime when peers are added or removed. Removing a device refuses its next
/// handshake; closing its open connections is the caller's job.
#[derive(Clone, Default)]
pub struct TrustStore {
    inner: Arc<RwLock<TrustInner>>,
}

#[derive(Default)]
pub(super) struct TrustInner {
    trusted: HashSet<DeviceId>,
    /// Most recent first, at most one entry per device.
    refused: VecDeque<(DeviceId, SystemTime)>,
    log: RefusalLog,
}

/// How refusals are being logged in the current window.
#[derive(Default)]
pub(super) struct RefusalLog {
    /// When the current window began (`None`: no refusal yet).
    window: Option<Instant>,
    /// Warnings written in it.
    warned: u32,
    /// Refusals of new devices in it that got no warning of their own.
    unlogged: u64,
}

/// What to log about one refusal ([`TrustStore::record_refusal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RefusalNote {
    /// A warning naming the device.
    Warn,
    /// The device was refused a moment ago: nothing to tell.
    Again,
    /// News, but the window's warnings are spent: counted. `summary_at`: the first such in
    /// its window, whose count is to be logged then ([`TrustStore::take_unlogged`]).
    Counted {
        /// When to log the window's count, if this refusal is the first one counted.
        summary_at: Option<Instant>,
    },
}

impl TrustStore {
    /// A store trusting exactly `ids`.
    pub fn new(ids: impl IntoIterator<Item = DeviceId>) -> Self {
        let store = TrustStore::default();
        store.write().trusted.extend(ids);
        store
    }

    /// Trusts `id` from now on (and forgets that it was refused).
    pub fn add(&self, id: DeviceId) {
        let mut inner = self.write();
        inner.trusted.insert(id);
        inner.refused.retain(|(r, _)| *r != id);
    }

    /// Stops trusting `id` for new connections.
    pub fn remove(&self, id: &DeviceId) {
        self.write().trusted.remove(id);
    }

    /// Whether `id` is trusted.
    pub fn contains(&self, id: &DeviceId) -> bool {
        self.read().trusted.contains(id)
    }

    /// Devices refused recently because they are not trusted, most recent first, with the
    /// time of their last attempt (bounded list, one entry per device).
    pub fn refused(&self) -> Vec<(DeviceId, SystemTime)> {
        self.read().refused.iter().copied().collect()
    }

    /// Records a refusal of `id` at `now` (`wall`: the same moment, as shown to people) and
    /// says what to log: a warning when it is news (not refused in the last
    /// [`REFUSAL_WARN_INTERVAL`]) and the window has warnings left, else a count.
    fn record_refusal(&self, id: DeviceId, now: Instant, wall: SystemTime) -> RefusalNote {
        let mut inner = self.write();
        let previous = inner
            .refused
            .iter()
            .position(|(r, _)| *r == id)
            .and_then(|i| inner.refused.remove(i))
            .map(|(_, at)| at);
        inner.refused.push_front((id, wall));
        inner.refused.truncate(REFUSED_CAPACITY);
        let news = previous.is_none_or(|at| {
            wall.duration_since(at)
                .map_or(true, |d| d >= REFUSAL_WARN_INTERVAL)
        });
        if !news {
            return RefusalNote::Again;
        }
        let log = &mut inner.log;
        let start = match log.window {
            Some(start) if now.saturating_duration_since(start) < REFUSAL_LOG_WINDOW => start,
            _ => {
                // A new window; a count left in the old one is logged by its own summary.
                log.window = Some(now);
                log.warned = 0;
                now
            }
        };
        if log.warned < REFUSAL_WARNINGS_PER_WINDOW {
            log.warned += 1;
            return RefusalNote::Warn;
        }
        log.unlogged += 1;
        RefusalNote::Counted {
            summary_at: (log.unlogged == 1).then_some(start + REFUSAL_LOG_WINDOW),
        }
    }

    /// The refusals counted without a warning since the last call, and resets the count.
    fn take_unlogged(&self) -> u64 {
        std::mem::take(&mut self.write().log.unlogged)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, TrustInner> {
        // A panic while holding the lock cannot leave a set half-updated.
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, TrustInner> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }
}

impl std::fmt::Debug for TrustStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.read();
        f.debug_struct("TrustStore")
            .field("trusted", &inner.trusted)
            .field("refused", &inner.refused.len())
            .finish()
    }
}

pub(super) fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| {
            let mut p = rustls::crypto::ring::default_provider();
            // AES-128-GCM first (ring's order puts AES-256 first): every packet is sealed and
            // opened with it, and on a bulk copy each side spends most of a core (D104).
            p.cipher_suites
                .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
            Arc::new(p)
        })
        .clone()
}

pub(super) fn tls_err(e: impl std::fmt::Display) -> TransportError {
    TransportError::Tls(e.to_string())
}

/// QUIC `0x100 + alert` codes by which a TLS stack says it rejected our certificate.
pub(super) fn is_certificate_alert(code: u64) -> bool {
    // bad_certificate 42, unsupported_certificate 43, certificate_revoked 44,
    // certificate_expired 45, certificate_unknown 46, unknown_ca 48, access_denied 49,
    // certificate_required 116.
    matches!(code.checked_sub(0x100), Some(42..=46 | 48 | 49 | 116))
}

/// The device id our [`TrustedClients`] verifier named in a handshake error text.
pub(super) fn refused_device_in(reason: &str) -> Option<DeviceId> {
    let start = reason.find(UNTRUSTED_MARKER)? + UNTRUSTED_MARKER.len();
    let rest = reason.get(start..)?;
    let end = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// The error a verifier returns to refuse a device; its text names the device. rustls puts
/// the `Debug` form into the handshake error, so both forms are the same text.
pub(super) struct Untrusted(DeviceId);

impl std::fmt::Debug for Untrusted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl std::fmt::Display for Untrusted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{UNTRUSTED_MARKER}{} (not in this device's peer list)",
            self.0
        )
    }
}

impl std::error::Error for Untrusted {}

pub(super) fn unparseable_cert(e: impl std::fmt::Display) -> rustls::Error {
    tracing::debug!("peer certificate rejected: {e}");
    rustls::Error::InvalidCertificate(CertificateError::BadEncoding)
}

pub(super) fn tls13_only() -> Result<HandshakeSignatureValid, rustls::Error> {
    Err(rustls::Error::PeerIncompatible(
        rustls::PeerIncompatible::Tls12NotOffered,
    ))
}

/// The listener's check of a dialer: its device id must be in the trust store.
#[derive(Debug)]
pub(super) struct TrustedClients {
    pub(super) trust: TrustStore,
    pub(super) provider: Arc<CryptoProvider>,
}

impl ClientCertVerifier for TrustedClients {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let id = device_id_of_cert(end_entity).map_err(unparseable_cert)?;
        if self.trust.contains(&id) {
            return Ok(ClientCertVerified::assertion());
        }
        match self
            .trust
            .record_refusal(id, Instant::now(), SystemTime::now())
        {
            RefusalNote::Warn => tracing::warn!(
                "refused a connection from unknown device {id}: if it is yours, run `meshfs peer add {id} --addr HOST:PORT` (its address)"
            ),
            RefusalNote::Again => tracing::debug!("refused unknown device {id} again"),
            RefusalNote::Counted { summary_at } => {
                tracing::debug!("refused unknown device {id}");
                if let Some(at) = summary_at {
                    log_unlogged_refusals(self.trust.clone(), at);
                }
            }
        }
        Err(rustls::Error::InvalidCertificate(CertificateError::Other(
            rustls::OtherError(Arc::new(Untrusted(id))),
        )))
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        tls13_only()
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// At `at`, logs in one line how many refusals went without a warning of their own.
pub(super) fn log_unlogged_refusals(trust: TrustStore, at: Instant) {
    // Verifiers run on quinn's tasks, inside the runtime; without one there is no log to
    // keep tidy.
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        tokio::time::sleep_until(at.into()).await;
        let n = trust.take_unlogged();
        if n > 0 {
            tracing::warn!(
                "refused {n} more connections from unknown devices in the last {} s without a line each (a device making a new key for every attempt?); `meshfs status` lists the most recent",
                REFUSAL_LOG_WINDOW.as_secs()
            );
        }
    });
}

/// The dialer's check of a listener: its device id must be the one dialed.
#[derive(Debug)]
pub(super) struct PinnedServer {
    pub(super) expected: DeviceId,
    /// The id the listener presented, for the error message.
    pub(super) presented: Mutex<Option<DeviceId>>,
    pub(super) provider: Arc<CryptoProvider>,
}

impl PinnedServer {
    pub(super) fn presented(&self) -> Option<DeviceId> {
        *self.presented.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ServerCertVerifier for PinnedServer {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let id = device_id_of_cert(end_entity).map_err(unparseable_cert)?;
        *self.presented.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
        if id == self.expected {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        tls13_only()
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aes_128_gcm_is_offered_first_and_the_others_still_follow() {
        let suites: Vec<_> = provider().cipher_suites.iter().map(|s| s.suite()).collect();
        assert_eq!(suites[0], rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
        assert!(suites.contains(&rustls::CipherSuite::TLS13_AES_256_GCM_SHA384));
        assert!(suites.contains(&rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256));
    }

    #[test]
    fn certificate_alerts_are_recognized_as_refusals() {
        assert!(is_certificate_alert(0x12e));
        assert!(is_certificate_alert(0x131));
        assert!(!is_certificate_alert(0x178)); // no_application_protocol
        assert!(!is_certificate_alert(0x0a));
    }

    #[test]
    fn our_refusal_text_names_the_device() {
        let id = DeviceId::from_bytes([9; 32]);
        let text = format!("invalid peer certificate: {}", Untrusted(id));
        assert_eq!(refused_device_in(&text), Some(id));
        let text = format!(
            "invalid peer certificate: Other(OtherError({:?}))",
            Untrusted(id)
        );
        assert_eq!(refused_device_in(&text), Some(id));
        assert_eq!(
            refused_device_in("invalid peer certificate: BadEncoding"),
            None
        );
    }

    #[test]
    fn refusals_are_bounded_and_most_recent_first() {
        let trust = TrustStore::default();
        let (now, wall) = (Instant::now(), SystemTime::now());
        for i in 0..40u8 {
            let note = trust.record_refusal(DeviceId::from_bytes([i; 32]), now, wall);
            assert_ne!(note, RefusalNote::Again);
        }
        assert_eq!(
            trust.record_refusal(DeviceId::from_bytes([39; 32]), now, wall),
            RefusalNote::Again
        );
        let refused = trust.refused();
        assert_eq!(refused.len(), REFUSED_CAPACITY);
        assert_eq!(refused[0].0, DeviceId::from_bytes([39; 32]));
        trust.add(DeviceId::from_bytes([39; 32]));
        assert_eq!(trust.refused().len(), REFUSED_CAPACITY - 1);
    }

    #[test]
    fn a_device_with_a_new_key_every_time_gets_a_few_warnings_and_a_count() {
        let trust = TrustStore::default();
        let start = Instant::now();
        let wall = SystemTime::now();
        let refuse = |i: u32, at: Duration| {
            let mut id = [0u8; 32];
            id[..4].copy_from_slice(&i.to_be_bytes());
            trust.record_refusal(DeviceId::from_bytes(id), start + at, wall + at)
        };
        let notes: Vec<RefusalNote> = (0..10_000)
            .map(|i| refuse(i, Duration::from_millis(u64::from(i))))
            .collect();
        let warned = notes.iter().filter(|n| **n == RefusalNote::Warn).count();
        assert_eq!(warned, REFUSAL_WARNINGS_PER_WINDOW as usize);
        let summaries: Vec<Instant> = notes
            .iter()
            .filter_map(|n| match n {
                RefusalNote::Counted { summary_at } => *summary_at,
                _ => None,
            })
            .collect();
        // One summary for the window, at its end, counting everything past the warnings.
        assert_eq!(summaries, vec![start + REFUSAL_LOG_WINDOW]);
        assert_eq!(trust.take_unlogged(), 10_000 - warned as u64);
        assert_eq!(trust.take_unlogged(), 0);
        assert_eq!(trust.refused().len(), REFUSED_CAPACITY);
        // The next window may warn again.
        assert_eq!(refuse(20_000, REFUSAL_LOG_WINDOW * 2), RefusalNote::Warn);
    }
}
