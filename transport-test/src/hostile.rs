//! The hostile-peer suite: written once, run against every backend.
//!
//! A server faces peers it does not control. Each case here plays one such peer and checks
//! the defence that answers it: the case fails if that defence is taken away.
//!
//! - **RPC-level cases** ([`hostile_tests!`](crate::hostile_tests)) run over any
//!   [`Backend`]: a peer that speaks the transport correctly but writes RPC messages by hand
//!   (reused request ids, requests parked in handlers that never finish, a connection closed
//!   under them, a connection left idle) against an [`RpcServer`] with the [`ServerConfig`]
//!   limits the case chooses. What they observe is counted by the handlers ([`Parked`]) and
//!   by the server's [`MemoryBudget`], so they run on verbs as well as on sockets.
//! - **Byte-level cases** ([`hostile_stream_tests!`](crate::hostile_stream_tests)) are for
//!   stream backends (TCP, Unix sockets): a raw socket ([`StreamBackend::connect_raw`]) writes
//!   frames by hand — announcements of huge frames, frames that stop half-way, garbage, wrong
//!   magic, oversized and truncated frames — against an [`RpcServer`] whose transport was
//!   built from a [`StreamConfig`] the case chooses ([`StreamBackend::stream_transport`]).
//!
//! ```text
//! // transport-foo/tests/hostile.rs
//! struct Foo;
//! impl transport_test::conformance::Backend for Foo { /* ... */ }
//! impl transport_test::hostile::StreamBackend for Foo { /* ... */ }
//! transport_test::hostile_tests!(Foo);
//! transport_test::hostile_stream_tests!(Foo);
//! ```
//!
//! Every case runs on its own two-worker runtime under a hard time limit
//! ([`conformance::run`]), and every wait inside a case is bounded. One case re-executes the
//! test binary as a child process that serves RPC under `RLIMIT_AS`; the child is entered
//! through the `hostile_raw_request_is_answered` test when `TRANSPORT_HOSTILE_CHILD` is set.

use crate::conformance::{self, method, Backend, ServiceState, PROMPT};
use bytes::{Bytes, BytesMut};
use futures_util::future::Either;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::codec::Decoder;
use transport_core::budget::MemoryBudget;
use transport_core::{
    Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport,
};
use transport_framed::frame::{encode_prefix, FrameDecoder, PREFIX_LEN};
use transport_framed::StreamConfig;
use transport_rpc::{
    code, ClientConfig, Handler, Kind, Request, RpcClient, RpcHeader, RpcServer, ServerConfig,
    Status, RPC_HEADER_LEN,
};

/// A stream backend, for the byte-level cases: a transport with chosen framing settings, and
/// a raw byte stream to its listeners.
pub trait StreamBackend: Backend {
    /// A plain connected byte stream (a `TcpStream`, a `UnixStream`).
    type Raw: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// The transport under test with these framing settings (budget, frame timeout, ...).
    fn stream_transport(&self, config: StreamConfig) -> Self::T;
    /// Connects a raw byte stream to a listener of this backend at `addr`.
    fn connect_raw(
        &self,
        addr: &<Self::T as Transport>::Addr,
    ) -> impl Future<Output = io::Result<Self::Raw>> + Send;
}

/// The bound on waits that only a broken defence makes long.
pub const WAIT: Duration = Duration::from_secs(10);
const CHILD_ENV: &str = "TRANSPORT_HOSTILE_CHILD";
const CHILD_READY: &str = "HOSTILE_CHILD_LISTENING ";
/// The test that doubles as the child's entry: the name `hostile_stream_tests!` gives it.
const CHILD_ENTRY: &str = "hostile_raw_request_is_answered";
const MIB: usize = 1 << 20;
/// The largest frame the default settings accept, announced by the hostile peers: an RPC
/// request whose header and payload make exactly [`transport_framed::DEFAULT_MAX_MESSAGE_SIZE`].
const MAX_PAYLOAD: usize = transport_framed::DEFAULT_MAX_MESSAGE_SIZE - RPC_HEADER_LEN;

/// Expands to one `#[test]` per RPC-level case for the [`Backend`] expression `$backend`;
/// attributes after it go on every test, as with
/// [`conformance_tests!`](crate::conformance_tests).
#[macro_export]
macro_rules! hostile_tests {
    ($backend:expr $(, #[$attr:meta])* $(,)?) => {
        $crate::__conformance_cases!($backend, $(#[$attr])*; hostile;
            duplicate_request_id_is_refused_and_the_call_in_flight_answered,
            closing_a_connection_cancels_its_handlers_and_frees_their_requests,
            request_bytes_per_connection_bound_the_running_handlers,
            server_budget_bounds_request_bytes_across_connections,
            idle_connection_is_closed_after_idle_timeout,
            a_connection_flood_past_max_connections_leaves_clients_served
        );
    };
}

/// Expands to one `#[test]` per byte-level case for the [`StreamBackend`] expression
/// `$backend`, plus `hostile_raw_request_is_answered` (a raw request gets its reply; also the
/// child-process entry of [`cases::rlimit_as_child_survives_max_size_announcements`]). Expand
/// it at the root of an integration test: the child is found by that test's name.
#[macro_export]
macro_rules! hostile_stream_tests {
    ($backend:expr) => {
        $crate::__conformance_cases!($backend,; hostile;
            many_max_size_announcements_stay_within_the_receive_budget,
            stalled_partial_frames_are_closed_after_frame_timeout,
            rlimit_as_child_survives_max_size_announcements,
            malformed_or_truncated_frames_close_the_connection,
            oversized_frame_is_refused_and_skipped_without_being_stored
        );

        /// A request written by hand on a raw stream is answered (the byte-level cases' raw
        /// peer speaks the framing); doubles as the child-process entry of
        /// `rlimit_as_child_survives_max_size_announcements`.
        #[test]
        fn hostile_raw_request_is_answered() {
            $crate::hostile::raw_request_or_child(&$backend);
        }
    };
}

/// The prefix and RPC header of a request for `method` announcing `payload_len` payload bytes,
/// as a client writes them on a stream.
pub fn request_head(method: u32, id: u64, payload_len: usize) -> Vec<u8> {
    let header = RpcHeader::new(Kind::Request, method, id, payload_len).encode();
    let mut v = encode_prefix(header.len(), payload_len).to_vec();
    v.extend_from_slice(&header);
    v
}

/// A whole request frame, as a client writes it on a stream.
pub fn request_frame(method: u32, id: u64, payload: &[u8]) -> Vec<u8> {
    let mut v = request_head(method, id, payload.len());
    v.extend_from_slice(payload);
    v
}

/// What a raw stream saw next.
#[derive(Debug)]
pub enum Seen {
    /// A whole frame.
    Frame(Message),
    /// The peer closed the stream (end of stream or a reset).
    Closed(Option<io::Error>),
    /// Neither, within the time allowed.
    Nothing,
}

/// Reads the next frame from a raw stream (`buf` keeps what was read ahead), or its end,
/// waiting at most `within`.
pub async fn next_frame<R: AsyncRead + Unpin>(
    raw: &mut R,
    buf: &mut BytesMut,
    within: Duration,
) -> Seen {
    let mut decoder = FrameDecoder::new(usize::MAX >> 1);
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match decoder.decode(buf) {
            Ok(Some(m)) => return Seen::Frame(m),
            Ok(None) => {}
            Err(e) => panic!("the server wrote a malformed frame: {e}"),
        }
        match tokio::time::timeout_at(deadline, raw.read_buf(buf)).await {
            Err(_) => return Seen::Nothing,
            Ok(Ok(0)) => return Seen::Closed(None),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Seen::Closed(Some(e)),
        }
    }
}

/// The RPC header of a frame the server wrote.
fn reply(m: &Message) -> RpcHeader {
    RpcHeader::decode(m.header.as_slice()).expect("the server wrote a valid RPC header")
}

/// The test service of the conformance suite, plus [`BUDGET_USED`]: the bytes charged to
/// `budget` (u64 LE).
fn service_reporting(budget: Arc<MemoryBudget>) -> impl Handler {
    let svc = conformance::service(Arc::new(ServiceState::default()));
    move |req: Request| {
        if req.method == BUDGET_USED {
            let used = budget.used() as u64;
            Either::Left(std::future::ready(Ok(Bytes::copy_from_slice(
                &used.to_le_bytes(),
            ))))
        } else {
            // Boxed: the opaque future type names the service's borrow, a box does not.
            let fut: Pin<Box<dyn Future<Output = Result<Bytes, Status>> + Send>> =
                Box::pin(svc.call(req));
            Either::Right(fut)
        }
    }
}

/// Method of the byte-level cases' service: the bytes charged now to the server transport's
/// receive budget (u64 LE).
pub const BUDGET_USED: u32 = 100;

/// Method of the RPC-level cases' service: counts itself in [`Parked`], holds its request
/// until [`Parked::release`], then answers the request's length (u64 LE).
pub const PARK: u32 = 20;

/// The handlers of the RPC-level cases' service, as the cases observe them.
#[derive(Debug)]
pub struct Parked {
    started: AtomicUsize,
    live: AtomicUsize,
    release: tokio::sync::watch::Sender<bool>,
}

impl Default for Parked {
    fn default() -> Self {
        Parked {
            started: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
            release: tokio::sync::watch::Sender::new(false),
        }
    }
}

impl Parked {
    /// [`PARK`] handlers started so far.
    pub fn started(&self) -> usize {
        self.started.load(Ordering::SeqCst)
    }

    /// [`PARK`] handlers alive now: started, and neither finished nor dropped.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    /// Lets every parked handler, and every later one, finish.
    pub fn release(&self) {
        self.release.send_replace(true);
    }
}

/// Counts a live [`PARK`] handler; dropped with it (when it finishes or is cancelled).
struct LiveGuard(Arc<Parked>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The RPC-level cases' service: [`PARK`], and [`method::ECHO`].
fn parking_service(parked: Arc<Parked>) -> impl Handler {
    move |req: Request| {
        let parked = parked.clone();
        async move {
            match req.method {
                method::ECHO => Ok(req.payload),
                PARK => {
                    parked.started.fetch_add(1, Ordering::SeqCst);
                    parked.live.fetch_add(1, Ordering::SeqCst);
                    let _live = LiveGuard(parked.clone());
                    let mut release = parked.release.subscribe();
                    // The sender lives in `parked`, which this future holds: never closed.
                    let _ = release.wait_for(|&r| r).await;
                    Ok(Bytes::copy_from_slice(
                        &(req.payload.len() as u64).to_le_bytes(),
                    ))
                }
                m => Err(Status::unknown_method(m)),
            }
        }
    }
}

/// A server of the parking service on `b` with these settings; its address and handlers.
async fn parking_server<B: Backend>(
    b: &B,
    config: ServerConfig,
) -> (<B::T as Transport>::Addr, Arc<Parked>) {
    let parked = Arc::new(Parked::default());
    let (addr, _server) = serve(
        b.transport(8 * MIB),
        &b.listen_addr(),
        parking_service(parked.clone()),
        config,
    )
    .await;
    (addr, parked)
}

/// A connection of `b` to `addr`, split: a peer that writes RPC messages by hand.
async fn hand_peer<B: Backend>(
    b: &B,
    addr: &<B::T as Transport>::Addr,
) -> (
    <<B::T as Transport>::Connection as Connection>::Sender,
    <<B::T as Transport>::Connection as Connection>::Receiver,
) {
    let conn = tokio::time::timeout(WAIT, b.transport(8 * MIB).connect(addr))
        .await
        .expect("connect in time")
        .expect("connect");
    conn.split()
}

/// An RPC message as a client would send it.
pub fn rpc_message(kind: Kind, method: u32, id: u64, payload: Bytes) -> Message {
    let header = RpcHeader::new(kind, method, id, payload.len()).encode();
    Message::new(HeaderBytes::from(header), payload)
}

/// The next message from the server, within `within`; `None` if the connection ended
/// (closed or failed) instead. Panics if neither happens in time.
async fn next_message<R: MessageReceiver>(
    rx: &mut R,
    within: Duration,
    what: &str,
) -> Option<(RpcHeader, Bytes)> {
    match tokio::time::timeout(within, rx.recv()).await {
        Ok(Ok(Some(m))) => Some((reply(&m), m.payload)),
        Ok(Ok(None)) | Ok(Err(_)) => None,
        Err(_) => panic!("{what}: nothing from the server within {within:?}"),
    }
}

/// The largest value `f` takes while polled for `window`: how a case shows that something
/// does not happen (more handlers starting) over a time in which it would have.
async fn most_during(window: Duration, mut f: impl FnMut() -> usize) -> usize {
    let start = Instant::now();
    let mut most = f();
    while start.elapsed() < window {
        tokio::time::sleep(Duration::from_millis(5)).await;
        most = most.max(f());
    }
    most
}

/// Sends a 1 MiB [`PARK`] request for each id, in a task (the server may stop reading);
/// the task gives the sender back once all are written.
fn send_parked_requests<S: MessageSender>(
    mut tx: S,
    ids: std::ops::RangeInclusive<u64>,
) -> tokio::task::JoinHandle<S> {
    tokio::spawn(async move {
        for id in ids {
            tx.send(rpc_message(
                Kind::Request,
                PARK,
                id,
                conformance::pattern(MIB, id),
            ))
            .await
            .expect("send a request");
        }
        tx
    })
}

/// Waits until at least `first` parked handlers run, then watches that no more than `most`
/// ever do over a window three times as long as that took (at least 1 s); the most seen.
async fn bounded_while_parked(parked: &Parked, first: usize, most: usize) -> usize {
    let start = Instant::now();
    assert!(
        eventually(WAIT, || parked.started() >= first).await,
        "only {} of the first {first} requests started",
        parked.started()
    );
    let window = (start.elapsed() * 3).max(Duration::from_secs(1));
    let seen = most_during(window, || parked.started()).await;
    assert!(
        seen <= most,
        "{seen} handlers ran at once (at most {most} allowed): the server read on"
    );
    seen
}

/// Reads one response per id (in any order), each answering a 1 MiB request.
async fn collect_replies<R: MessageReceiver>(rx: &mut R, ids: std::ops::RangeInclusive<u64>) {
    let mut want: std::collections::BTreeSet<u64> = ids.collect();
    while !want.is_empty() {
        let (h, payload) = next_message(rx, WAIT, "released calls")
            .await
            .unwrap_or_else(|| panic!("the connection ended; no reply yet for {want:?}"));
        assert_eq!(h.kind, Kind::Response, "{h:?}: {payload:?}");
        assert!(want.remove(&h.request_id), "unexpected reply {h:?}");
        assert_eq!(&payload[..], &(MIB as u64).to_le_bytes());
    }
}

/// An RPC server of `handler` on `transport`, serving in a task; its address.
async fn serve<T: Transport, H: Handler>(
    transport: T,
    addr: &T::Addr,
    handler: H,
    config: ServerConfig,
) -> (T::Addr, RpcServer<H>) {
    let listener = transport.listen(addr).await.expect("listen");
    let addr = listener.local_addr().expect("local addr");
    let server = RpcServer::new(handler, config);
    let s = server.clone();
    tokio::spawn(async move { s.serve(listener).await });
    (addr, server)
}

/// A stream server of the test service with these framing settings; its address and the
/// transport's receive budget.
async fn stream_server<B: StreamBackend>(
    b: &B,
    config: StreamConfig,
) -> (<B::T as Transport>::Addr, Arc<MemoryBudget>) {
    let budget = config.memory_budget.clone();
    let (addr, _server) = serve(
        b.stream_transport(config),
        &b.listen_addr(),
        service_reporting(budget.clone()),
        ServerConfig::default(),
    )
    .await;
    (addr, budget)
}

/// A correct client of the backend, its messages up to `max_message_size`.
async fn good_client<B: Backend>(
    b: &B,
    addr: &<B::T as Transport>::Addr,
    max_message_size: usize,
) -> RpcClient<<<B::T as Transport>::Connection as Connection>::Sender> {
    let conn = tokio::time::timeout(WAIT, b.transport(max_message_size).connect(addr))
        .await
        .expect("a correct client connects in time")
        .expect("connect");
    RpcClient::new(conn, ClientConfig::default())
}

/// A correct client's echo calls (small ones, which need no receive budget) are answered
/// in time.
async fn still_served<S: MessageSender>(c: &RpcClient<S>, what: &str) {
    for (i, len) in [0usize, 100, 10_000, 60_000].into_iter().enumerate() {
        let p = conformance::pattern(len, i as u64);
        let r = tokio::time::timeout(WAIT, c.call(method::ECHO, p.clone()))
            .await
            .unwrap_or_else(|_| panic!("{what}: a correct client's call hung"))
            .unwrap_or_else(|e| panic!("{what}: a correct client's call failed: {e}"));
        assert!(r == p, "{what}: echo of {len} bytes came back wrong");
    }
}

/// Polls `cond` until it holds or `within` passes; whether it held.
/// Asserts that `budget` is all given back within [`WAIT`]; `when` says after what.
async fn all_given_back(budget: &MemoryBudget, when: &str) {
    assert!(
        eventually(WAIT, || budget.used() == 0).await,
        "{} bytes still charged {when}",
        budget.used()
    );
}

async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if cond() {
            return true;
        }
        if start.elapsed() > within {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Raises `RLIMIT_NOFILE`'s soft limit to its hard limit (for cases with many connections).
pub fn raise_nofile_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through a valid pointer.
    let r = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    assert_eq!(r, 0, "getrlimit: {}", io::Error::last_os_error());
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: setrlimit reads one `rlimit` through a valid pointer.
        let r = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
        assert_eq!(r, 0, "setrlimit(NOFILE): {}", io::Error::last_os_error());
    }
}

/// Limits this process's address space (`RLIMIT_AS`, soft and hard) to `bytes`.
fn limit_address_space(bytes: u64) {
    let lim = libc::rlimit {
        rlim_cur: bytes as libc::rlim_t,
        rlim_max: bytes as libc::rlim_t,
    };
    // SAFETY: setrlimit reads one `rlimit` through a valid pointer.
    let r = unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) };
    assert_eq!(r, 0, "setrlimit(AS): {}", io::Error::last_os_error());
}

/// A `Vm*` figure of `/proc/<pid>/status`, in bytes.
fn proc_status_bytes(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line[field.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Address space the child of [`cases::rlimit_as_child_survives_max_size_announcements`]
/// may use: 1.5 GiB.
pub const CHILD_ADDRESS_SPACE: u64 = 3 << 29;
/// Connections that child's hostile peers open.
pub const CHILD_PEERS: usize = 1000;

/// Runs the child server of [`cases::rlimit_as_child_survives_max_size_announcements`] when
/// the child variable is set; otherwise checks that a request written by hand on a raw
/// stream is answered (what every byte-level case relies on).
pub fn raw_request_or_child<B: StreamBackend>(b: &B) {
    if std::env::var_os(CHILD_ENV).is_some() {
        child_server(b);
        return;
    }
    conformance::run("hostile_raw_request_is_answered", async {
        let (addr, _budget) = stream_server(b, StreamConfig::default()).await;
        let mut raw = b.connect_raw(&addr).await.expect("raw connect");
        let big = conformance::pattern(300_000, 3);
        let mut wire = request_frame(method::ECHO, 41, b"by hand");
        wire.extend_from_slice(&request_frame(method::ECHO, 42, &big));
        raw.write_all(&wire).await.expect("write");
        let mut buf = BytesMut::new();
        for (id, payload) in [(41, Bytes::from_static(b"by hand")), (42, big)] {
            match next_frame(&mut raw, &mut buf, WAIT).await {
                Seen::Frame(m) => {
                    let h = reply(&m);
                    assert_eq!((h.kind, h.request_id), (Kind::Response, id));
                    assert!(m.payload == payload, "reply {id} came back wrong");
                }
                other => panic!("expected the reply to {id}, saw {other:?}"),
            }
        }
    });
}

fn child_server<B: StreamBackend>(b: &B) {
    raise_nofile_limit();
    // Before the runtime and its threads exist: everything the server maps counts.
    limit_address_space(CHILD_ADDRESS_SPACE);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        // Default framing settings (512 MiB receive budget, 64 MiB messages) and server.
        let (addr, _budget) = stream_server(b, StreamConfig::default()).await;
        println!("\n{CHILD_READY}{addr}");
        use std::io::Write;
        std::io::stdout().flush().expect("flush");
        // Serve until killed; bounded so that an orphan cannot live forever.
        tokio::time::sleep(conformance::CASE_TIMEOUT).await;
    });
}

/// The cases. Each is an `async fn(&B)` that panics on failure.
pub mod cases {
    use super::*;

    /// A request whose id is already in flight on the connection gets an error reply
    /// (`REQUEST_ID_IN_USE`) at once; the call already running under that id, and the other
    /// calls, go on and are answered. Fails if the server runs the second request (its reply
    /// would be a response), or closes the connection over it.
    pub async fn duplicate_request_id_is_refused_and_the_call_in_flight_answered<B: Backend>(
        b: &B,
    ) {
        let (addr, parked) = parking_server(b, ServerConfig::default()).await;
        let (mut tx, mut rx) = hand_peer(b, &addr).await;
        tx.send(rpc_message(
            Kind::Request,
            PARK,
            7,
            Bytes::from_static(b"first"),
        ))
        .await
        .expect("send");
        assert!(
            eventually(WAIT, || parked.started() == 1).await,
            "the first call never started"
        );
        tx.send(rpc_message(
            Kind::Request,
            method::ECHO,
            7,
            Bytes::from_static(b"again"),
        ))
        .await
        .expect("send");
        tx.send(rpc_message(
            Kind::Request,
            method::ECHO,
            8,
            Bytes::from_static(b"other"),
        ))
        .await
        .expect("send");
        let mut refused = false;
        let mut other = false;
        for _ in 0..2 {
            let (h, payload) = next_message(&mut rx, WAIT, "a duplicate id")
                .await
                .expect("the server closed the connection over a duplicate id");
            match (h.kind, h.request_id) {
                (Kind::Error, 7) => {
                    let s = Status::decode(&payload);
                    assert_eq!(s.code, code::REQUEST_ID_IN_USE, "{s:?}");
                    refused = true;
                }
                (Kind::Response, 8) => {
                    assert_eq!(&payload[..], b"other");
                    other = true;
                }
                _ => panic!("unexpected reply {h:?}: {payload:?}"),
            }
        }
        assert!(refused && other);
        assert_eq!(parked.live(), 1, "the call in flight was disturbed");
        parked.release();
        let (h, payload) = next_message(&mut rx, WAIT, "the first call's reply")
            .await
            .expect("the connection ended before the first call's reply");
        assert_eq!((h.kind, h.request_id), (Kind::Response, 7));
        assert_eq!(&payload[..], &5u64.to_le_bytes(), "the first call's answer");
    }

    /// A peer that closes its connection while its requests (8 x 1 MiB) are parked in
    /// handlers that would never finish gets those handlers dropped within [`PROMPT`], and
    /// the server's memory budget is all given back; no reply is sent for them. Fails if the
    /// server lets the handlers of a closed connection run on (`cancel_on_close`).
    pub async fn closing_a_connection_cancels_its_handlers_and_frees_their_requests<B: Backend>(
        b: &B,
    ) {
        let budget = MemoryBudget::new(64 * MIB);
        let mut config = ServerConfig::default();
        config.memory_budget = budget.clone();
        let (addr, parked) = parking_server(b, config).await;
        let (mut tx, mut rx) = hand_peer(b, &addr).await;
        const N: usize = 8;
        for id in 1..=N as u64 {
            tx.send(rpc_message(
                Kind::Request,
                PARK,
                id,
                conformance::pattern(MIB, id),
            ))
            .await
            .expect("send");
        }
        assert!(
            eventually(WAIT, || parked.live() == N && budget.used() == N * MIB).await,
            "the requests never all ran: {} live, {} bytes charged",
            parked.live(),
            budget.used()
        );
        tx.close().await.expect("close");
        let closed = Instant::now();
        assert!(
            eventually(PROMPT, || parked.live() == 0).await,
            "{} handlers of a closed connection still run after {PROMPT:?}",
            parked.live()
        );
        assert!(
            eventually(PROMPT, || budget.used() == 0).await,
            "{} bytes still charged after the connection closed",
            budget.used()
        );
        eprintln!(
            "{N} parked handlers dropped {:?} after their connection closed",
            closed.elapsed()
        );
        if let Some((h, _)) = next_message(&mut rx, WAIT, "after closing").await {
            panic!("a cancelled call was answered: {h:?}");
        }
        assert_eq!(parked.started(), N);
        let c = good_client(b, &addr, MIB).await;
        still_served(&c, "after a peer closed with calls running").await;
    }

    /// With `max_request_bytes_per_connection` = 4 MiB, a peer sending 10 x 1 MiB requests to
    /// handlers that wait gets at most 5 of them running (the server stops reading that
    /// connection), and all 10 complete once the handlers are released. Fails if the server
    /// reads on regardless (all 10 would run).
    pub async fn request_bytes_per_connection_bound_the_running_handlers<B: Backend>(b: &B) {
        let mut config = ServerConfig::default();
        config.max_request_bytes_per_connection = 4 * MIB;
        let (addr, parked) = parking_server(b, config).await;
        let (tx, mut rx) = hand_peer(b, &addr).await;
        const N: u64 = 10;
        let sender = send_parked_requests(tx, 1..=N);
        let limited = bounded_while_parked(&parked, 4, 5).await;
        parked.release();
        collect_replies(&mut rx, 1..=N).await;
        let _tx = tokio::time::timeout(WAIT, sender)
            .await
            .expect("all requests written once the handlers finished")
            .expect("sender");
        assert_eq!(parked.started(), N as usize);
        eprintln!("per-connection request bytes: at most {limited} of {N} x 1 MiB ran at once");
    }

    /// With a server-wide `memory_budget` of 4 MiB, two peers sending 5 x 1 MiB requests each
    /// to handlers that wait get at most 4 + 2 of them running together (a connection that
    /// holds nothing may always read one request, so each may take one past the budget), and
    /// all 10
    /// complete once the handlers are released, the budget all given back. Fails if the
    /// server reads on regardless (all 10 would run).
    pub async fn server_budget_bounds_request_bytes_across_connections<B: Backend>(b: &B) {
        let budget = MemoryBudget::new(4 * MIB);
        let mut config = ServerConfig::default();
        config.memory_budget = budget.clone();
        let (addr, parked) = parking_server(b, config).await;
        let (tx_a, mut rx_a) = hand_peer(b, &addr).await;
        let (tx_b, mut rx_b) = hand_peer(b, &addr).await;
        let sender_a = send_parked_requests(tx_a, 1..=5);
        let sender_b = send_parked_requests(tx_b, 6..=10);
        let limited = bounded_while_parked(&parked, 4, 6).await;
        assert!(
            budget.used() <= 6 * MIB,
            "{} bytes charged, past the budget by more than a request per connection",
            budget.used()
        );
        parked.release();
        collect_replies(&mut rx_a, 1..=5).await;
        collect_replies(&mut rx_b, 6..=10).await;
        for sender in [sender_a, sender_b] {
            let _tx = tokio::time::timeout(WAIT, sender)
                .await
                .expect("all requests written once the handlers finished")
                .expect("sender");
        }
        all_given_back(&budget, "after every call finished").await;
        eprintln!("server budget: at most {limited} of 2 x 5 x 1 MiB ran at once");
    }

    /// With `idle_timeout` = 1 s, a connection with nothing running and nothing arriving is
    /// closed by the server within [`WAIT`], not before the timeout; one whose call is still
    /// running stays open past it, gets its reply, and is closed once idle. Fails if idle
    /// connections are kept (or if running calls count as idle).
    pub async fn idle_connection_is_closed_after_idle_timeout<B: Backend>(b: &B) {
        let idle = Duration::from_secs(1);
        let mut config = ServerConfig::default();
        config.idle_timeout = Some(idle);
        let (addr, parked) = parking_server(b, config).await;
        let connected = Instant::now();
        let (_tx, mut rx) = hand_peer(b, &addr).await;
        if let Some((h, _)) = next_message(&mut rx, WAIT + idle, "an idle connection").await {
            panic!("the server sent {h:?} unasked");
        }
        let after = connected.elapsed();
        assert!(
            after >= idle.mul_f32(0.9),
            "closed after {after:?}, before the {idle:?} idle timeout"
        );
        eprintln!("an idle connection was closed after {after:?}");

        let (mut tx, mut rx) = hand_peer(b, &addr).await;
        tx.send(rpc_message(
            Kind::Request,
            PARK,
            1,
            Bytes::from_static(b"wait"),
        ))
        .await
        .expect("send");
        assert!(
            eventually(WAIT, || parked.started() == 1).await,
            "the call never started"
        );
        // Three idle timeouts with a call running: the connection must stay open.
        match tokio::time::timeout(idle * 3, rx.recv()).await {
            Err(_) => {}
            Ok(r) => panic!("a connection with a call running ended or spoke: {r:?}"),
        }
        parked.release();
        let (h, _) = next_message(&mut rx, WAIT, "the running call's reply")
            .await
            .expect("the connection ended before the running call's reply");
        assert_eq!((h.kind, h.request_id), (Kind::Response, 1));
        let replied = Instant::now();
        if let Some((h, _)) = next_message(&mut rx, WAIT + idle, "idle again").await {
            panic!("the server sent {h:?} unasked");
        }
        assert!(
            replied.elapsed() >= idle.mul_f32(0.9),
            "closed {:?} after the call ended, before the idle timeout",
            replied.elapsed()
        );
    }

    /// With `max_connections` = 4, a correct client connected first keeps being served while
    /// 8 more connections (twice the limit) arrive and never send a frame: the server serves
    /// 4 at most at once (it stops accepting; the rest wait in the listener's queue), and once
    /// the flood goes, the connections it left waiting are served and ended and a new client
    /// is served. Fails if the server accepts past its limit, or if the flood starves the
    /// client or the accept loop.
    pub async fn a_connection_flood_past_max_connections_leaves_clients_served<B: Backend>(b: &B) {
        const MAX: usize = 4;
        let mut config = ServerConfig::default();
        config.max_connections = MAX;
        config.idle_timeout = None;
        let parked = Arc::new(Parked::default());
        let (addr, server) = serve(
            b.transport(8 * MIB),
            &b.listen_addr(),
            parking_service(parked),
            config,
        )
        .await;
        let client = good_client(b, &addr, MIB).await;
        still_served(&client, "before the flood").await;
        // Each flood connection is held until `go` is sent; connects past the limit may wait
        // for the server (or fail): the flood's tasks are not awaited one by one.
        let (go, _) = tokio::sync::broadcast::channel::<()>(1);
        let mut flood = tokio::task::JoinSet::new();
        for _ in 0..2 * MAX {
            let (t, addr, mut gone) = (b.transport(8 * MIB), addr.clone(), go.subscribe());
            flood.spawn(async move {
                let conn = t.connect(&addr).await;
                let _ = gone.recv().await;
                drop(conn);
            });
        }
        assert!(
            eventually(WAIT, || server.connections() == MAX).await,
            "the flood was not served up to the limit: {} connections served",
            server.connections()
        );
        let most = most_during(Duration::from_millis(500), || server.connections()).await;
        assert!(
            most <= MAX,
            "{most} connections served with max_connections {MAX}"
        );
        still_served(&client, "during a flood of twice max_connections").await;
        assert_eq!(
            server.connections(),
            MAX,
            "the limit is not kept while flooded"
        );
        drop(go);
        tokio::time::timeout(WAIT, async { while flood.join_next().await.is_some() {} })
            .await
            .expect("the flood's connections went");
        // The connections left waiting are accepted, find their peer gone, and end.
        assert!(
            eventually(WAIT, || server.connections() == 1).await,
            "{} connections still served after the flood went (the client's is 1)",
            server.connections()
        );
        let late = good_client(b, &addr, MIB).await;
        still_served(&late, "a client connecting after the flood").await;
        still_served(&client, "after the flood").await;
    }

    /// 200 connections each announce a frame of the largest size (64 MiB) and send nothing
    /// more. The receivers hold at most the transport's receive budget (8 MiB here, a frame's
    /// first 64 KiB chunk each, the others wait for budget), a correct client is served
    /// meanwhile, and the budget is all given back once the peers go.
    ///
    /// Fails if a receiver reserves the announced length (charged: the first one takes
    /// 64 MiB + 8 > the limit), or charges without waiting for room.
    pub async fn many_max_size_announcements_stay_within_the_receive_budget<B: StreamBackend>(
        b: &B,
    ) {
        raise_nofile_limit();
        let limit = 8 * MIB;
        let mut config = StreamConfig::default();
        config.memory_budget = MemoryBudget::new(limit);
        let (addr, budget) = stream_server(b, config).await;
        let mut peers = Vec::new();
        for id in 0..200u64 {
            let mut raw = tokio::time::timeout(WAIT, b.connect_raw(&addr))
                .await
                .expect("raw connect in time")
                .expect("raw connect");
            raw.write_all(&request_head(method::ECHO, id, MAX_PAYLOAD))
                .await
                .expect("announce");
            peers.push(raw);
            assert!(budget.used() <= limit, "held {} bytes", budget.used());
        }
        // The receivers have read the announcements once the budget is spent.
        let mut most = 0;
        let full = eventually(WAIT, || {
            most = most.max(budget.used());
            most > limit || budget.used() == limit
        })
        .await;
        assert!(
            most <= limit,
            "held {most} bytes, over the {limit}-byte budget"
        );
        assert!(
            full,
            "the announcements never used the budget: {} bytes",
            budget.used()
        );
        let c = good_client(b, &addr, MIB).await;
        still_served(&c, "while 200 peers announce 64 MiB frames").await;
        assert!(budget.used() <= limit, "held {} bytes", budget.used());
        drop(peers);
        all_given_back(&budget, "after the peers left").await;
        still_served(&c, "after the peers left").await;
    }

    /// Frames that stop part-way (in the prefix, in a small frame, in a large frame's
    /// payload) and then go silent are closed by the server once `frame_timeout` (1 s here)
    /// passes without progress: not before, and within [`WAIT`]. A correct client is served
    /// throughout. Fails without the frame timeout (the connections stay open forever).
    pub async fn stalled_partial_frames_are_closed_after_frame_timeout<B: StreamBackend>(b: &B) {
        let timeout = Duration::from_secs(1);
        let mut config = StreamConfig::default();
        config.frame_timeout = Some(timeout);
        let (addr, budget) = stream_server(b, config).await;
        let small = request_frame(method::ECHO, 1, &[7u8; 100]);
        let mut large = request_head(method::ECHO, 2, MAX_PAYLOAD);
        large.extend_from_slice(&[7u8; 5000]);
        let partial: [(&str, &[u8]); 4] = [
            ("half a prefix", &small[..3]),
            ("half a header", &small[..PREFIX_LEN + 10]),
            ("a small frame's first bytes", &small[..PREFIX_LEN + 30]),
            ("a max-size frame's first bytes", &large),
        ];
        let c = good_client(b, &addr, MIB).await;
        let mut stalled = Vec::new();
        for (what, bytes) in partial {
            let mut raw = b.connect_raw(&addr).await.expect("raw connect");
            raw.write_all(bytes).await.expect("write");
            stalled.push((what, raw, Instant::now()));
        }
        still_served(&c, "while frames stall").await;
        for (what, mut raw, sent) in stalled {
            let mut buf = BytesMut::new();
            match next_frame(&mut raw, &mut buf, WAIT + timeout).await {
                Seen::Closed(_) => {}
                Seen::Frame(m) => panic!("{what}: the server answered {m:?}"),
                Seen::Nothing => panic!("{what}: still open {:?} after it stalled", sent.elapsed()),
            }
            let after = sent.elapsed();
            assert!(
                after >= timeout.mul_f32(0.9),
                "{what}: closed after {after:?}, before the {timeout:?} frame timeout"
            );
            eprintln!("{what}: closed {after:?} after it stalled");
        }
        all_given_back(&budget, "after the stalled frames were closed").await;
        still_served(&c, "after the stalled frames were closed").await;
    }

    /// The address-space case, in a child process: an RPC server with default settings
    /// (512 MiB receive budget, 64 MiB messages) under `RLIMIT_AS` = 1.5 GiB faces
    /// [`CHILD_PEERS`] connections that each announce a 64 MiB frame and send a few bytes of
    /// it. Every announcement is charged to the server's receive budget (at least a 64 KiB
    /// first chunk each), which stays within its limit, a correct client's
    /// calls are answered, the child is alive, and its resident memory (printed) is below the
    /// budget. Fails if a receiver reserves what a peer announces (1000 x 64 MiB of address
    /// space: the child aborts on the first failed allocation).
    pub async fn rlimit_as_child_survives_max_size_announcements<B: StreamBackend>(b: &B) {
        raise_nofile_limit();
        let (mut child, addr) =
            crate::conformance::spawn_child_server::<<B::T as Transport>::Addr>(
                CHILD_ENTRY,
                CHILD_ENV,
                CHILD_READY,
            )
            .await;
        let pid = child.id().expect("child pid");

        let mut peers = Vec::with_capacity(CHILD_PEERS);
        for id in 0..CHILD_PEERS as u64 {
            let mut wire = request_head(method::ECHO, id, MAX_PAYLOAD);
            wire.extend_from_slice(&[0xAB; 16]);
            let peer = tokio::time::timeout(WAIT, async {
                let mut raw = b.connect_raw(&addr).await?;
                raw.write_all(&wire).await?;
                Ok::<_, io::Error>(raw)
            })
            .await;
            match peer {
                Ok(Ok(raw)) => peers.push(raw),
                Ok(Err(e)) => panic!(
                    "peer {id} could not connect and announce: {e}; the child: {:?}",
                    child.try_wait()
                ),
                Err(_) => panic!("peer {id}: connecting and announcing hung"),
            }
        }
        let c = good_client(b, &addr, MIB).await;
        let budget_limit = transport_framed::DEFAULT_RECEIVE_BUDGET as u64;
        // A frame's first chunk is at least 64 KiB.
        let every_announcement = CHILD_PEERS as u64 * (64 << 10);
        // Wait until the child's receivers have taken all the budget they may.
        let start = Instant::now();
        let mut used = 0;
        while start.elapsed() < WAIT * 2 {
            let r = tokio::time::timeout(WAIT, c.call(BUDGET_USED, Bytes::new()))
                .await
                .expect("the budget query hung");
            let r = match r {
                Ok(r) => r,
                Err(e) => panic!(
                    "the child stopped serving ({e}); exited: {:?}",
                    child.try_wait()
                ),
            };
            used = u64::from_le_bytes(r[..8].try_into().expect("u64"));
            assert!(
                used <= budget_limit,
                "the child holds {used} bytes, over its {budget_limit}-byte budget"
            );
            if used >= every_announcement {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            used >= every_announcement,
            "the announcements were not all charged to the child's receive budget: {used}"
        );
        still_served(&c, "the child, under RLIMIT_AS").await;
        assert!(child.try_wait().expect("wait").is_none(), "the child died");
        let rss = proc_status_bytes(pid, "VmRSS:").expect("the child's VmRSS");
        let peak = proc_status_bytes(pid, "VmPeak:").expect("the child's VmPeak");
        eprintln!(
            "RLIMIT_AS child: {CHILD_PEERS} peers announcing 64 MiB frames; receive budget \
             {used} of {budget_limit} bytes used; VmRSS {} MiB, VmPeak {} MiB (limit {} MiB)",
            rss >> 20,
            peak >> 20,
            CHILD_ADDRESS_SPACE >> 20
        );
        assert!(
            rss < budget_limit,
            "the child's resident memory ({rss} bytes) is over its receive budget"
        );
        drop(peers);
        tokio::time::timeout(WAIT, child.kill())
            .await
            .expect("killed in time")
            .expect("kill the child");
    }

    /// Bytes that are not this framing (text, wrong magic, wrong version, a header longer
    /// than allowed) and frames cut short by the peer's end of stream make the server close
    /// that connection without answering, within [`PROMPT`]; a correct client is served
    /// afterwards. The bad-magic and bad-version frames are otherwise valid echo requests, so
    /// a receiver that skipped either check would have them answered. (An over-long header is
    /// refused by the RPC header check too, and a cut frame by the RPC length check: those
    /// sub-cases show no hang and no answer, not one defence alone.)
    pub async fn malformed_or_truncated_frames_close_the_connection<B: StreamBackend>(b: &B) {
        let (addr, budget) = stream_server(b, StreamConfig::default()).await;
        let good = request_frame(method::ECHO, 9, b"hello");
        let mut bad_magic = good.clone();
        bad_magic[..2].copy_from_slice(b"XX");
        let mut bad_version = good.clone();
        bad_version[2] = 9;
        // A header of 65 bytes: the RPC header, padded.
        let mut long_header = encode_prefix(0, 5).to_vec();
        long_header[3] = 65;
        long_header.extend_from_slice(&good[PREFIX_LEN..PREFIX_LEN + RPC_HEADER_LEN]);
        long_header.extend_from_slice(&[0u8; 65 - RPC_HEADER_LEN]);
        long_header.extend_from_slice(b"hello");
        let mut large = request_head(method::ECHO, 10, 512 * 1024);
        large.extend_from_slice(&[1u8; 200 * 1024]);
        let malformed: [(&str, &[u8]); 4] = [
            ("text", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
            ("bad magic", &bad_magic),
            ("bad version", &bad_version),
            ("header over MAX_HEADER_LEN", &long_header),
        ];
        let truncated: [(&str, &[u8]); 4] = [
            ("cut in the prefix", &good[..5]),
            ("cut in the header", &good[..PREFIX_LEN + 12]),
            ("cut in the payload", &good[..good.len() - 2]),
            ("a large frame cut in its payload", &large),
        ];
        for (what, bytes, end) in malformed
            .iter()
            .map(|&(w, b)| (w, b, false))
            .chain(truncated.iter().map(|&(w, b)| (w, b, true)))
        {
            let mut raw = b.connect_raw(&addr).await.expect("raw connect");
            raw.write_all(bytes).await.expect("write");
            if end {
                raw.shutdown().await.expect("end the stream");
            }
            let mut buf = BytesMut::new();
            match next_frame(&mut raw, &mut buf, PROMPT).await {
                Seen::Closed(_) => {}
                Seen::Frame(m) => panic!("{what}: the server answered {m:?}"),
                Seen::Nothing => panic!("{what}: the server neither answered nor closed"),
            }
        }
        all_given_back(&budget, "").await;
        let c = good_client(b, &addr, MIB).await;
        still_served(&c, "after malformed frames").await;
    }

    /// A request frame above the server's message limit (1 MiB here; announced 4 MiB, and
    /// 4 GiB) is answered with `MESSAGE_TOO_LARGE` as soon as its header arrives, its payload
    /// is skipped as it arrives without being stored (the receive budget stays empty), and
    /// the same connection then serves a normal request. Fails if the limit is not checked
    /// (the request would be read and answered), or the payload were taken as frames.
    pub async fn oversized_frame_is_refused_and_skipped_without_being_stored<B: StreamBackend>(
        b: &B,
    ) {
        let mut config = StreamConfig::default();
        config.max_message_size = MIB;
        let (addr, budget) = stream_server(b, config).await;
        let mut raw = b.connect_raw(&addr).await.expect("raw connect");
        let mut buf = BytesMut::new();
        let expect_too_large = |seen: Seen, id: u64| match seen {
            Seen::Frame(m) => {
                let h = reply(&m);
                assert_eq!((h.kind, h.request_id), (Kind::Error, id), "{m:?}");
                let s = Status::decode(&m.payload);
                assert_eq!(s.code, code::MESSAGE_TOO_LARGE, "{s:?}");
            }
            other => panic!("expected MESSAGE_TOO_LARGE for {id}, saw {other:?}"),
        };
        let big = 4 * MIB;
        raw.write_all(&request_head(method::ECHO, 1, big))
            .await
            .expect("write");
        expect_too_large(next_frame(&mut raw, &mut buf, PROMPT).await, 1);
        // The payload, written in pieces: frames hidden in it are not frames.
        let inner = request_frame(method::ECHO, 666, b"smuggled");
        let mut payload = Vec::with_capacity(big);
        while payload.len() + inner.len() <= big {
            payload.extend_from_slice(&inner);
        }
        payload.resize(big, 0);
        for chunk in payload.chunks(256 * 1024) {
            raw.write_all(chunk).await.expect("payload");
            assert_eq!(budget.used(), 0, "the skipped payload was stored");
        }
        raw.write_all(&request_frame(method::ECHO, 2, b"after"))
            .await
            .expect("write");
        match next_frame(&mut raw, &mut buf, WAIT).await {
            Seen::Frame(m) => {
                let h = reply(&m);
                assert_eq!((h.kind, h.request_id), (Kind::Response, 2), "{m:?}");
                assert_eq!(&m.payload[..], b"after");
            }
            other => panic!("expected the reply to 2, saw {other:?}"),
        }
        // The largest length the prefix can carry: refused the same way, nothing stored.
        let mut raw = b.connect_raw(&addr).await.expect("raw connect");
        let mut buf = BytesMut::new();
        raw.write_all(&request_head(method::ECHO, 3, u32::MAX as usize))
            .await
            .expect("write");
        expect_too_large(next_frame(&mut raw, &mut buf, PROMPT).await, 3);
        raw.write_all(&[0u8; 64 * 1024]).await.expect("payload");
        assert_eq!(budget.used(), 0, "the skipped payload was stored");
        let c = good_client(b, &addr, MIB).await;
        still_served(&c, "after oversized frames").await;
    }
}
