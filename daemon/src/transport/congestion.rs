//! Congestion control: which controller an endpoint's connections use, the window from the
//! measured delivery rate (meshfs's default, D29) and quinn's BBR held to a least window. It
//! never sees a packet's content, only quinn's congestion callbacks.

use super::*;

/// Congestion controller of an endpoint's connections.
///
/// Chosen by measurement (`daemon/tests/transport.rs`, release build, 2 loaded cores, 8
/// streams of 1 MiB frames, through a userspace relay on 127.0.0.1 that adds 45 ms each way
/// behind a rate-limited drop-tail queue of one bandwidth-delay product, like `bench/netdelay`):
///
/// | link | Cubic | BBR |
/// |---|---|---|
/// | 100 Mbit/s, no random loss | 10.5 MB/s, 1.08× bytes sent | 11.0 MB/s, 1.95× bytes sent |
/// | 250 Mbit/s, no random loss | 19.0 MB/s | 19.5 MB/s |
/// | 1 Gbit/s, no random loss (CPU-bound) | 43–46 MB/s | 36–58 MB/s |
/// | 100 Mbit/s, 0.01 % random loss | 8.6 MB/s | 9.7 MB/s |
/// | 100 Mbit/s, 0.1 % random loss | 0.6–0.7 MB/s | 10.8 MB/s |
/// | 100 Mbit/s, 0.5 % random loss | 0.3 MB/s | 10.2 MB/s |
///
/// Without random loss the two deliver the same; with the small random loss of Wi-Fi and long
/// paths Cubic collapses at 90 ms (as loss-based control must: rate ∝ 1/(RTT·√p)) while BBR
/// keeps the link full. BBR's cost is retransmission overhead when it overfills a shallow
/// queue (up to 2× the bytes on the wire at 100 Mbit/s). quinn marks its BBR experimental,
/// so Cubic stays one setting away.
///
/// The window from the delivery rate ([`CongestionControl::Rate`], D29) keeps BBR's loss
/// tolerance without that cost (`transport_rate --relay`, 64 MiB, 100 Mbit/s × 90 ms):
///
/// | link | Cubic | BBR | Rate |
/// |---|---|---|---|
/// | no random loss | 10.8 MB/s, 5.9 % of the payload lost | 10.6 MB/s, 101 % lost | 11.5 MB/s, 0.0 % |
/// | 0.1 % random loss | 0.7 MB/s | 10.5 MB/s, 103 % lost | 11.5 MB/s, 0.1 % |
///
/// and on the bench's wan (1 Gbit/s × 90 ms through `bench/netdelay`) one 512 MiB file dropped
/// 0.3 % of its bytes against quinn's BBR's 57 % (`bench/README.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CongestionControl {
    /// RFC 8312 Cubic (quinn's default controller).
    Cubic,
    /// quinn's BBR (v1, marked experimental by quinn) held to a least window
    /// ([`FlooredBbr`]): the default until the window from the delivery rate replaced it.
    Bbr,
    /// A window of gain × the measured delivery rate × min RTT ([`RateWindowConfig`]): BBR's
    /// model, loss-tolerant like BBR, without quinn's BBR's overshoot. meshfs's default.
    #[default]
    Rate,
}

/// quinn's BBR with a least congestion window. BBR sets its window to gain × bandwidth × min
/// RTT; where the min RTT is tens of microseconds (a LAN, loopback) that is a few packets, and
/// quinn's bandwidth samples, clocked by the peer's ACKs, then barely grow it. Measured on
/// loopback, the window fell from 240 KB to 5,808 bytes (four packets) as the first index batch
/// went out and stayed there ~200 ms: 3.6 MB took 230–270 ms to arrive, 50–90 ms with a 256 KiB
/// floor. Wherever bandwidth × RTT is above the floor (1 Gbit/s × 90 ms is 11 MB) BBR's own
/// window rules; on a slow long path the floor may queue up to itself at the bottleneck.
pub(super) struct FlooredBbr {
    pub(super) floor: u64,
    pub(super) inner: Arc<quinn::congestion::BbrConfig>,
}

impl quinn::congestion::ControllerFactory for FlooredBbr {
    fn build(
        self: Arc<Self>,
        now: std::time::Instant,
        current_mtu: u16,
    ) -> Box<dyn quinn::congestion::Controller> {
        Box::new(Floored {
            floor: self.floor,
            inner: self.inner.clone().build(now, current_mtu),
        })
    }
}

/// One connection's [`FlooredBbr`] controller.
pub(super) struct Floored {
    floor: u64,
    inner: Box<dyn quinn::congestion::Controller>,
}

impl quinn::congestion::Controller for Floored {
    fn on_sent(&mut self, now: std::time::Instant, bytes: u64, last_packet_number: u64) {
        self.inner.on_sent(now, bytes, last_packet_number)
    }
    fn on_ack(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &quinn_proto::RttEstimator,
    ) {
        self.inner.on_ack(now, sent, bytes, app_limited, rtt)
    }
    fn on_end_acks(
        &mut self,
        now: std::time::Instant,
        in_flight: u64,
        app_limited: bool,
        largest_packet_num_acked: Option<u64>,
    ) {
        self.inner
            .on_end_acks(now, in_flight, app_limited, largest_packet_num_acked)
    }
    fn on_congestion_event(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        self.inner
            .on_congestion_event(now, sent, is_persistent_congestion, lost_bytes)
    }
    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.inner.on_mtu_update(new_mtu)
    }
    fn window(&self) -> u64 {
        self.inner.window().max(self.floor)
    }
    fn clone_box(&self) -> Box<dyn quinn::congestion::Controller> {
        Box::new(Floored {
            floor: self.floor,
            inner: self.inner.clone_box(),
        })
    }
    fn initial_window(&self) -> u64 {
        self.inner.initial_window()
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

/// A congestion window from the delivery rate: gain × the most the path delivered in the last
/// ten round trips × min RTT (at least [`BDP_LEAST_RTT`]), never below a floor. BBR's model (v1) without its pacing gains,
/// which quinn does not apply anyway: quinn paces by window ÷ smoothed RTT.
///
/// Why not quinn's BBR ([`FlooredBbr`], still selectable): its bandwidth samples are the rate
/// between two consecutive sends or ACKs, so the max filter takes the fastest burst for the
/// path; its window is 2.885 × that in startup (which goes on for three rounds after the link
/// is full) and 2 × plus the ACK aggregation it saw after, with no reduction on loss outside
/// recovery. Through the bench's 1 Gbit/s × 90 ms drop-tail queue of one bandwidth-delay
/// product it overfilled the queue all along (57 % of the bytes it delivered were dropped and
/// sent again, run `2026-11-25_213643`); and a window held at the floor for a few rounds made
/// it end startup early and creep up for a second.
///
/// Here each acknowledged packet gives a sample as BBR's do (bytes delivered while it was in
/// flight over the longer of its send and ACK intervals, at least a min RTT; see
/// [`DeliveryRate`]). While the rate grows by 25 % a round the window is [`STARTUP_GAIN`] × BDP
/// (slow start: it doubles each round, but never past twice what the path delivers); after
/// three rounds without, or at the first loss, [`STEADY_GAIN`] × BDP, which keeps a link full
/// with half a BDP queued, and still grows by half a round when the path allows more. Loss
/// alone does not shrink the window (random loss on long paths would starve a loss-based
/// controller, see [`CongestionControl`]); persistent congestion starts the measurement over.
/// The floor: where the min RTT is tens of microseconds (a LAN, loopback) gain × BDP is a few
/// packets; quinn's BBR, held there, took 230–270 ms to move a 3.6 MB index batch on loopback
/// (50–90 ms with a 256 KiB floor, D20).
pub(super) struct RateWindowConfig {
    pub(super) floor: u64,
}

/// Window gain over the measured bandwidth-delay product while the delivery rate still grows.
pub const STARTUP_GAIN: f64 = 2.0;
/// Window gain once the delivery rate stopped growing.
pub const STEADY_GAIN: f64 = 1.5;

impl quinn::congestion::ControllerFactory for RateWindowConfig {
    fn build(
        self: Arc<Self>,
        _now: std::time::Instant,
        _current_mtu: u16,
    ) -> Box<dyn quinn::congestion::Controller> {
        Box::new(RateWindow {
            floor: self.floor,
            rate: DeliveryRate::default(),
        })
    }
}

/// One connection's [`RateWindowConfig`] controller.
#[derive(Clone)]
pub(super) struct RateWindow {
    floor: u64,
    rate: DeliveryRate,
}

impl quinn::congestion::Controller for RateWindow {
    fn on_sent(&mut self, now: std::time::Instant, _bytes: u64, _last_packet_number: u64) {
        self.rate.on_sent(now);
    }
    fn on_ack(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &quinn_proto::RttEstimator,
    ) {
        self.rate.on_ack(now, sent, bytes, app_limited, rtt.min());
    }
    fn on_congestion_event(
        &mut self,
        _now: std::time::Instant,
        _sent: std::time::Instant,
        is_persistent_congestion: bool,
        _lost_bytes: u64,
    ) {
        if is_persistent_congestion {
            // Nothing got through for several RTOs: the path is not the one measured.
            self.rate = DeliveryRate::default();
        } else {
            self.rate.on_loss();
        }
    }
    fn on_mtu_update(&mut self, _new_mtu: u16) {}
    fn window(&self) -> u64 {
        self.rate.window().unwrap_or(0).max(self.floor)
    }
    fn clone_box(&self) -> Box<dyn quinn::congestion::Controller> {
        Box::new(self.clone())
    }
    fn initial_window(&self) -> u64 {
        self.floor
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

/// Rounds the delivery rate's maximum is kept over (BBR's bandwidth filter: ten rounds).
pub(super) const RATE_ROUNDS: usize = 10;
/// Rounds without 25 % more delivery rate after which the rate counts as found (BBR's
/// startup exit).
pub(super) const RATE_FLAT_ROUNDS: u32 = 3;
/// Least RTT the bandwidth-delay product is taken over. A LAN's idle min RTT (tens of
/// microseconds) is not what a loaded transfer sees: the receiver's ACK delay and processing add
/// milliseconds, and a window of gain × rate × 60 µs sat at the floor. With this, one 512 MiB
/// file on the bench's lan took 1.75 s (1.68–1.76) instead of 1.96 s (1.89–1.97), as with
/// quinn's BBR (1.74 s; runs `2026-11-25_224238`, `_223442`, `_223655`); 2 ms gave 1.81 s. Paths
/// whose min RTT is above it (any WAN) are not affected.
pub(super) const BDP_LEAST_RTT: Duration = Duration::from_millis(5);
/// Sends closer together than this share one snapshot of the delivery state.
pub(super) const SNAPSHOT_EVERY: Duration = Duration::from_micros(100);
/// Most snapshots kept (at [`SNAPSHOT_EVERY`], 0.8 s of sending: longer flights give no sample).
pub(super) const MAX_SNAPSHOTS: usize = 8192;

/// The delivery state when a packet was sent (BBR's per-packet `delivered`,
/// `delivered_time` and `first_sent_time`), kept per [`SNAPSHOT_EVERY`] of sending.
#[derive(Clone, Copy)]
pub(super) struct Snapshot {
    at: std::time::Instant,
    delivered: u64,
    delivered_at: std::time::Instant,
    first_sent: std::time::Instant,
}

/// The delivery rate of a connection, sampled per acknowledged packet as BBR does (bytes
/// delivered while the packet was in flight, over the longer of its send and ACK intervals, so
/// a burst of late ACKs does not look like a faster path), the most of the last
/// [`RATE_ROUNDS`] round trips; a sample taken while the sender ran out of data counts only if
/// it raises the maximum.
#[derive(Clone, Default)]
pub(super) struct DeliveryRate {
    /// Bytes acknowledged so far, when the last was, and when the packet it acknowledged was
    /// sent.
    delivered: u64,
    delivered_at: Option<std::time::Instant>,
    first_sent: Option<std::time::Instant>,
    sends: std::collections::VecDeque<Snapshot>,
    min_rtt: Duration,
    /// The current round trip ends with the ACK of a packet sent at or after this.
    round_start: Option<std::time::Instant>,
    /// Most of the current round, and whether the sender ran out of data in it.
    round_max: u64,
    round_app_limited: bool,
    /// Most of each of the last rounds, a ring.
    rounds: [u64; RATE_ROUNDS],
    next: usize,
    /// The rate the growth check compares with, and rounds since it last grew by 25 %.
    grown_to: u64,
    flat: u32,
}

impl DeliveryRate {
    fn on_sent(&mut self, now: std::time::Instant) {
        if self
            .sends
            .back()
            .is_some_and(|b| now.saturating_duration_since(b.at) < SNAPSHOT_EVERY)
        {
            return;
        }
        if self.sends.len() >= MAX_SNAPSHOTS {
            self.sends.pop_front();
        }
        self.sends.push_back(Snapshot {
            at: now,
            delivered: self.delivered,
            delivered_at: self.delivered_at.unwrap_or(now),
            first_sent: self.first_sent.unwrap_or(now),
        });
    }

    fn on_ack(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        bytes: u64,
        app_limited: bool,
        min_rtt: Duration,
    ) {
        self.min_rtt = min_rtt;
        self.delivered += bytes;
        self.delivered_at = Some(now);
        self.first_sent = Some(sent);
        self.round_app_limited |= app_limited;
        // The newest snapshot taken at or before this packet's send.
        while self.sends.len() >= 2 && self.sends[1].at <= sent {
            self.sends.pop_front();
        }
        if let Some(snap) = self.sends.front().filter(|s| s.at <= sent) {
            let interval = sent
                .saturating_duration_since(snap.first_sent)
                .max(now.saturating_duration_since(snap.delivered_at));
            // Shorter than a round trip, a sample measures a burst, not the path.
            if !min_rtt.is_zero() && interval >= min_rtt {
                let rate =
                    ((self.delivered - snap.delivered) as f64 / interval.as_secs_f64()) as u64;
                if !app_limited || rate > self.max() {
                    self.round_max = self.round_max.max(rate);
                }
            }
        }
        match self.round_start {
            None => self.round_start = Some(now),
            Some(start) if sent >= start => self.end_round(now),
            Some(_) => {}
        }
    }

    fn end_round(&mut self, now: std::time::Instant) {
        // A round in which the sender ran short of data says nothing of the path unless it
        // delivered more: the filter ages only with rounds that measured it (as BBR's does, so
        // an idle connection keeps its estimate).
        if !self.round_app_limited
            || self.round_max > self.rounds.iter().copied().max().unwrap_or(0)
        {
            self.rounds[self.next] = self.round_max;
            self.next = (self.next + 1) % RATE_ROUNDS;
        }
        if !self.round_app_limited {
            let max = self.max();
            if max as f64 >= self.grown_to as f64 * 1.25 {
                self.grown_to = max;
                self.flat = 0;
            } else {
                self.flat = self.flat.saturating_add(1);
            }
        }
        self.round_max = 0;
        self.round_app_limited = false;
        self.round_start = Some(now);
    }

    /// Bytes per second (0: not measured yet).
    fn max(&self) -> u64 {
        self.rounds
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(self.round_max)
    }

    /// Whether the rate still grows (startup).
    fn growing(&self) -> bool {
        self.flat < RATE_FLAT_ROUNDS
    }

    /// A loss ends startup (as it does BBR's): the window had outgrown the path's queue.
    fn on_loss(&mut self) {
        self.flat = self.flat.max(RATE_FLAT_ROUNDS);
    }

    /// The window: [`STARTUP_GAIN`] × the measured bandwidth-delay product while the rate
    /// grows, [`STEADY_GAIN`] × once it stopped (`None`: no measurement yet).
    fn window(&self) -> Option<u64> {
        let max = self.max();
        if max == 0 {
            return None;
        }
        let gain = if self.growing() {
            STARTUP_GAIN
        } else {
            STEADY_GAIN
        };
        let rtt = self.min_rtt.max(BDP_LEAST_RTT);
        Some((max as f64 * rtt.as_secs_f64() * gain) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drives `rate` with 1,000-byte packets every `gap`, each acknowledged `rtt` after it was
    /// sent, from `from` for `dur`; `app_limited` as quinn would report it. Returns the end.
    fn drive(
        rate: &mut DeliveryRate,
        from: std::time::Instant,
        dur: Duration,
        gap: Duration,
        rtt: Duration,
        app_limited: bool,
    ) -> std::time::Instant {
        let mut now = from;
        while now < from + dur {
            rate.on_sent(now);
            if now >= from + rtt {
                rate.on_ack(now, now - rtt, 1000, app_limited, rtt);
            }
            now += gap;
        }
        now
    }

    #[test]
    fn the_rate_window_is_one_and_a_half_measured_bdps_once_the_rate_stops_growing() {
        let t0 = std::time::Instant::now();
        let rtt = Duration::from_millis(50);
        let mut rate = DeliveryRate::default();
        assert_eq!(rate.window(), None, "nothing measured yet");
        // 1,000 bytes every 100 µs: 10 MB/s, a BDP of 500,000 bytes.
        let now = drive(
            &mut rate,
            t0,
            rtt * 2,
            Duration::from_micros(100),
            rtt,
            false,
        );
        assert!(
            rate.growing(),
            "one round in, the rate has not stopped growing"
        );
        let w = rate.window().expect("measured") as f64;
        assert!(
            (w - 1_000_000.0).abs() < 50_000.0,
            "startup: 2 BDPs, got {w}"
        );
        drive(
            &mut rate,
            now,
            rtt * 10,
            Duration::from_micros(100),
            rtt,
            false,
        );
        assert!(!rate.growing());
        let w = rate.window().expect("measured") as f64;
        assert!(
            (w - 750_000.0).abs() < 37_500.0,
            "steady: 1.5 BDPs, got {w}"
        );
    }

    #[test]
    fn on_a_lan_the_bdp_is_taken_over_at_least_five_milliseconds() {
        let t0 = std::time::Instant::now();
        let rtt = Duration::from_micros(100);
        let mut rate = DeliveryRate::default();
        // 1,000 bytes every 10 µs (100 MB/s) for 100 round trips: steady.
        drive(
            &mut rate,
            t0,
            rtt * 100,
            Duration::from_micros(10),
            rtt,
            false,
        );
        assert!(!rate.growing());
        let w = rate.window().expect("measured") as f64;
        // 1.5 × 100 MB/s × 5 ms, not × 100 µs.
        assert!((w - 750_000.0).abs() < 75_000.0, "got {w}");
    }

    #[test]
    fn a_loss_ends_startup_and_a_slower_idle_sender_keeps_the_estimate() {
        let t0 = std::time::Instant::now();
        let rtt = Duration::from_millis(50);
        let mut rate = DeliveryRate::default();
        let now = drive(
            &mut rate,
            t0,
            rtt * 2,
            Duration::from_micros(100),
            rtt,
            false,
        );
        assert!(rate.growing());
        rate.on_loss();
        assert!(!rate.growing());
        let steady = rate.window().expect("measured");
        // Twenty round trips at a tenth of the rate, short of data: the estimate stays.
        drive(
            &mut rate,
            now,
            rtt * 20,
            Duration::from_millis(1),
            rtt,
            true,
        );
        assert_eq!(rate.window(), Some(steady));
    }

    #[test]
    fn the_rate_window_never_falls_below_the_floor() {
        use quinn::congestion::ControllerFactory;
        let now = std::time::Instant::now();
        let c = Arc::new(RateWindowConfig { floor: 256 << 10 }).build(now, 1200);
        assert_eq!(c.window(), 256 << 10);
        assert_eq!(c.initial_window(), 256 << 10);
        assert_eq!(c.clone_box().window(), 256 << 10);
    }

    #[test]
    fn bbr_window_never_falls_below_the_floor() {
        use quinn::congestion::{Controller, ControllerFactory};
        let now = std::time::Instant::now();
        let bbr = |floor| {
            Arc::new(FlooredBbr {
                floor,
                inner: Arc::new(quinn::congestion::BbrConfig::default()),
            })
            .build(now, 1200)
        };
        let plain: Box<dyn Controller> = bbr(0);
        let initial = plain.window();
        assert!(initial > 0 && initial < 1 << 20);
        assert_eq!(bbr(1 << 20).window(), 1 << 20, "a floor above BBR's window");
        assert_eq!(bbr(1).window(), initial, "BBR's window above the floor");
        assert_eq!(bbr(1 << 20).clone_box().window(), 1 << 20);
    }
}
