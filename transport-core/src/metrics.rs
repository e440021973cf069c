//! Per-connection counters, cheap enough for the data path (relaxed atomics).

use std::ops::Sub;
use std::sync::atomic::{AtomicU64, Ordering};

/// A monotonically increasing counter.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`.
    #[inline]
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    /// Adds one.
    #[inline]
    pub fn incr(&self) {
        self.add(1);
    }
    /// Current value.
    #[inline]
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A gauge of a current level that remembers its maximum.
#[derive(Debug, Default)]
pub struct LevelGauge {
    current: AtomicU64,
    max: AtomicU64,
    samples: AtomicU64,
    sum: AtomicU64,
}

impl LevelGauge {
    /// Raises the level by one and samples it (for the mean and the maximum).
    #[inline]
    pub fn enter(&self) {
        let now = self.current.fetch_add(1, Ordering::Relaxed) + 1;
        // Read first: a level under the maximum (almost every time) costs no locked update.
        if now > self.max.load(Ordering::Relaxed) {
            self.max.fetch_max(now, Ordering::Relaxed);
        }
        self.samples.fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(now, Ordering::Relaxed);
    }
    /// Lowers the level by one.
    #[inline]
    pub fn exit(&self) {
        self.current.fetch_sub(1, Ordering::Relaxed);
    }
    /// Current level.
    pub fn current(&self) -> u64 {
        self.current.load(Ordering::Relaxed)
    }
    /// Highest level seen.
    pub fn max(&self) -> u64 {
        self.max.load(Ordering::Relaxed)
    }
}

/// Counters of one connection (both directions), shared by its halves and the RPC layer.
///
/// Backends count what they do; `bench` turns the deltas into its diagnosis
/// (copies per byte, syscalls or doorbells per message, registrations per call, ...).
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct Metrics {
    /// Messages handed to the peer.
    pub messages_sent: Counter,
    /// Messages received from the peer.
    pub messages_received: Counter,
    /// Bytes written to the wire, framing included.
    pub bytes_sent: Counter,
    /// Bytes read from the wire, framing included.
    pub bytes_received: Counter,
    /// Payload bytes the transport copied in user space (staging, bounce buffers).
    pub payload_bytes_copied: Counter,
    /// System calls made: reads and writes (socket backends); arming the completion channel
    /// and reading its events (verbs: the cost of sleeping instead of polling).
    pub syscalls: Counter,
    /// Doorbells rung (verbs: post_send / post_recv calls).
    pub doorbells: Counter,
    /// Memory registrations made (verbs).
    pub registrations: Counter,
    /// Work completions polled (verbs).
    pub completions: Counter,
    /// Times a sender waited for credits (verbs).
    pub credit_stalls: Counter,
    /// Times a sender waited because the peer had as many large (rendezvous) messages
    /// outstanding as it accepts (verbs).
    pub rendezvous_stalls: Counter,
    /// Received messages handed from one task to another, each a task wake-up on the way:
    /// verbs counts those its connection's driver took from the device while the receiving
    /// half was not polling it itself; the RPC client counts replies that one waiting call
    /// read and handed over to another (a lone call reads its own: none).
    pub handoffs: Counter,
    /// RPC calls in flight on this connection (maintained by the RPC client).
    pub in_flight: LevelGauge,
}

impl Metrics {
    /// A plain copy of every counter, for differences between two points in time.
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            messages_sent: self.messages_sent.get(),
            messages_received: self.messages_received.get(),
            bytes_sent: self.bytes_sent.get(),
            bytes_received: self.bytes_received.get(),
            payload_bytes_copied: self.payload_bytes_copied.get(),
            syscalls: self.syscalls.get(),
            doorbells: self.doorbells.get(),
            registrations: self.registrations.get(),
            completions: self.completions.get(),
            credit_stalls: self.credit_stalls.get(),
            rendezvous_stalls: self.rendezvous_stalls.get(),
            handoffs: self.handoffs.get(),
            in_flight_max: self.in_flight.max(),
            in_flight_samples: self.in_flight.samples.load(Ordering::Relaxed),
            in_flight_sum: self.in_flight.sum.load(Ordering::Relaxed),
        }
    }
}

/// A point-in-time copy of [`Metrics`]. Subtract two to get the activity between them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MetricsSnapshot {
    /// See [`Metrics::messages_sent`].
    pub messages_sent: u64,
    /// See [`Metrics::messages_received`].
    pub messages_received: u64,
    /// See [`Metrics::bytes_sent`].
    pub bytes_sent: u64,
    /// See [`Metrics::bytes_received`].
    pub bytes_received: u64,
    /// See [`Metrics::payload_bytes_copied`].
    pub payload_bytes_copied: u64,
    /// See [`Metrics::syscalls`].
    pub syscalls: u64,
    /// See [`Metrics::doorbells`].
    pub doorbells: u64,
    /// See [`Metrics::registrations`].
    pub registrations: u64,
    /// See [`Metrics::completions`].
    pub completions: u64,
    /// See [`Metrics::credit_stalls`].
    pub credit_stalls: u64,
    /// See [`Metrics::rendezvous_stalls`].
    pub rendezvous_stalls: u64,
    /// See [`Metrics::handoffs`].
    pub handoffs: u64,
    /// Highest number of RPC calls in flight (not a difference: the later snapshot's value).
    pub in_flight_max: u64,
    /// Number of in-flight samples (one per call started).
    pub in_flight_samples: u64,
    /// Sum of the in-flight level over the samples.
    pub in_flight_sum: u64,
}

impl MetricsSnapshot {
    /// Mean number of calls in flight when a call started (0 when none started).
    pub fn mean_in_flight(&self) -> f64 {
        if self.in_flight_samples == 0 {
            0.0
        } else {
            self.in_flight_sum as f64 / self.in_flight_samples as f64
        }
    }

    /// Adds every counter of `other` (for totals over several connections).
    pub fn accumulate(&mut self, other: &MetricsSnapshot) {
        self.messages_sent += other.messages_sent;
        self.messages_received += other.messages_received;
        self.bytes_sent += other.bytes_sent;
        self.bytes_received += other.bytes_received;
        self.payload_bytes_copied += other.payload_bytes_copied;
        self.syscalls += other.syscalls;
        self.doorbells += other.doorbells;
        self.registrations += other.registrations;
        self.completions += other.completions;
        self.credit_stalls += other.credit_stalls;
        self.rendezvous_stalls += other.rendezvous_stalls;
        self.handoffs += other.handoffs;
        self.in_flight_max = self.in_flight_max.max(other.in_flight_max);
        self.in_flight_samples += other.in_flight_samples;
        self.in_flight_sum += other.in_flight_sum;
    }
}

impl Sub for MetricsSnapshot {
    type Output = MetricsSnapshot;
    fn sub(self, earlier: MetricsSnapshot) -> MetricsSnapshot {
        MetricsSnapshot {
            messages_sent: self.messages_sent.saturating_sub(earlier.messages_sent),
            messages_received: self
                .messages_received
                .saturating_sub(earlier.messages_received),
            bytes_sent: self.bytes_sent.saturating_sub(earlier.bytes_sent),
            bytes_received: self.bytes_received.saturating_sub(earlier.bytes_received),
            payload_bytes_copied: self
                .payload_bytes_copied
                .saturating_sub(earlier.payload_bytes_copied),
            syscalls: self.syscalls.saturating_sub(earlier.syscalls),
            doorbells: self.doorbells.saturating_sub(earlier.doorbells),
            registrations: self.registrations.saturating_sub(earlier.registrations),
            completions: self.completions.saturating_sub(earlier.completions),
            credit_stalls: self.credit_stalls.saturating_sub(earlier.credit_stalls),
            rendezvous_stalls: self
                .rendezvous_stalls
                .saturating_sub(earlier.rendezvous_stalls),
            handoffs: self.handoffs.saturating_sub(earlier.handoffs),
            in_flight_max: self.in_flight_max,
            in_flight_samples: self
                .in_flight_samples
                .saturating_sub(earlier.in_flight_samples),
            in_flight_sum: self.in_flight_sum.saturating_sub(earlier.in_flight_sum),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauge_tracks_max_and_mean() {
        let m = Metrics::default();
        m.in_flight.enter();
        m.in_flight.enter();
        m.in_flight.exit();
        m.in_flight.enter();
        let s = m.snapshot();
        assert_eq!(s.in_flight_max, 2);
        assert_eq!(m.in_flight.current(), 2);
        // samples: 1, 2, 2
        assert!((s.mean_in_flight() - 5.0 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn snapshot_difference() {
        let m = Metrics::default();
        m.bytes_sent.add(10);
        let a = m.snapshot();
        m.bytes_sent.add(32);
        m.syscalls.incr();
        let d = m.snapshot() - a;
        assert_eq!(d.bytes_sent, 32);
        assert_eq!(d.syscalls, 1);
        assert_eq!(d.messages_sent, 0);
    }
}
