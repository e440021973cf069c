//! # transport-verbs
//!
//! The RDMA verbs backend of `transport-core`: RC queue pairs set up through rdma_cm, a
//! registered buffer pool, credit-based eager SEND/RECV and zero-copy rendezvous (RDMA READ) for
//! large messages. Runs on InfiniBand, RoCE and soft-RoCE (`rdma_rxe`).
//!
//! ## Usage
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use bytes::{BufMut, Bytes};
//! use transport_rpc::{ClientConfig, RpcClient};
//! use transport_core::{MessageSender, Transport};
//! use transport_verbs::{VerbsConfig, VerbsTransport};
//!
//! // Fails with VerbsError::NoDevice ("no RDMA device found; see README for soft-RoCE")
//! // on a machine without RDMA: check `e.is_no_device()` to fall back to TCP.
//! let verbs = VerbsTransport::new(VerbsConfig::default())?;
//! // The address is IP:port of the RDMA device's netdev (RoCE) or its IPoIB interface.
//! let conn = verbs.connect(&"10.0.2.15:7471".parse()?).await?;
//! let client = RpcClient::new(conn, ClientConfig::default());
//! let reply = client.call(1, Bytes::from_static(b"ping")).await?;
//! # let _ = reply; Ok(()) }
//! ```
//!
//! Large payloads go fastest when built in registered memory: take a buffer from the sender's
//! [`transport_core::MessageSender::buffer_pool`], fill it, `freeze()` it and send it (no copy,
//! no registration). Plain `Bytes` work too: small ones are copied into registered buffers,
//! large ones are registered once through a cache. Received payloads are views of registered
//! buffers, which return to the pool when the last view drops, so echoing a received payload
//! back costs neither a copy nor a registration.
//!
//! ## Protocol
//!
//! Every SEND starts with a 32-byte transport header (kind, message-header length, credits,
//! rendezvous id, length, address, rkey; see `proto.rs`), then the message header (≤ 64 bytes),
//! then, for eager messages, the payload.
//!
//! The protocol of a connection is a plain state machine, `engine.rs` (sans-IO, after
//! quinn-proto): it takes received messages, completions, the application's pace and the
//! time, and returns the work requests to post and the messages to deliver. It makes no verbs
//! call and knows no tokio, so it is unit- and property-tested without a device (honest pairs
//! over a simulated wire, and arbitrary hostile message sequences). `conn.rs` is the glue that
//! posts what it asks for; `ffi.rs` holds all `unsafe` code.
//!
//! ```text
//!             send / close          recv (app pace)
//!                  │                      ▲
//!   ┌──────────────▼──────────────────────┴───────────────┐
//!   │ engine (per connection, sans-IO)                    │
//!   │   HELLO ─► credits ─► EAGER | RTS ─► FIN ─► CLOSE   │
//!   │   checks every peer number, bounds what it holds    │
//!   └──────▲───────────────────────────────────┬──────────┘
//!   received msg, READ done, timer      SEND, bind/invalidate window, READ
//!          │                                   ▼
//!   conn.rs (tokio glue) ───────────────► ffi.rs (ibv_post_*, poll, windows)
//! ```
//!
//! - **Handshake.** Receive buffers of `recv_buf_size()` bytes are posted before the peer can
//!   send (see *Receive buffers*). Each side starts with one credit, spent on a HELLO that
//!   announces the protocol version (3), its buffer size and credit depth (`recv_depth`), how
//!   many rendezvous transfers (and bytes) it accepts outstanding and how many RDMA READs its
//!   queue pair serves at once (`read_depth`, 16 by default within the device's limits; it
//!   sets the QP's `max_rd_atomic` and `max_dest_rd_atomic`, where rdma_cm's default is 1),
//!   and grants the other `recv_depth - 1` credits. A side keeps no more READs in flight than
//!   the peer serves. Nothing else may come first; a peer that sends no HELLO within
//!   `handshake_timeout` fails the connection. The connecting side speaks first (iWARP's
//!   rule); on iWARP it probes a peer whose HELLO is late with a zero-length RDMA READ (after
//!   100 ms, then at doubling gaps), since soft-iWARP can leave a first message that came too
//!   early unread in the accepting side's socket until another message comes.
//! - **Credits.** Every SEND consumes one credit; every received SEND's buffer is posted again
//!   at once and its credit returned on the next outgoing header, or by a CREDIT message when a
//!   quarter of `recv_depth` is owed. Data (EAGER, RTS) needs three credits and a FIN two, so
//!   the last is always left for a CREDIT or CLOSE and the one before it for a FIN; a control
//!   message's buffer is granted back even while data credits are withheld (a FIN's at once,
//!   when the peer holds fewer than two): the two sides cannot deadlock. A sender out of
//!   credits waits (`credit_stalls`). A message that arrives without a credit fails its
//!   connection ([`ProtocolViolation::NoCredit`]).
//! - **Receive buffers.** By default the transport's connections on a device receive through
//!   one shared receive queue (SRQ) that starts with `srq_depth` buffers (128 × 64 KiB, 8 MiB)
//!   and grows, up to `srq_max_depth` (1024, 64 MiB), with the messages in flight at once and
//!   with connections past 64 (two buffers each). Credits are then a per-connection quota over the shared
//!   buffers, and the queue may hold fewer buffers than all connections' credits together: a
//!   burst that finds it empty is retried by the sender's device after an RNR delay of 0.12 ms
//!   (`min_rnr_timer` 7, set on every queue pair; rdma_cm's default is 655 ms), never lost.
//!   Every buffer a completion takes from the queue is posted again (the same buffer, or a fresh
//!   one from the pool when the payload was handed over in place), also for the completions a
//!   closing queue pair never polled. Buffers come back as completions are polled; the queue's
//!   limit is armed at a quarter of its depth, and when it runs below that
//!   (`IBV_EVENT_SRQ_LIMIT_REACHED`) the device's pump thread drains the CQ of every
//!   connection that is not asleep on the channel, so that a connection spinning on a busy or
//!   blocked runtime does not keep the other connections' buffers, and the queue's depth
//!   doubles (up to `srq_max_depth`, on a thread of its own, as it does when a connection is
//!   made while it holds fewer than two buffers per connection; it never shrinks; UCX's rc
//!   receive queues are 4095 deep by default): a thousand clients calling at once then find a buffer each instead of
//!   retrying on RNR NAKs (a device that cannot arm the limit is used without it, at
//!   `srq_depth`). With `srq_depth = 0` each connection posts `recv_depth`
//!   buffers of its own (and one spare, where a message sent without a credit lands) instead (4 MiB per connection with the defaults), and the receiver never
//!   runs out of posted buffers.
//! - **Eager.** A message whose header and payload fit the peer's receive buffer is sent by
//!   SEND: inline below the device's inline limit, straight from registered memory (two SGEs,
//!   no copy) when the payload lies in a pool buffer or was registered, else copied into a pool
//!   buffer. The receiver hands payloads of `zero_copy_recv_min` bytes or more over in the
//!   receive buffer itself and posts a fresh buffer from the pool; smaller ones are copied out.
//! - **Rendezvous.** Above the peer's receive buffer the sender exposes the payload (in
//!   registered memory: a pool buffer, or a registration cache entry) through a memory window
//!   and sends an RTS with its address and the window's rkey; the receiver RDMA READs the payload
//!   in `rendezvous_chunk` pieces (`rendezvous_window` of them in flight, so replies are not
//!   stuck behind a large transfer) into a pool buffer taken when its first READ is posted, then
//!   sends FIN; the sender invalidates the window and releases the payload. READs are posted
//!   by the connection's driver task, never by the application's, and not in the driver turn
//!   that delivered a message until the application had its turn: a software device (rxe)
//!   runs a READ's whole transfer in the softirq of the CPU that posted it, which would hold
//!   up the application's answer for the whole transfer. A payload above the
//!   receiver's limit is refused (FIN without a READ) and reported as `MessageTooLarge` with its
//!   header. At most `min(max_rendezvous_out, the peer's announced count)` payloads are exposed
//!   at once (and the peer's announced bytes); the next large send waits (`rendezvous_stalls`).
//! - **Backpressure.** When the application leaves more than `4 × recv_depth` received messages
//!   or `receive_backlog_bytes` untaken, credits of re-posted buffers are withheld and no new
//!   rendezvous READ starts until it reads: the peer waits on credits instead of this side
//!   queueing without bound.
//! - **Resources per device.** A [`VerbsTransport`] (and its clones) has one protection
//!   domain, one registered buffer pool and one registration cache per device (`domain.rs`,
//!   after libfabric's domain), and one rdma_cm event channel whose events a thread routes to
//!   the identifiers, and one shared receive queue and one completion channel per device. What
//!   a connection holds for itself is its queue pair, CQ and send slots (`send_depth` × 128
//!   bytes: 16 KiB registered with the defaults), plus its own receive buffers only with
//!   `srq_depth = 0`. [`VerbsTransport::memory_use`] reports both parts.
//! - **Completions.** One CQ per connection, armed through the device's completion channel:
//!   one thread per device reads the channel (`cq_pump.rs`), so no connection costs a file
//!   descriptor. At an event of a connection whose driver sleeps on the channel, that thread
//!   drains the CQ itself (the shared receive queue gets its buffers back at once, not when a
//!   busy runtime reaches the driver, where with a thousand clients on one runtime the queue
//!   would run dry and RNR retries would take the CPU) and then wakes the driver, on whichever
//!   runtime it lives, to spin for its budget; every drain takes the CQ completely and posts
//!   everything credits allow with one doorbell. Sends are signaled selectively: the last of each batch and at
//!   least one per quarter of the send queue; a completion releases every buffer up to it.
//! - **Adaptive polling.** After any activity (a completion, a message to send, an rdma_cm
//!   event) the connection keeps polling the CQ for `poll_spin` (default 10 ms) before it arms
//!   the completion channel and sleeps: a reply that comes within the budget costs no
//!   completion event and no wake-up through the kernel. It yields to the runtime between
//!   polls (a receiver waiting for a message polls up to 64 times between two yields, from
//!   the second turn of its wait on), so the application's tasks on the same thread keep
//!   running. An idle connection
//!   spins for at most `poll_spin` after its last activity, then sleeps. `busy_poll` spins
//!   always.
//! - **Polling together.** Once `poll_together_from` (default 128) receivers spin on one
//!   thread, the next ones wait through that thread's poller (`conn/poller.rs`): one task that
//!   polls each of their CQs per turn and hands the messages over with local wake-ups, until
//!   none waits. Hundreds of receivers spinning each on its own task fill the runtime's
//!   local queue, and the tasks the pump thread wakes wait behind them (tokio serves its
//!   injection queue once every 31 local polls): with hundreds of clients on one runtime some
//!   callers make a handful of calls while others make hundreds. Polled together, every
//!   waiting connection is looked at once per turn, which makes those runs fair and leaves
//!   fewer clients and the ping-pong as they are
//!   (docs/notes/2026-12-04-scenarios-polled-together.md).
//! - **No task hop on the way.** The queue pair and the engine sit behind one lock that the
//!   driver task and both halves take (`conn.rs`). `send` hands its message to the engine and
//!   posts it on the caller's task; `recv`, while the spin budget runs, polls the CQ itself and
//!   takes its message straight from the device, and the driver leaves the CQ to it for as
//!   long as it keeps polling (a lease the receiver renews at every poll; the driver takes the
//!   CQ back when the lease ends or the receiver stops waiting). So a ping-pong within the
//!   budget crosses no channel and wakes no task on either side. `handoffs` in
//!   [`transport_core::Metrics`] counts the replies the driver still had to hand over
//!   (`tests/polling.rs`: 1 in 300 round trips while spinning, 300 in event mode). Each
//!   `send` rings its own doorbell (like a socket's write); `send_batch`, which the RPC
//!   client and server use for coalesced requests and responses, hands a batch's eager
//!   messages to the engine under one lock and rings once (`tests/polling.rs`: 32 messages,
//!   34 doorbells one by one, 2 as a batch).
//! - **No lost completion.** The CQ is sized for every work request that can complete before
//!   the driver polls: the send queue plus the connection's own receive queue, or, through the
//!   shared queue, all the `srq_max_depth` buffers it can grow to (a peer that ignores its credits can fill
//!   every slot before its connection fails; a slot is posted again only after its completion
//!   was polled). So it cannot overflow, and no shared buffer is lost with a completion.
//! - **Teardown.** `close()` sends CLOSE (the peer's receiver sees a clean end); dropping both
//!   halves keeps the connection alive in the background while outstanding work (a peer still
//!   reading a rendezvous payload) makes progress, gives up after `linger` without a completion,
//!   and disconnects. A peer that vanishes (rdma_cm DISCONNECTED), a QP in the error state, a
//!   failed completion, a broken protocol rule or a missed deadline fail every pending and later
//!   call with a typed error naming the cause.
//!
//! ## Device removal
//!
//! When a device goes while in use (`rdma link delete`, a hot-unplugged NIC, its driver
//! unloaded), rdma_cm reports it on every identifier bound to it. The transport then fails each
//! connection on the device with [`VerbsError::DeviceRemoved`] (on iWARP the kernel resets the
//! TCP connections under the queue pairs first: those connections report the reset), fails the
//! listener's `accept` with the same error, tears the queue pairs down at once (whatever the
//! application still holds), and forgets the device's shared resources. Its other devices, and
//! the process's other transports, go on; a device added back later is probed afresh and
//! connects again. Drivers that cannot revoke an open context (rxe, siw) finish a removal only
//! when every process has closed its context: once the application has dropped the failed
//! connections and the received payloads it holds, the transport lets librdmacm close its
//! context too (it re-reads librdmacm's device list, which opens the other present devices as
//! a side effect). `tests/device_removal.rs` checks this in the guest on rxe and siw: `rdma
//! link delete` returns about a second after it started.
//!
//! ## Security model: what a peer can and cannot do
//!
//! A peer is not trusted. Every number it sends (lengths, addresses, credits, ids, buffer
//! sizes, counts) is checked before it changes any state; a violation fails that connection with
//! [`VerbsError::Protocol`] (a [`ProtocolViolation`] saying which rule), never a panic, a wrap
//! or unbounded work, and other connections go on.
//!
//! What a peer **can** make this side hold, per connection, at most:
//! - receive buffers: its credits' worth (`recv_depth`) of the shared receive queue, or of its
//!   connection's own buffers with `srq_depth = 0`. A peer that sends beyond its credits takes
//!   shared buffers from other connections for a moment (they wait an RNR delay, nothing is
//!   lost; the queue may grow, never beyond `srq_max_depth`) until its first message without
//!   a credit fails its connection
//!   (`tests/hostile.rs`: 120 messages with 15 allowed; the other connection goes on and the
//!   queue is full again afterwards);
//! - rendezvous targets: `max_rendezvous_in` transfers and `max_rendezvous_in_bytes` (one
//!   transfer up to `max_message_size` is always allowed); each allocated only when its first
//!   READ is posted, and none started while the application is behind;
//! - received messages the application has not taken: about `receive_backlog_bytes` (and
//!   `4 × recv_depth` messages) plus what its remaining credits let through;
//! - our own payloads it has not acknowledged: `max_rendezvous_out`, for at most
//!   `rendezvous_timeout` without a FIN.
//!
//! What a peer **can** touch in this side's memory: only the payload of a rendezvous it was
//! sent, by RDMA READ, through a type-2 memory window that is bound to this connection's queue
//! pair, covers exactly that payload, and is invalidated when its FIN arrives (before the
//! payload's memory is released or reused). It **cannot**:
//! - write anything: no memory region, window or queue pair is registered or configured for
//!   remote write or atomics (no feature posts RDMA WRITE);
//! - read receive buffers, the control slots or pool buffers outside a live window: memory
//!   regions are registered for local access and window binding only, so their own rkeys grant
//!   nothing;
//! - read a payload after its FIN (the window's key is invalid, the READ fails with a remote
//!   access error), or through another connection (a type-2 window is bound to one queue pair),
//!   with a leaked or guessed key.
//!
//! The tests in `tests/hostile.rs` (run in the soft-RoCE guest) check each of these with a peer
//! that speaks the wire format by hand (module `test_peer`, feature `test-hooks`: test hooks are not public API without it).
//!
//! Memory windows on soft-RoCE (`rdma_rxe`, Linux 6.1, rdma-core 44), verified by those tests:
//! type-2 windows are allocated with `ibv_alloc_mw`, bound by an `IBV_WR_BIND_MW` work request
//! (the memory region needs `IBV_ACCESS_MW_BIND`, the window gets `IBV_ACCESS_REMOTE_READ`) and
//! invalidated by `IBV_WR_LOCAL_INV`, both in send-queue order with the messages around them; a
//! READ through another queue pair, or after the invalidation, completes with
//! `IBV_WC_REM_ACCESS_ERR`. The provider names a window by the key in its `ibv_mw`, which the
//! application must update after each bind (rxe refuses the next bind otherwise).
//!
//! Memory registered with the NIC is never released while a work request may use it: the
//! endpoint keeps the owner of every buffer a posted request touches until its completion, a
//! window is invalidated or deallocated before the payload it exposed is released, and the
//! queue pair is destroyed before any of that memory (see the `ffi` module).
//!
//! ## Defaults
//!
//! `recv_depth = 64` and `eager_limit = 64 KiB`: in the soft-RoCE guest (64 KiB one-way RPCs,
//! 16 in flight; `examples/rpc_echo.rs`) 64 receive buffers move more than 32 (128 little
//! more, for twice the memory), and eager SEND beats rendezvous at 64 KiB
//! (docs/notes/2026-12-01-verbs-rpc-echo-against-perftest.md). Busy-polling loses to the event
//! mode there (2 vCPUs shared with rxe's kernel work); on real NICs with spare cores it is the
//! low-latency choice.
//!
//! `poll_spin = 10 ms`: with many connections on one runtime each connection's own traffic
//! comes less often than every millisecond, so a shorter budget runs out between its messages
//! and every message pays a completion event, although the device never rests
//! (docs/notes/2026-12-04-scenarios-spin-budget-10ms.md). The price: a connection whose
//! traffic comes every few milliseconds polls all the time. For one connection, a budget
//! shorter than an emulated round trip runs out before the reply, and longer ones change
//! neither the latency nor the throughput (docs/notes/2026-12-01-verbs-adaptive-polling.md).
//!
//! ## Benchmark against perftest
//!
//! `examples/rpc_echo.rs` runs an RPC server and client in one process over one device (as
//! `ib_send_bw` does) and prints throughput plus the metrics (copies, registrations, doorbells,
//! completions, credit stalls). Run it next to perftest in the guest, in one boot:
//!
//! ```text
//! cargo build --release -p transport-verbs --example rpc_echo
//! SB='ib_send_bw -d rxe0 -i 1 -x $TB_GID_INDEX -F -n 2000 -s 65536 --report_gbits >/dev/null 2>&1 &
//!     sleep 1; ib_send_bw -d rxe0 -i 1 -x $TB_GID_INDEX -F -n 2000 -s 65536 --report_gbits $TB_IP_ADDR; wait'
//! cargo xtask testbed run --timeout 200 --file target/release/examples/rpc_echo -- \
//!     "$SB" '/mnt/host/bin/rpc_echo --addr $TB_IP_ADDR --size 65536 --calls 2000 --inflight 16'
//! ```
//!
//! [`link`] measures the link itself through the same binding, perftest-style (a busy-polled
//! SEND ping-pong and an RDMA READ stream); `bench` reads raw and RPC against it. Note that
//! perftest's latency tests print half a round trip (`ib_send_lat`'s `t_typical` is RTT / 2).
//!
//! For programs such as `bench`: [`VerbsTransport::new`] fails with [`VerbsError::NoDevice`] /
//! [`VerbsError::RdmaCoreMissing`] (check [`VerbsError::is_no_device`]) where there is no RDMA,
//! [`local_rdma_ip`] gives an address to listen on, [`transport_core::Connection::capabilities`]
//! and the per-connection [`transport_core::Metrics`] carry `payload_bytes_copied`,
//! `registrations`, `doorbells`, `completions` and `credit_stalls`.
//!
//! ## Running
//!
//! Needs rdma-core (libibverbs, librdmacm and the provider) at run time and an RDMA device with
//! an IP address: a real NIC, or soft-RoCE on any Ethernet netdev:
//!
//! ```text
//! sudo modprobe rdma_rxe && sudo rdma link add rxe0 type rxe netdev eth0
//! ulimit -l unlimited
//! TB_IP_ADDR=<eth0's IPv4> cargo test -p transport-verbs -- --include-ignored
//! ```
//!
//! Registered memory is locked memory: with the defaults the first connection on a device
//! registers the shared receive queue (128 × 64 KiB + headers, 8.4 MB; up to 1024 buffers,
//! 67 MB, where many messages are in flight at once) and each connection 16 KiB of send
//! slots, plus the pool's send and rendezvous buffers as traffic needs them.
//! Under a finite `RLIMIT_MEMLOCK` (8 MiB is a common default; `CAP_IPC_LOCK` lifts it) the
//! shared receive queue and its growth cap are made smaller to fit in half of the limit (at
//! least 4 buffers; a warning names the depths, and [`MemoryUse::shared_receive_bytes`] shows the result), so
//! the defaults connect. A registration that still does not fit fails with
//! [`VerbsError::Registration`], which names the limit: raise it (`ulimit -l unlimited`), or
//! lower `srq_depth` or `eager_limit`.
//!
//! Without RDMA, `cargo xtask testbed verbs` runs the same tests in a QEMU guest with `rdma_rxe`
//! (see `docs/testbed.md`).

#[cfg(feature = "conformance")]
pub mod conformance;
pub mod device;
mod error;
mod ffi;
#[cfg(feature = "test-hooks")]
pub mod test_peer;

mod caps;
mod cm;
mod config;
mod conn;
mod cq_pump;
mod domain;
mod engine;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
/// The engine driven by a hostile peer, for the fuzz targets (feature `fuzzing`; not API).
pub mod fuzz {
    pub use crate::engine::hostile::{run, HostileMsg, Step};
}
pub mod link;
mod pool;
mod proto;
mod siw_keys;

use std::net::SocketAddr;
use std::sync::Arc;

use transport_core::{Capabilities, Listener, Transport, TransportError};

pub use caps::{
    probe_devices, registration_cost, DeviceCaps, ExposurePath, Paths, RdmaTransport, SrqLimits,
};
pub use config::{Exposure, VerbsConfig, EXPOSURE_ENV};
#[cfg(feature = "test-hooks")]
pub use conn::polled_together;
pub use conn::{VerbsConnection, VerbsReceiver, VerbsSender};
pub use device::{
    list_devices, open_device, open_first_device, Device, DeviceInfo, GidInfo, GidType, LinkLayer,
    PortInfo, PortState, ProtectionDomain, RegisteredBuffer,
};
pub use domain::MemoryUse;
pub use error::{ProtocolViolation, VerbsError, WcStatus, WorkRequestKind};
pub use ffi::memlock_budget;
#[cfg(feature = "test-hooks")]
pub use ffi::{drop_ipc_lock_capability, set_memlock_soft_limit};

/// The IPv4 address of the first RDMA device that has one: its RoCE v2 IPv4 GID, or else the
/// first local address rdma_cm binds to a device (iWARP, IPoIB): an address to listen on or
/// connect to with [`VerbsTransport`] on this machine. [`VerbsError::NoDevice`] without RDMA;
/// [`VerbsError::DeviceNotFound`] when no device carries an IPv4 address (e.g. InfiniBand
/// without IPoIB configured).
pub fn local_rdma_ip() -> Result<std::net::IpAddr, VerbsError> {
    if let Some(ip) = list_devices()?
        .iter()
        .find_map(|d| d.roce_v2_ipv4_gid().and_then(|g| g.ipv4()))
    {
        return Ok(std::net::IpAddr::V4(ip));
    }
    rdma_addresses()?
        .into_iter()
        .map(|(_, ip)| ip)
        .next()
        .ok_or_else(|| VerbsError::DeviceNotFound("any with an IPv4 address".into()))
}

/// The local IPv4 addresses rdma_cm maps to an RDMA device, each with the device's name
/// (`rxe0`, `siw0`, `mlx5_0`), loopback excluded: where to listen for a given device.
pub fn rdma_addresses() -> Result<Vec<(String, std::net::IpAddr)>, VerbsError> {
    list_devices()?;
    cm::rdma_addresses().map_err(|e| VerbsError::Internal(format!("finding RDMA addresses: {e}")))
}

/// The first local IPv4 address rdma_cm maps to the device called `name`.
pub fn device_ip(name: &str) -> Result<std::net::IpAddr, VerbsError> {
    rdma_addresses()?
        .into_iter()
        .find(|(d, _)| d == name)
        .map(|(_, ip)| ip)
        .ok_or_else(|| VerbsError::DeviceNotFound(format!("{name} (no IPv4 address maps to it)")))
}

/// The verbs transport. Addresses are `IP:port` of an RDMA-capable interface.
#[derive(Clone)]
pub struct VerbsTransport {
    config: Arc<VerbsConfig>,
    /// One rdma_cm event channel for every identifier of this transport (and its clones).
    cm: Arc<cm::CmChannel>,
    /// One protection domain, pool and registration cache per device.
    domains: Arc<domain::Domains>,
}

impl std::fmt::Debug for VerbsTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsTransport")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl VerbsTransport {
    /// A transport with these settings, after checking that an RDMA device exists:
    /// [`VerbsError::NoDevice`] / [`VerbsError::RdmaCoreMissing`] otherwise (see
    /// [`VerbsError::is_no_device`]).
    pub fn new(config: VerbsConfig) -> Result<VerbsTransport, VerbsError> {
        config.validate()?;
        list_devices()?;
        Ok(VerbsTransport {
            config: Arc::new(config),
            cm: Arc::default(),
            domains: Arc::default(),
        })
    }

    /// Its settings.
    pub fn config(&self) -> &VerbsConfig {
        &self.config
    }

    /// Connections open on this transport (and its clones) and the memory they have
    /// registered with the devices, right now.
    pub fn memory_use(&self) -> MemoryUse {
        self.domains.memory_use()
    }

    /// Test hook (feature `test-hooks`): moves the queue pair of one live connection of this
    /// transport (the `turn`-th, in no particular order) to the error state, as a device fault
    /// would: its pending and later operations fail with a typed error and its peer sees the
    /// connection end. Whether there was a connection to break. For fault soaks.
    #[cfg(feature = "test-hooks")]
    pub fn inject_qp_error_on_one(&self, turn: usize) -> bool {
        self.domains.break_one_qp(turn)
    }

    /// What each device this transport has made a connection on can do (probed at its first
    /// connection), and so the paths its connections take there ([`DeviceCaps::paths`]).
    pub fn device_caps(&self) -> Vec<DeviceCaps> {
        self.domains.caps().iter().map(|c| (**c).clone()).collect()
    }
}

impl Transport for VerbsTransport {
    type Addr = SocketAddr;
    type Connection = VerbsConnection;
    type Listener = VerbsListener;

    fn capabilities(&self) -> Capabilities {
        self.config.capabilities()
    }

    async fn connect(&self, addr: &SocketAddr) -> Result<VerbsConnection, TransportError> {
        let est = cm::connect(
            self.cm.get(&self.domains)?,
            self.domains.clone(),
            self.config.clone(),
            *addr,
            cm::RecvMode::Shared,
        )
        .await?;
        conn::start(est)
    }

    async fn listen(&self, addr: &SocketAddr) -> Result<VerbsListener, TransportError> {
        let (tx, ready) = tokio::sync::mpsc::unbounded_channel();
        let l = cm::listen(
            self.cm.get(&self.domains)?,
            self.domains.clone(),
            *addr,
            self.config.clone(),
            cm::RecvMode::Shared,
            move |est| match est {
                // Started at once: the handshake and its time limit do not wait for `accept`.
                Ok(est) => {
                    if let Ok(c) = conn::start(est) {
                        let _ = tx.send(Ok(c));
                    }
                }
                Err(removed) => {
                    let _ = tx.send(Err(TransportError::from(removed)));
                }
            },
        )?;
        Ok(VerbsListener {
            inner: l,
            ready,
            failed: None,
        })
    }
}

/// A listening rdma_cm identifier.
pub struct VerbsListener {
    inner: cm::Listening,
    ready: tokio::sync::mpsc::UnboundedReceiver<Result<VerbsConnection, TransportError>>,
    /// Why the listener ended ([`VerbsError::DeviceRemoved`]), reported by every later accept.
    failed: Option<TransportError>,
}

impl std::fmt::Debug for VerbsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsListener")
            .field("addr", &self.inner.addr)
            .finish()
    }
}

impl Drop for VerbsListener {
    fn drop(&mut self) {
        self.inner.close();
    }
}

impl Listener for VerbsListener {
    type Addr = SocketAddr;
    type Connection = VerbsConnection;

    fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        Ok(self.inner.addr)
    }

    /// The next established connection (set up in the background; cancel safe). Once the
    /// listener's device is removed, this and every later call fail with
    /// [`VerbsError::DeviceRemoved`] (connections established before are still returned
    /// first).
    async fn accept(&mut self) -> Result<VerbsConnection, TransportError> {
        match self.ready.recv().await {
            Some(Ok(c)) => Ok(c),
            Some(Err(e)) => {
                self.failed = Some(e.duplicate());
                Err(e)
            }
            None => Err(self
                .failed
                .as_ref()
                .map_or(TransportError::Closed, TransportError::duplicate)),
        }
    }
}
