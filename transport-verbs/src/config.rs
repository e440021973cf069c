//! The transport's settings, and what they make of a connection: its engine's limits and its
//! capabilities.

use std::time::Duration;

use transport_core::{Capabilities, MAX_HEADER_LEN};

use crate::engine;
use crate::error::VerbsError;
use crate::proto;

/// Default of [`VerbsConfig::poll_spin`] (see the crate docs' defaults).
pub const DEFAULT_POLL_SPIN: Duration = Duration::from_millis(10);

/// Default of [`VerbsConfig::poll_together_from`]
/// (docs/notes/2026-12-04-scenarios-polled-together.md).
pub const DEFAULT_POLL_TOGETHER_FROM: usize = 128;

/// How rendezvous payloads are exposed to the peer's RDMA READ ([`VerbsConfig::exposure`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Exposure {
    /// Memory windows where a type-2 window binds on the device, else registrations (see
    /// [`crate::Paths::choose`]).
    #[default]
    Auto,
    /// Type-2 memory windows, bound to the connection's queue pair for one payload; on a
    /// device without them every rendezvous fails.
    MemoryWindow,
    /// A registration of exactly the payload, remote read only, for the transfer; each
    /// connection then has a protection domain of its own (so no other connection's queue pair
    /// can use the key) and its own receive buffers.
    Registration,
}

/// The environment variable that overrides [`VerbsConfig::exposure`]'s default: `auto`,
/// `window` or `registration` (as `UCX_TLS` or `FI_PROVIDER` choose paths without code
/// changes). An unknown value makes [`VerbsConfig::validate`] fail.
pub const EXPOSURE_ENV: &str = "TRANSPORT_VERBS_EXPOSURE";

impl Exposure {
    /// The exposure [`EXPOSURE_ENV`] names, `Auto` when it is unset; an error for an unknown
    /// value.
    pub fn from_env() -> Result<Exposure, String> {
        match std::env::var(EXPOSURE_ENV) {
            Ok(v) => v.parse().map_err(|e| format!("{EXPOSURE_ENV}: {e}")),
            Err(_) => Ok(Exposure::Auto),
        }
    }
}

impl std::str::FromStr for Exposure {
    type Err = String;

    /// `auto`, `window` (or `memory-window`), `registration`.
    fn from_str(s: &str) -> Result<Exposure, String> {
        match s {
            "auto" => Ok(Exposure::Auto),
            "window" | "memory-window" => Ok(Exposure::MemoryWindow),
            "registration" => Ok(Exposure::Registration),
            other => Err(format!(
                "unknown exposure `{other}` (auto, window, registration)"
            )),
        }
    }
}

/// Settings of the verbs transport. Both sides may differ: buffer sizes are exchanged.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct VerbsConfig {
    /// Largest message (header + payload) accepted, in bytes.
    pub max_message_size: usize,
    /// Largest payload sent eagerly (SEND into a posted buffer); above it: rendezvous.
    pub eager_limit: usize,
    /// Messages a peer may have in flight towards this side on one connection: the credits
    /// granted to it. With a shared receive queue (`srq_depth` > 0) this is a quota over the
    /// device's shared buffers; without one, each connection posts this many buffers.
    pub recv_depth: usize,
    /// Receive buffers (of `recv_buf_size()` bytes) the device's shared receive queue starts
    /// with, used by every connection of the transport on that device, so receive memory
    /// follows the messages in flight, not the credits of every connection. The queue may
    /// hold fewer buffers than the
    /// credits of all connections together: when a burst finds it empty the sender's device
    /// retries a moment later (an RNR retry, counted by the device, never a loss), and the
    /// queue grows (see `srq_max_depth`). 0: every connection posts `recv_depth` buffers of
    /// its own (and one spare) instead. Under a finite `RLIMIT_MEMLOCK` (without
    /// `CAP_IPC_LOCK`) the queue gets fewer buffers when these would not fit in half of the
    /// limit (at least 4).
    pub srq_depth: usize,
    /// Most buffers the shared receive queue grows to. Its depth doubles, up to this, each
    /// time it runs low (fewer than a quarter of its buffers posted: its low-water event) and
    /// when a connection is made while it holds fewer than two buffers per connection (a
    /// thousand clients that connect and then call together find it grown). It does not
    /// shrink while the
    /// transport lives. Values up to `srq_depth` (0 included) keep the queue at `srq_depth`;
    /// the same locked-memory rule applies as to `srq_depth`. Every connection's completion
    /// queue has room for this many receives.
    pub srq_max_depth: usize,
    /// Send queue depth (work requests in flight, including RDMA READs).
    pub send_depth: usize,
    /// Inline data requested from the device (0 disables inline sends).
    pub inline_size: usize,
    /// Received eager payloads of at least this size are handed over in place (zero copy);
    /// smaller ones are copied out so their receive buffer is re-posted at once.
    pub zero_copy_recv_min: usize,
    /// Size of one RDMA READ of a rendezvous transfer.
    pub rendezvous_chunk: usize,
    /// RDMA READs in flight per connection (sends queued behind them wait for at most this many).
    /// Also bounded by the READs the peer's queue pair serves at once (its `read_depth`).
    pub rendezvous_window: usize,
    /// RDMA READs a queue pair keeps outstanding on the wire and serves at once as their
    /// target (`max_rd_atomic` and `max_dest_rd_atomic`), within the device's limits
    /// (`max_qp_init_rd_atom`, `max_qp_rd_atom`; rxe: 128). Announced to the peer in HELLO,
    /// which keeps no more READs in flight towards this side. 1..=255.
    pub read_depth: usize,
    /// Incoming rendezvous transfers (large messages) a peer may have outstanding on one
    /// connection, announced to it; a peer that sends more breaks the protocol. Bounds the
    /// READ targets this side allocates for a peer (with `max_rendezvous_in_bytes`).
    pub max_rendezvous_in: usize,
    /// Bytes of incoming rendezvous transfers a peer may have outstanding (announced, in whole
    /// KiB); one transfer up to `max_message_size` is always allowed.
    pub max_rendezvous_in_bytes: usize,
    /// Outgoing rendezvous payloads exposed to the peer and not yet acknowledged, at most (the
    /// peer's announced limit may be lower). The next large send waits (`rendezvous_stalls`).
    pub max_rendezvous_out: usize,
    /// Received payload bytes the application may leave untaken before this side stops
    /// returning credits (and stops reading rendezvous payloads): the peer then waits.
    /// Received messages are also limited to `4 × recv_depth`.
    pub receive_backlog_bytes: usize,
    /// Time the peer has to send its HELLO after the connection is established.
    pub handshake_timeout: Duration,
    /// Time the peer has to acknowledge (FIN) an outstanding rendezvous payload, counted from
    /// its last FIN: a peer that stops acknowledging fails the connection instead of pinning
    /// the payloads forever.
    pub rendezvous_timeout: Duration,
    /// Bytes of user memory kept registered by the registration cache.
    pub registration_cache_bytes: usize,
    /// Bytes of idle registered buffers the pool keeps for reuse.
    pub pool_keep_bytes: usize,
    /// Always spin on the completion queue, never sleep on the completion channel (costs a CPU
    /// per connection driver even while idle; see `poll_spin` for the adaptive mode).
    pub busy_poll: bool,
    /// Adaptive polling: after any activity (a completion, a message to send, an rdma_cm event)
    /// the connection keeps polling the completion queue for this long before it arms the
    /// completion channel and sleeps: the receiving half while it waits for a message, else
    /// the connection's driver. Traffic that keeps coming within the budget never
    /// pays for a completion event and a wake-up; an idle connection spins for at most this
    /// long after its last activity, then sleeps. `Duration::ZERO` sleeps at once (pure event
    /// mode). Default 10 ms: traffic that comes at least every 10 ms keeps its connection
    /// polling, which costs CPU where traffic is sparse but steady (calls with a 5 ms handler
    /// keep the soft-RoCE guest's vCPUs busy), in exchange for no completion event per message
    /// (many clients on one runtime make several times the calls/s of a 1 ms budget); lower it
    /// where CPU matters more than latency (docs/notes/2026-12-04-scenarios-spin-budget-10ms.md).
    /// The budget also runs per thread: while a message reached a runtime thread within it,
    /// the receivers waiting on that thread keep polling, however quiet their own connection
    /// (hundreds of connections served in turn; docs/notes/2026-12-06-wakes-through-home.md).
    pub poll_spin: Duration,
    /// Receivers spinning at once on one thread from which the thread polls them together.
    /// Below it, a receiver waiting for a message polls its connection's CQ on its own task
    /// while the spin budget runs (a lone ping-pong takes its reply with no hop). From it on,
    /// one task per thread polls the CQs of all the thread's waiting receivers in turn and
    /// hands each its message, until none waits: hundreds of receivers spinning each on its
    /// own task starve the tasks woken from other threads, and some connections wait
    /// seconds for a call that others make every few milliseconds. Default 128: the soft-RoCE
    /// guest's clients scenario is unchanged up to 100 clients on one runtime and fair beyond
    /// (docs/notes/2026-12-04-scenarios-polled-together.md). 0: always together;
    /// `usize::MAX`: never.
    pub poll_together_from: usize,
    /// Time limit of each connection-setup step.
    pub connect_timeout: Duration,
    /// How long a dropped connection waits, without any completion, for outstanding work (the
    /// peer still reading a rendezvous payload) before disconnecting. Every completion restarts
    /// the wait; a peer that disconnects or fails ends it at once.
    pub linger: Duration,
    /// Listen backlog.
    pub backlog: i32,
    /// How rendezvous payloads are exposed to the peer: memory windows where the device binds
    /// them, registrations elsewhere (`Auto`), or one of the two forced. The default is
    /// `Auto`, or what [`EXPOSURE_ENV`] names.
    pub exposure: Exposure,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        VerbsConfig {
            max_message_size: 64 << 20,
            eager_limit: 64 << 10,
            recv_depth: 64,
            srq_depth: 128,
            srq_max_depth: 1024,
            send_depth: 128,
            inline_size: 128,
            zero_copy_recv_min: 4096,
            rendezvous_chunk: 1 << 20,
            rendezvous_window: 4,
            read_depth: 16,
            max_rendezvous_in: 16,
            max_rendezvous_in_bytes: 64 << 20,
            max_rendezvous_out: 16,
            receive_backlog_bytes: 64 << 20,
            handshake_timeout: Duration::from_secs(10),
            rendezvous_timeout: Duration::from_secs(30),
            registration_cache_bytes: 256 << 20,
            pool_keep_bytes: 64 << 20,
            busy_poll: false,
            poll_spin: DEFAULT_POLL_SPIN,
            poll_together_from: DEFAULT_POLL_TOGETHER_FROM,
            connect_timeout: Duration::from_secs(5),
            linger: Duration::from_secs(10),
            backlog: 128,
            exposure: Exposure::from_env().unwrap_or_default(),
        }
    }
}

impl VerbsConfig {
    /// The defaults with another max message size.
    pub fn with_max_message_size(max: usize) -> VerbsConfig {
        VerbsConfig {
            max_message_size: max,
            ..VerbsConfig::default()
        }
    }

    /// Size of each posted receive buffer: transport header + largest message header +
    /// `eager_limit`.
    pub fn recv_buf_size(&self) -> usize {
        proto::TH_LEN + MAX_HEADER_LEN + self.eager_limit
    }

    /// Checks the settings against what the protocol accepts ([`VerbsError::Config`]).
    pub fn validate(&self) -> Result<(), VerbsError> {
        if let Err(e) = Exposure::from_env() {
            return Err(VerbsError::Setting(e));
        }
        let depth = engine::MIN_DEPTH as usize..=engine::MAX_DEPTH as usize;
        if !depth.contains(&self.recv_depth) {
            return Err(VerbsError::Config("recv_depth must be within 4..=16384"));
        }
        if self.srq_depth != 0 && !depth.contains(&self.srq_depth) {
            return Err(VerbsError::Config(
                "srq_depth must be 0 (no shared receive queue) or within 4..=16384",
            ));
        }
        if self.srq_max_depth > engine::MAX_DEPTH as usize {
            return Err(VerbsError::Config("srq_max_depth must be at most 16384"));
        }
        if self.send_depth < 8 {
            return Err(VerbsError::Config("send_depth must be at least 8"));
        }
        if !(1..=255).contains(&self.read_depth) {
            return Err(VerbsError::Config("read_depth must be within 1..=255"));
        }
        if self.rendezvous_chunk == 0 || self.rendezvous_window == 0 {
            return Err(VerbsError::Config(
                "rendezvous_chunk and rendezvous_window must be above 0",
            ));
        }
        let buf = self.recv_buf_size() as u64;
        if !(engine::MIN_PEER_BUF..=engine::MAX_PEER_BUF).contains(&buf) {
            return Err(VerbsError::Config(
                "eager_limit must make receive buffers of 4 KiB to 1 GiB (eager_limit >= 4000)",
            ));
        }
        if self.max_rendezvous_in == 0 || self.max_rendezvous_in > engine::MAX_RNDV_COUNT as usize {
            return Err(VerbsError::Config(
                "max_rendezvous_in must be within 1..=4096",
            ));
        }
        if self.max_rendezvous_in_bytes < 1024 || self.max_rendezvous_out == 0 {
            return Err(VerbsError::Config(
                "max_rendezvous_in_bytes must be at least 1 KiB, max_rendezvous_out at least 1",
            ));
        }
        Ok(())
    }
}

impl VerbsConfig {
    /// The engine's settings for this configuration (with the device's paths applied: see
    /// `Paths::apply`), on the side that made the connection (`speaks_first`) or accepted it.
    pub(crate) fn engine_config(&self, speaks_first: bool, iwarp: bool) -> engine::EngineConfig {
        engine::EngineConfig {
            speaks_first,
            recv_depth: self.recv_depth as u32,
            recv_buf_size: self.recv_buf_size(),
            max_message_size: self.max_message_size,
            zero_copy_recv_min: self.zero_copy_recv_min,
            rendezvous_chunk: self.rendezvous_chunk,
            rendezvous_window: self.rendezvous_window,
            max_rendezvous_in: self.max_rendezvous_in as u32,
            max_rendezvous_in_bytes: self.max_rendezvous_in_bytes as u64,
            max_rendezvous_out: self.max_rendezvous_out as u32,
            backlog_max: 4 * self.recv_depth,
            backlog_bytes: self.receive_backlog_bytes as u64,
            handshake_timeout: self.handshake_timeout,
            rendezvous_timeout: self.rendezvous_timeout,
            linger: self.linger,
            read_depth: self.read_depth.clamp(1, 255) as u32,
            probe_hello: iwarp,
        }
    }

    /// What a connection with these settings can do.
    pub(crate) fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new("verbs", self.max_message_size);
        caps.inline_size = self.inline_size.saturating_sub(proto::TH_LEN);
        caps.rdma_read = true;
        // The device can, but nothing here posts RDMA WRITE (and no memory accepts one).
        caps.rdma_write = false;
        caps.zero_copy_send = true;
        caps.zero_copy_recv = true;
        caps.registered_buffers = true;
        caps.event_fd = !self.busy_poll;
        caps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_queue_cap_over_the_protocols_depth_is_refused() {
        let mut c = VerbsConfig::default();
        assert!(c.validate().is_ok());
        c.srq_max_depth = engine::MAX_DEPTH as usize + 1;
        assert!(matches!(c.validate(), Err(VerbsError::Config(m)) if m.contains("srq_max_depth")));
        // A cap below the starting depth is no error: the queue keeps `srq_depth`.
        c.srq_max_depth = 0;
        assert!(c.validate().is_ok());
    }
}
