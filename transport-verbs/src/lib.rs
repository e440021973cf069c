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
//! use transport_core::rpc::{ClientConfig, RpcClient};
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
//! - **Credits.** Each side posts `recv_depth` receive buffers of `recv_buf_size()` bytes before
//!   connecting and starts with one credit, spent on a HELLO that grants the other
//!   `recv_depth - 1` and announces its buffer size. Every SEND consumes one credit; every
//!   received SEND is re-posted at once and its credit returned on the next outgoing header, or
//!   by a CREDIT message when a quarter of the queue is owed. Data needs two credits, so the last one is
//!   always left for a CREDIT or CLOSE: the receiver never runs out of posted buffers (no RNR)
//!   and the two sides cannot deadlock. A sender out of credits waits (`credit_stalls`).
//! - **Eager.** A message whose header and payload fit the peer's receive buffer is sent by
//!   SEND: inline below the device's inline limit, straight from registered memory (two SGEs,
//!   no copy) when the payload lies in a pool buffer or was registered, else copied into a pool
//!   buffer. The receiver hands payloads of `zero_copy_recv_min` bytes or more over in the
//!   receive buffer itself and posts a fresh buffer from the pool; smaller ones are copied out.
//! - **Rendezvous.** Above `eager_limit` the sender registers the payload (pool lookup, then a
//!   registration cache) and sends an RTS with its address and rkey; the receiver takes a
//!   pool buffer and RDMA READs the payload in `rendezvous_chunk` pieces (`rendezvous_window`
//!   of them in flight, so replies are not stuck behind a large transfer) straight into it, then
//!   sends FIN so the sender releases the memory. A payload above the receiver's limit is refused
//!   (FIN without a READ) and reported as `MessageTooLarge` with its header.
//! - **Backpressure.** When the application leaves more than `4 × recv_depth` received
//!   messages untaken, receive buffers are held back (not re-posted, no credit returned) until
//!   it reads: the peer waits on credits instead of this side queueing without bound.
//! - **Completions.** One CQ per connection, armed through a completion channel whose fd sits
//!   on tokio's `AsyncFd`; every wake drains the CQ completely and posts everything credits
//!   allow with one doorbell. Sends are signaled selectively: the last of each batch and at
//!   least one per quarter of the send queue; a completion releases every buffer up to it.
//!   `busy_poll` spins on the CQ instead. The CQ is sized for every work request that can be
//!   outstanding (send queue + receive queue), so it cannot overflow.
//! - **Teardown.** `close()` sends CLOSE (the peer's receiver sees a clean end); dropping both
//!   halves keeps the connection alive in the background while outstanding work (a peer still
//!   reading a rendezvous payload) makes progress, gives up after `linger` without a completion,
//!   and disconnects. A peer that vanishes
//!   (rdma_cm DISCONNECTED), a QP in the error state or a failed completion fail every pending
//!   and later call with a typed error naming the cause.
//!
//! Memory registered with the NIC is never released while a work request may use it: the
//! endpoint keeps the owner of every buffer a posted request touches until its completion, and
//! the queue pair is destroyed before any of that memory (see the `ffi` module).
//!
//! ## Defaults, measured
//!
//! In the soft-RoCE guest (64 KiB one-way RPCs, 16 in flight; `examples/rpc_echo.rs`):
//! 64 receive buffers beat 32 (0.17 vs 0.11 Gbit/s in one run; 128 gave 0.20 for twice the
//! memory), and eager SEND beat rendezvous at 64 KiB (0.19 vs 0.14 one-way, 0.16 vs 0.09 per
//! direction for echo), hence `recv_depth = 64` and `eager_limit = 64 KiB`. Busy-polling lost
//! to the event mode there (2 vCPUs shared with rxe's kernel work); on real NICs with spare cores
//! it is the low-latency choice.
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
//! TRANSPORT_VERBS_REQUIRE_DEVICE=1 TB_IP_ADDR=<eth0's IPv4> cargo test -p transport-verbs
//! ```
//!
//! Without RDMA, `cargo xtask testbed verbs` runs the same tests in a QEMU guest with `rdma_rxe`
//! (see `docs/testbed.md`).

#[cfg(feature = "conformance")]
pub mod conformance;
pub mod device;
mod error;
mod ffi;

mod cm;
mod conn;
mod pool;
mod proto;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use transport_core::{Capabilities, Listener, Transport, TransportError, MAX_HEADER_LEN};

pub use conn::{VerbsConnection, VerbsReceiver, VerbsSender};
pub use device::{
    list_devices, open_device, open_first_device, Device, DeviceInfo, GidInfo, GidType, LinkLayer,
    PortInfo, PortState, ProtectionDomain, RegisteredBuffer,
};
pub use error::VerbsError;
#[doc(hidden)]
pub use ffi::{drop_ipc_lock_capability, set_memlock_soft_limit};

/// Settings of the verbs transport. Both sides may differ: buffer sizes are exchanged.
#[derive(Debug, Clone)]
pub struct VerbsConfig {
    /// Largest message (header + payload) accepted, in bytes.
    pub max_message_size: usize,
    /// Largest payload sent eagerly (SEND into a posted buffer); above it: rendezvous.
    pub eager_limit: usize,
    /// Receive buffers posted per connection (the credits granted to the peer).
    pub recv_depth: usize,
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
    pub rendezvous_window: usize,
    /// Bytes of user memory kept registered by the registration cache.
    pub registration_cache_bytes: usize,
    /// Bytes of idle registered buffers the pool keeps for reuse.
    pub pool_keep_bytes: usize,
    /// Spin on the completion queue instead of sleeping on the completion channel.
    pub busy_poll: bool,
    /// Time limit of each connection-setup step.
    pub connect_timeout: Duration,
    /// How long a dropped connection waits, without any completion, for outstanding work (the
    /// peer still reading a rendezvous payload) before disconnecting. Every completion restarts
    /// the wait; a peer that disconnects or fails ends it at once.
    pub linger: Duration,
    /// Listen backlog.
    pub backlog: i32,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        VerbsConfig {
            max_message_size: 64 << 20,
            eager_limit: 64 << 10,
            recv_depth: 64,
            send_depth: 128,
            inline_size: 128,
            zero_copy_recv_min: 4096,
            rendezvous_chunk: 1 << 20,
            rendezvous_window: 4,
            registration_cache_bytes: 256 << 20,
            pool_keep_bytes: 64 << 20,
            busy_poll: false,
            connect_timeout: Duration::from_secs(5),
            linger: Duration::from_secs(10),
            backlog: 128,
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
}

/// The IPv4 address of the first RDMA device that has one (its RoCE v2 IPv4 GID): an address to
/// listen on or connect to with [`VerbsTransport`] on this machine. [`VerbsError::NoDevice`]
/// without RDMA; [`VerbsError::DeviceNotFound`] when no device carries an IPv4 address (e.g.
/// InfiniBand without IPoIB configured).
pub fn local_rdma_ip() -> Result<std::net::IpAddr, VerbsError> {
    list_devices()?
        .iter()
        .find_map(|d| d.roce_v2_ipv4_gid().and_then(|g| g.ipv4()))
        .map(std::net::IpAddr::V4)
        .ok_or_else(|| VerbsError::DeviceNotFound("any with an IPv4 (RoCE v2) address".into()))
}

pub(crate) fn capabilities(cfg: &VerbsConfig) -> Capabilities {
    Capabilities {
        name: "verbs",
        max_message_size: cfg.max_message_size,
        max_header_len: MAX_HEADER_LEN,
        inline_size: cfg.inline_size.saturating_sub(proto::TH_LEN),
        rdma_read: true,
        rdma_write: true,
        zero_copy_send: true,
        zero_copy_recv: true,
        registered_buffers: true,
        event_fd: !cfg.busy_poll,
        reliable_ordered: true,
    }
}

/// The verbs transport. Addresses are `IP:port` of an RDMA-capable interface.
#[derive(Debug, Clone)]
pub struct VerbsTransport {
    config: Arc<VerbsConfig>,
}

impl VerbsTransport {
    /// A transport with these settings, after checking that an RDMA device exists:
    /// [`VerbsError::NoDevice`] / [`VerbsError::RdmaCoreMissing`] otherwise (see
    /// [`VerbsError::is_no_device`]).
    pub fn new(config: VerbsConfig) -> Result<VerbsTransport, VerbsError> {
        if config.recv_depth < 4 || config.send_depth < 8 || config.rendezvous_chunk == 0 {
            return Err(VerbsError::Config(
                "recv_depth must be at least 4, send_depth at least 8, rendezvous_chunk above 0",
            ));
        }
        list_devices()?;
        Ok(VerbsTransport {
            config: Arc::new(config),
        })
    }

    /// Its settings.
    pub fn config(&self) -> &VerbsConfig {
        &self.config
    }
}

impl Transport for VerbsTransport {
    type Addr = SocketAddr;
    type Connection = VerbsConnection;
    type Listener = VerbsListener;

    fn capabilities(&self) -> Capabilities {
        capabilities(&self.config)
    }

    async fn connect(&self, addr: &SocketAddr) -> Result<VerbsConnection, TransportError> {
        cm::connect(self.config.clone(), *addr).await
    }

    async fn listen(&self, addr: &SocketAddr) -> Result<VerbsListener, TransportError> {
        let l = cm::listen(*addr, self.config.clone())?;
        Ok(VerbsListener { inner: l })
    }
}

/// A listening rdma_cm identifier.
pub struct VerbsListener {
    inner: cm::Listening,
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
        if let Some(id) = self.inner.id.take() {
            conn::drop_id_off_thread(id);
        }
    }
}

impl Listener for VerbsListener {
    type Addr = SocketAddr;
    type Connection = VerbsConnection;

    fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        Ok(self.inner.addr)
    }

    /// The next established connection (set up in the background; cancel safe).
    async fn accept(&mut self) -> Result<VerbsConnection, TransportError> {
        self.inner.ready.recv().await.ok_or(TransportError::Closed)
    }
}
