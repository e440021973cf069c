//! What the bench client and server say to each other, and the server.
//!
//! Every connection opens with one message whose header names its mode:
//!
//! | mode | what the server does |
//! |---|---|
//! | `echo` | sends every message back as it came (raw ping-pong and raw echo stream) |
//! | `sink` | drops messages; answers an `end` message with `ack` + bytes received (u64 LE) |
//! | `source` | for each `src` request (size u32 LE, count u64 LE) sends `count` messages of `size` bytes |
//! | `acked` | answers every message with an empty one (the raw send rows of `--raw-twoway exchange`) |
//! | `rpc` | hands the connection to an [`RpcServer`] with the [`method`] ids below |
//!
//! Raw modes use the backend's `Connection` directly (the same code the RPC layer runs on),
//! so the difference between a raw and an RPC figure is the RPC layer's cost.
//!
//! ## Limits
//!
//! The server is unauthenticated, so no number a peer sends makes it loop or allocate
//! without bound:
//!
//! - a `src` request asks for at most [`MAX_SOURCE_COUNT`] messages, of at most
//!   [`MAX_PAYLOAD`] bytes each and no larger than the connection's largest message, and
//!   at most [`MAX_SOURCE_BYTES`] in all. A request outside these limits is answered with
//!   one [`SOURCE_ERR`] message (the reason as text) and the connection is closed. The bench
//!   client splits a longer stream into several requests ([`SourceRequest::split`]).
//! - [`method::RECV`] answers at most [`MAX_PAYLOAD`] bytes; a larger size is refused with
//!   `INVALID_ARGUMENT`.
//! - `echo`, `sink` and `acked` only hold one message at a time, bounded by the transport's largest
//!   message; RPC calls in flight are bounded by the [`RpcServer`]'s configuration.

use bytes::{Buf, Bytes};
use std::sync::{Arc, Mutex};
use transport_core::{
    Capabilities, Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender,
    Metrics, MetricsSnapshot, TransportError,
};
use transport_rpc::{Request, RpcServer, ServerConfig, Status};

/// The counters of every connection one bench server has served: created with the server
/// and shared (through an `Arc`) by its connection tasks and by whoever reads its totals (the
/// measurements of local mode).
#[derive(Default)]
pub struct ServerCounters {
    state: Mutex<CounterState>,
}

#[derive(Default)]
struct CounterState {
    /// The counters of the connections being served.
    live: Vec<Arc<Metrics>>,
    /// Final counts of the connections that ended.
    ended: MetricsSnapshot,
}

impl ServerCounters {
    fn state(&self) -> std::sync::MutexGuard<'_, CounterState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The sum of the counters of every connection this server has served. In local mode the
    /// difference over a measurement is the server's side of it: copies made while receiving
    /// requests happen there.
    pub fn totals(&self) -> MetricsSnapshot {
        let c = self.state();
        let mut total = c.ended;
        for m in &c.live {
            total.accumulate(&m.snapshot());
        }
        total
    }

    /// Connections being served now.
    pub fn live(&self) -> usize {
        self.state().live.len()
    }

    /// Counts `metrics` as a live connection until the returned guard is dropped.
    fn register(self: &Arc<Self>, metrics: Arc<Metrics>) -> Counted {
        self.state().live.push(metrics.clone());
        Counted {
            counters: self.clone(),
            metrics,
        }
    }
}

/// A served connection's entry in its server's [`ServerCounters`]; folded into the ended
/// total on drop.
struct Counted {
    counters: Arc<ServerCounters>,
    metrics: Arc<Metrics>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        let mut c = self.counters.state();
        c.live.retain(|m| !Arc::ptr_eq(m, &self.metrics));
        c.ended.accumulate(&self.metrics.snapshot());
    }
}

/// Header of the first message of a raw echo connection.
pub const MODE_ECHO: &[u8] = b"echo";
/// Header of the first message of a raw sink connection.
pub const MODE_SINK: &[u8] = b"sink";
/// Header of the first message of a raw connection whose every message is answered by an
/// empty one.
pub const MODE_ACKED: &[u8] = b"acked";
/// Header of the first message of a raw source connection.
pub const MODE_SOURCE: &[u8] = b"source";
/// Header of the first message of an RPC connection.
pub const MODE_RPC: &[u8] = b"rpc";
/// Sink: "tell me what you received".
pub const SINK_END: &[u8] = b"end";
/// Sink: the answer to [`SINK_END`].
pub const SINK_ACK: &[u8] = b"ack";
/// Source: a request for a stream of messages (a [`SourceRequest`]).
pub const SOURCE_REQ: &[u8] = b"src";
/// Source: the server's answer to a request outside the [limits](self#limits) (payload:
/// the reason, as text); the server closes the connection after it.
pub const SOURCE_ERR: &[u8] = b"err";

/// Largest payload the bench moves (1 MB is the largest size of the issue; 16 MiB leaves room).
pub const MAX_PAYLOAD: usize = 16 << 20;

/// Most messages one `src` request may ask for (the bench client asks for at most
/// 20 000 per measurement, and splits anything longer: see [`SourceRequest::split`]).
pub const MAX_SOURCE_COUNT: u64 = 1 << 20;

/// Most payload bytes one `src` request may ask for (size x count): 64 GiB.
pub const MAX_SOURCE_BYTES: u64 = 64 << 30;

/// A `src` request: send `count` messages of `size` bytes. On the wire: size u32 LE, then
/// count u64 LE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceRequest {
    /// Payload bytes per message.
    pub size: u32,
    /// Messages to send.
    pub count: u64,
}

impl SourceRequest {
    /// Length of an encoded request.
    pub const LEN: usize = 12;

    /// The most messages of `size` bytes one request may ask for (at least 1 for any size
    /// within [`MAX_PAYLOAD`]).
    pub fn max_count(size: usize) -> u64 {
        (MAX_SOURCE_BYTES / size.max(1) as u64).min(MAX_SOURCE_COUNT)
    }

    /// Requests for `count` messages of `size` bytes in all, each within the limits.
    pub fn split(size: u32, count: u64) -> impl Iterator<Item = SourceRequest> {
        let per = Self::max_count(size as usize);
        (0..count.div_ceil(per)).map(move |i| SourceRequest {
            size,
            count: per.min(count - i * per),
        })
    }

    /// The request as sent in a `src` message's payload.
    pub fn encode(&self) -> Bytes {
        let mut b = Vec::with_capacity(Self::LEN);
        b.extend_from_slice(&self.size.to_le_bytes());
        b.extend_from_slice(&self.count.to_le_bytes());
        Bytes::from(b)
    }

    /// Reads a `src` payload and checks it against the limits, with `max_size` the most
    /// bytes per message the connection can carry (capped at [`MAX_PAYLOAD`]).
    pub fn decode(mut payload: Bytes, max_size: usize) -> Result<SourceRequest, String> {
        if payload.len() != Self::LEN {
            return Err(format!(
                "a src request is {} bytes, not {}",
                Self::LEN,
                payload.len()
            ));
        }
        let r = SourceRequest {
            size: payload.get_u32_le(),
            count: payload.get_u64_le(),
        };
        let max_size = max_size.min(MAX_PAYLOAD);
        if r.size as usize > max_size {
            return Err(format!(
                "size {} is above the limit of {max_size} bytes",
                r.size
            ));
        }
        if r.count > Self::max_count(r.size as usize) {
            return Err(format!(
                "{} messages of {} bytes is above the limit of {MAX_SOURCE_COUNT} messages \
                 and {MAX_SOURCE_BYTES} bytes per request",
                r.count, r.size
            ));
        }
        Ok(r)
    }
}

/// RPC method ids of the bench server.
pub mod method {
    /// `void o()`: empty request, empty response.
    pub const PING: u32 = 0;
    /// Byte sequence in, nothing out (twoway send).
    pub const SEND: u32 = 1;
    /// Byte sequence in, oneway.
    pub const ONEWAY: u32 = 2;
    /// Size (u32 LE) in, byte sequence of that size out.
    pub const RECV: u32 = 3;
    /// Byte sequence in, the same out.
    pub const ECHO: u32 = 4;
}

/// A connection whose halves were already split (so the server can read the mode message
/// first and then hand the rest of the connection to the RPC server).
pub struct Presplit<S, R> {
    tx: S,
    rx: R,
    caps: Capabilities,
    metrics: Arc<Metrics>,
    peer: String,
}

impl<S, R> Presplit<S, R> {
    /// Reassembles a connection from its halves and what it reported before the split.
    pub fn new(tx: S, rx: R, caps: Capabilities, metrics: Arc<Metrics>, peer: String) -> Self {
        Presplit {
            tx,
            rx,
            caps,
            metrics,
            peer,
        }
    }
}

/// Opens a bench connection in `mode` (one of the `MODE_*` headers): its first message.
pub async fn send_mode<S: MessageSender>(tx: &mut S, mode: &[u8]) -> Result<(), TransportError> {
    let mode = HeaderBytes::new(mode).expect("the modes are shorter than a header");
    tx.send(Message::new(mode, Bytes::new())).await
}

/// An RPC client on a new bench connection: the RPC mode message, then the RPC layer on the
/// rest of the connection.
pub async fn rpc_client<C: Connection>(
    conn: C,
    config: transport_rpc::ClientConfig,
) -> Result<transport_rpc::RpcClient<C::Sender>, TransportError> {
    let (caps, metrics, peer) = (conn.capabilities(), conn.metrics(), conn.peer());
    let (mut tx, rx) = conn.split();
    send_mode(&mut tx, MODE_RPC).await?;
    Ok(transport_rpc::RpcClient::new(
        Presplit::new(tx, rx, caps, metrics, peer),
        config,
    ))
}

impl<S: MessageSender, R: MessageReceiver> Connection for Presplit<S, R> {
    type Sender = S;
    type Receiver = R;
    fn capabilities(&self) -> Capabilities {
        self.caps.clone()
    }
    fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }
    fn peer(&self) -> String {
        self.peer.clone()
    }
    fn split(self) -> (S, R) {
        (self.tx, self.rx)
    }
}

/// The bytes RECV answers are sliced from.
pub fn payload_pool() -> Bytes {
    Bytes::from(vec![0x5au8; MAX_PAYLOAD])
}

/// The bench's RPC handler (methods in [`method`]), shared by the async server and the
/// blocking one of `--rpc-io blocking`.
///
/// Every method answers at once, so the handler computes its answer before it returns and
/// hands back a ready future: no state machine per call and no clone of `pool` for the calls
/// that do not use it (the raw rows pay neither).
pub fn rpc_handler(pool: Bytes) -> impl transport_rpc::Handler + Clone {
    move |r: Request| {
        std::future::ready(match r.method {
            method::PING | method::SEND | method::ONEWAY => Ok(Bytes::new()),
            method::ECHO => Ok(r.payload),
            method::RECV => {
                let mut p = r.payload;
                if p.len() != 4 {
                    Err(Status::new(
                        transport_rpc::code::INVALID_ARGUMENT,
                        "recv wants a u32 size",
                    ))
                } else {
                    let n = p.get_u32_le() as usize;
                    if n > pool.len() {
                        Err(Status::new(
                            transport_rpc::code::INVALID_ARGUMENT,
                            "recv size above the bench's largest payload",
                        ))
                    } else {
                        Ok(pool.slice(..n))
                    }
                }
            }
            m => Err(Status::unknown_method(m)),
        })
    }
}

/// Whether an accept error ends the listener for good: it was closed, or its RDMA device
/// was removed (every later accept fails the same way).
fn listener_gone(e: &TransportError) -> bool {
    matches!(e, TransportError::Closed)
        || matches!(
            e.original().backend_error::<transport_verbs::VerbsError>(),
            Some(transport_verbs::VerbsError::DeviceRemoved { .. })
        )
}

/// Serves bench connections from `listener` until the process ends or the listener does
/// (closed, or its RDMA device removed: that error is returned), counting each one in
/// `counters` while it is served.
pub async fn serve<L: Listener>(
    mut listener: L,
    counters: Arc<ServerCounters>,
) -> Result<(), TransportError> {
    let pool = payload_pool();
    let rpc = RpcServer::new(rpc_handler(pool.clone()), ServerConfig::default());
    loop {
        let conn = match listener.accept().await {
            Ok(c) => c,
            Err(e) if listener_gone(&e) => return Err(e),
            Err(e) => {
                eprintln!("bench server: accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let rpc = rpc.clone();
        let pool = pool.clone();
        let counted = counters.register(conn.metrics());
        tokio::spawn(async move {
            let _counted = counted;
            if let Err(e) = serve_connection(conn, rpc, pool).await {
                tracing_free_log(&e);
            }
        });
    }
}

fn tracing_free_log(e: &TransportError) {
    // A client that stops mid-run (Ctrl-C) is normal; anything else is worth a line.
    if !matches!(e, TransportError::Closed | TransportError::Io(_)) {
        eprintln!("bench server: connection ended: {e}");
    }
}

async fn serve_connection<C: Connection>(
    conn: C,
    rpc: RpcServer<impl transport_rpc::Handler>,
    pool: Bytes,
) -> Result<(), TransportError> {
    let caps = conn.capabilities();
    let metrics = conn.metrics();
    let peer = conn.peer();
    let (mut tx, mut rx) = conn.split();
    let Some(first) = rx.recv().await? else {
        return Ok(());
    };
    match first.header.as_slice() {
        MODE_ECHO => {
            while let Some(m) = rx.recv().await? {
                tx.send(m).await?;
            }
        }
        MODE_ACKED => {
            while rx.recv().await?.is_some() {
                tx.send(Message::new(HeaderBytes::EMPTY, Bytes::new()))
                    .await?;
            }
        }
        MODE_SINK => {
            let mut received = 0u64;
            while let Some(m) = rx.recv().await? {
                if m.header.as_slice() == SINK_END {
                    let ack = Bytes::copy_from_slice(&received.to_le_bytes());
                    tx.send(Message::new(HeaderBytes::from(*b"ack"), ack))
                        .await?;
                    received = 0;
                } else {
                    received = received.saturating_add(m.payload.len() as u64);
                }
            }
        }
        MODE_SOURCE => {
            let max_size = caps.max_message_size.min(pool.len());
            while let Some(m) = rx.recv().await? {
                if m.header.as_slice() != SOURCE_REQ {
                    return Err(TransportError::Malformed("bench source: not a src request"));
                }
                let req = match SourceRequest::decode(m.payload, max_size) {
                    Ok(r) => r,
                    Err(reason) => {
                        let err = HeaderBytes::new(SOURCE_ERR).expect("short");
                        let _ = tx.send(Message::new(err, Bytes::from(reason))).await;
                        let _ = tx.close().await;
                        return Err(TransportError::Malformed(
                            "bench source: request outside the limits",
                        ));
                    }
                };
                let payload = pool.slice(..req.size as usize);
                for _ in 0..req.count {
                    tx.send(Message::new(HeaderBytes::EMPTY, payload.clone()))
                        .await?;
                }
            }
        }
        MODE_RPC => {
            let conn = Presplit {
                tx,
                rx,
                caps,
                metrics,
                peer,
            };
            if let Err(e) = rpc.serve_connection(conn).await {
                if !e.is_connection_error() {
                    eprintln!("bench server: rpc connection ended: {e}");
                }
            }
            return Ok(());
        }
        _ => return Err(TransportError::Malformed("bench server: unknown mode")),
    }
    let _ = tx.close().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use std::time::Duration;
    use transport_core::Transport;
    use transport_rpc::{code, ClientConfig, RpcError};
    use transport_tcp::TcpTransport;

    /// Every wait in these tests ends by then.
    const BOUND: Duration = Duration::from_secs(10);

    fn src(size: u32, count: u64) -> Bytes {
        SourceRequest { size, count }.encode()
    }

    /// `proto::serve` on a TCP listener on 127.0.0.1, for the rest of the test.
    async fn server() -> SocketAddr {
        let l = TcpTransport::default()
            .listen(&"127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(serve(l, Arc::default()));
        addr
    }

    /// A TCP connection to the bench server at `addr`, opened in `mode`, as its two halves.
    async fn raw_connection(
        addr: SocketAddr,
        mode: &[u8],
    ) -> (impl MessageSender, impl MessageReceiver) {
        let conn = TcpTransport::default().connect(&addr).await.unwrap();
        let (mut tx, rx) = conn.split();
        send_mode(&mut tx, mode).await.unwrap();
        (tx, rx)
    }

    /// Opens a source connection, sends one `src` message with `payload` and reads what the
    /// server answers: at most `max_messages` messages, until it closes the connection.
    /// Returns the messages and whether the server closed the connection.
    async fn source_answer(
        addr: SocketAddr,
        payload: Bytes,
        max_messages: usize,
    ) -> (Vec<Message>, bool) {
        let (mut tx, mut rx) = raw_connection(addr, MODE_SOURCE).await;
        tx.send(Message::new(HeaderBytes::new(SOURCE_REQ).unwrap(), payload))
            .await
            .unwrap();
        let mut got = Vec::new();
        let closed = tokio::time::timeout(BOUND, async {
            while got.len() < max_messages {
                match rx.recv().await {
                    Ok(Some(m)) => got.push(m),
                    Ok(None) | Err(_) => return true,
                }
            }
            false
        })
        .await
        .expect("the server neither answered nor closed within the bound");
        (got, closed)
    }

    /// An `acked` connection answers every message, whatever its size, with an empty one, and
    /// closes when the client does.
    #[tokio::test]
    async fn acked_answers_every_message_with_an_empty_one() {
        let addr = server().await;
        let (mut tx, mut rx) = raw_connection(addr, MODE_ACKED).await;
        for size in [0usize, 1, 70_000] {
            tx.send(Message::new(
                HeaderBytes::EMPTY,
                Bytes::from(vec![7u8; size]),
            ))
            .await
            .unwrap();
        }
        for _ in 0..3 {
            let m = tokio::time::timeout(BOUND, rx.recv())
                .await
                .expect("bounded")
                .unwrap()
                .expect("an answer per message");
            assert!(
                m.payload.is_empty() && m.header.as_slice().is_empty(),
                "{m:?}"
            );
        }
        tx.close().await.unwrap();
        let end = tokio::time::timeout(BOUND, rx.recv())
            .await
            .expect("bounded");
        assert!(
            matches!(end, Ok(None)),
            "no fourth answer, then the end: {end:?}"
        );
    }

    /// A `src` request within the limits gets its messages; the connection stays open.
    #[tokio::test]
    async fn source_serves_a_request_within_the_limits() {
        let addr = server().await;
        let (got, closed) = source_answer(addr, src(1024, 3), 3).await;
        assert!(!closed);
        assert_eq!(got.len(), 3);
        for m in &got {
            assert_eq!(m.header.as_slice(), b"");
            assert_eq!(m.payload.len(), 1024);
        }
    }

    /// Counts and sizes from the wire outside the limits are refused with one `err` message
    /// and the connection closed: no data at all is sent for them (a server without the
    /// limits would stream 2^64-1 messages for the first one).
    #[tokio::test]
    async fn source_refuses_requests_outside_the_limits() {
        let addr = server().await;
        let too_many_bytes = MAX_SOURCE_BYTES / MAX_PAYLOAD as u64 + 1;
        let refused = [
            ("2^64-1 messages", src(1, u64::MAX)),
            ("one message too many", src(0, MAX_SOURCE_COUNT + 1)),
            ("size 2^32-1", src(u32::MAX, 1)),
            ("size above MAX_PAYLOAD", src(MAX_PAYLOAD as u32 + 1, 1)),
            (
                "above MAX_SOURCE_BYTES",
                src(MAX_PAYLOAD as u32, too_many_bytes),
            ),
            ("short request", Bytes::from_static(&[0; 11])),
        ];
        for (what, req) in refused {
            // Up to 16 messages: a server that starts streaming shows it at the second one.
            let (got, closed) = source_answer(addr, req, 16).await;
            let data: Vec<_> = got
                .iter()
                .filter(|m| m.header.as_slice() != SOURCE_ERR)
                .collect();
            assert!(data.is_empty(), "{what}: {} data messages", data.len());
            assert!(closed, "{what}: the connection stayed open");
            if what != "short request" {
                assert_eq!(got.len(), 1, "{what}: one err message");
            }
        }
        // The server still serves.
        let (got, _) = source_answer(addr, src(16, 1), 1).await;
        assert_eq!(got[0].payload.len(), 16);
    }

    /// Decoding applies the connection's own message limit and every documented limit.
    #[test]
    fn source_request_limits() {
        let ok = |size, count, max| SourceRequest::decode(src(size, count), max);
        assert_eq!(
            ok(1024, 3, MAX_PAYLOAD),
            Ok(SourceRequest {
                size: 1024,
                count: 3
            })
        );
        assert!(ok(4097, 1, 4096).is_err(), "the connection's limit");
        assert!(ok(MAX_PAYLOAD as u32, 1, usize::MAX).is_ok());
        assert!(ok(MAX_PAYLOAD as u32 + 1, 1, usize::MAX).is_err());
        assert!(ok(0, MAX_SOURCE_COUNT, MAX_PAYLOAD).is_ok());
        assert!(ok(0, MAX_SOURCE_COUNT + 1, MAX_PAYLOAD).is_err());
        let n = MAX_SOURCE_BYTES / MAX_PAYLOAD as u64;
        assert!(ok(MAX_PAYLOAD as u32, n, MAX_PAYLOAD).is_ok());
        assert!(ok(MAX_PAYLOAD as u32, n + 1, MAX_PAYLOAD).is_err());
    }

    /// The client's split of a long stream: every request within the limits, nothing lost.
    #[test]
    fn source_split_stays_within_the_limits() {
        for (size, count) in [
            (0u32, 0u64),
            (0, 5 * MAX_SOURCE_COUNT + 7),
            (1024, 20_000),
            (MAX_PAYLOAD as u32, 20_000),
            (MAX_PAYLOAD as u32, 4096),
        ] {
            let reqs: Vec<_> = SourceRequest::split(size, count).collect();
            assert_eq!(reqs.iter().map(|r| r.count).sum::<u64>(), count);
            for r in &reqs {
                assert!(r.count > 0);
                assert_eq!(SourceRequest::decode(r.encode(), MAX_PAYLOAD), Ok(*r));
            }
        }
        assert_eq!(SourceRequest::split(1024, 20_000).count(), 1);
    }

    /// RPC `recv` with a size above the largest payload is refused, not served.
    #[tokio::test]
    async fn rpc_recv_refuses_sizes_above_the_largest_payload() {
        let addr = server().await;
        let conn = TcpTransport::default().connect(&addr).await.unwrap();
        let client = rpc_client(conn, ClientConfig::default()).await.unwrap();
        let call = |n: u32| {
            let arg = Bytes::copy_from_slice(&n.to_le_bytes());
            tokio::time::timeout(BOUND, client.call(method::RECV, arg))
        };
        let r = call(MAX_PAYLOAD as u32 + 1).await.expect("bounded");
        match r {
            Err(RpcError::Remote(s)) => assert_eq!(s.code, code::INVALID_ARGUMENT),
            other => panic!("not refused: {other:?}"),
        }
        let r = call(4096).await.expect("bounded").unwrap();
        assert_eq!(r.len(), 4096);
    }

    /// Server totals add up live connections and keep what ended connections counted.
    #[test]
    fn server_totals_count_live_and_ended_connections() {
        let counters = Arc::new(ServerCounters::default());
        let m = Arc::new(Metrics::default());
        let counted = counters.register(m.clone());
        m.payload_bytes_copied.add(100);
        assert_eq!(counters.totals().payload_bytes_copied, 100);
        drop(counted);
        assert_eq!(counters.totals().payload_bytes_copied, 100);
        m.payload_bytes_copied.add(5);
        assert_eq!(
            counters.totals().payload_bytes_copied,
            100,
            "an ended connection is no longer read"
        );
    }

    /// Each server counts only the connections it serves: two servers in one process (local
    /// mode runs one per transport) do not see each other's.
    #[tokio::test]
    async fn each_server_counts_only_its_own_connections() {
        let listen = || async {
            TcpTransport::default()
                .listen(&"127.0.0.1:0".parse().unwrap())
                .await
                .unwrap()
        };
        let (a, b) = (listen().await, listen().await);
        let addr = a.local_addr().unwrap();
        let (ours, theirs) = (Arc::<ServerCounters>::default(), Arc::default());
        tokio::spawn(serve(a, ours.clone()));
        tokio::spawn(serve(b, Arc::clone(&theirs)));
        let payload = Bytes::from(vec![1u8; 4096]);
        let (got, closed) = {
            let (mut tx, mut rx) = raw_connection(addr, MODE_ECHO).await;
            tx.send(Message::new(HeaderBytes::EMPTY, payload.clone()))
                .await
                .unwrap();
            let got = tokio::time::timeout(BOUND, rx.recv())
                .await
                .expect("bounded");
            tx.close().await.unwrap();
            let closed = tokio::time::timeout(BOUND, rx.recv())
                .await
                .expect("bounded");
            (got, closed)
        };
        assert_eq!(got.unwrap().unwrap().payload, payload);
        assert!(
            matches!(closed, Ok(None) | Err(_)),
            "the server closed its side"
        );
        let served = ours.totals();
        assert!(
            served.bytes_received >= payload.len() as u64,
            "the serving server counted the echo: {served:?}"
        );
        assert_eq!(
            theirs.totals(),
            MetricsSnapshot::default(),
            "the other server served nothing"
        );
    }
}
