//! Blocking RPC: a synchronous client and a thread-per-connection server over `std` sockets,
//! in the same wire format as [`RpcClient`](super::RpcClient) and
//! [`RpcServer`](super::RpcServer) (each interoperates with the other kind).
//!
//! ```no_run
//! use bytes::Bytes;
//! use std::os::unix::net::{UnixListener, UnixStream};
//! use transport_rpc::blocking::{BlockingClient, BlockingConfig, BlockingServer};
//! use transport_rpc::{Request, ServerConfig, Status};
//!
//! let rt = tokio::runtime::Runtime::new().unwrap(); // runs handlers that wait on I/O or timers
//! let handler = |req: Request| async move { Ok::<_, Status>(req.payload) };
//! let server = BlockingServer::new(handler, ServerConfig::default(), BlockingConfig::default(), rt.handle().clone());
//! let listener = UnixListener::bind("/tmp/echo.sock").unwrap();
//! let s = server.clone();
//! std::thread::spawn(move || s.serve(listener));
//!
//! let mut client = BlockingClient::new(UnixStream::connect("/tmp/echo.sock").unwrap(), BlockingConfig::default()).unwrap();
//! assert_eq!(client.call(1, b"hi").unwrap(), Bytes::from_static(b"hi"));
//! ```
//!
//! # Why a second I/O model
//!
//! An event loop pays, on each side of every round trip, a wait in `epoll_wait` and then the
//! read, plus its scheduler's work; a thread blocked in `recv` is woken by the kernel with the
//! data. With client and server on one CPU that is the difference between clearly above and
//! about equal to the machine's own blocking-socket ping-pong
//! (`docs/notes/2026-12-02-bench-blocking-rpc.md`). Classic ORBs (omniORB's
//! thread per connection) answer this way. The price: a thread per connection on the server,
//! one call at a time per client, and no concurrency between the calls of one connection.
//! Use it for synchronous callers that want the lowest latency; use the async client and
//! server for many connections, pipelining and throughput.
//!
//! # Limits (the same rules as the async path)
//!
//! - A frame is validated by [`FrameDecoder`]: wrong magic, version or lengths end the
//!   connection with a typed error. A message over [`BlockingConfig::max_message_size`] is
//!   skipped without being buffered (the server answers a request with
//!   [`code::MESSAGE_TOO_LARGE`], the client returns [`RpcError::ResponseTooLarge`]).
//! - Nothing is allocated from an announced length: a frame's buffer grows at most by what
//!   has arrived (doubling), so holding memory takes sending it.
//! - A frame that has started and makes no progress for [`BlockingConfig::frame_timeout`]
//!   ends the connection with [`TransportError::Stalled`].
//! - The server runs at most [`BlockingConfig::max_connections`] connection threads; a
//!   connection beyond that is closed at once. [`ServerConfig::idle_timeout`] and
//!   [`ServerConfig::handler_timeout`] apply as on the async server.
//! - The client's deadline bounds the whole call, writing included; a call past it returns
//!   [`RpcError::DeadlineExceeded`], tells the server to cancel, and its late answer is
//!   skipped by the next call.

use super::error::{code, ProtocolError, RpcError, Status};
use super::header::{Kind, RpcHeader, RPC_HEADER_LEN};
use super::server::{Handler, Request, ServerConfig};
use bytes::{Bytes, BytesMut};
use std::collections::HashMap;
use std::future::Future;
use std::io::{self, IoSlice, Write};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::codec::Decoder;
use transport_core::{HeapPool, Message, Metrics, TransportError};
use transport_framed::frame::{encode_prefix, FrameDecoder, PREFIX_LEN};
use transport_framed::{DEFAULT_FRAME_TIMEOUT, DEFAULT_MAX_MESSAGE_SIZE};

/// Default of [`BlockingConfig::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Bytes read at once between frames (a frame in progress grows by what has arrived).
const READ_CHUNK: usize = 64 << 10;
/// How long a cancel for a call past its deadline may wait for room in the socket.
const CANCEL_WRITE_TIMEOUT: Duration = Duration::from_millis(100);

/// Settings of the blocking client and server.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BlockingConfig {
    /// Largest message (RPC header + payload) sent or accepted (default 64 MiB).
    pub max_message_size: usize,
    /// A frame that has started and gets no more bytes for this long fails the connection
    /// (default 30 s).
    pub frame_timeout: Duration,
    /// Server: most connections served at once, each on its own thread (default 256).
    pub max_connections: usize,
    /// Client: deadline of a call made without one (default `None`: wait as long as the
    /// connection lives).
    pub default_deadline: Option<Duration>,
    /// Before blocking in `recv`, poll the socket for up to this long (yielding the CPU
    /// between polls): when the peer runs on another CPU its answer then arrives without a
    /// cross-CPU wake-up (expensive on a VM). Default zero (never); ignored where the process
    /// may use one CPU only ([`transport_core::spin::useful_budget`]). Spins that keep finding nothing
    /// are skipped for a while, as in [`transport_core::spin`].
    pub spin: Duration,
}

impl Default for BlockingConfig {
    fn default() -> Self {
        BlockingConfig {
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            frame_timeout: DEFAULT_FRAME_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            default_deadline: None,
            spin: Duration::ZERO,
        }
    }
}

impl BlockingConfig {
    /// These settings with another [`BlockingConfig::max_message_size`].
    pub fn with_max_message_size(mut self, max: usize) -> Self {
        self.max_message_size = max;
        self
    }
    /// These settings with another [`BlockingConfig::frame_timeout`].
    pub fn with_frame_timeout(mut self, timeout: Duration) -> Self {
        self.frame_timeout = timeout;
        self
    }
    /// These settings with another [`BlockingConfig::max_connections`].
    pub fn with_max_connections(mut self, max: usize) -> Self {
        self.max_connections = max;
        self
    }
    /// These settings with another [`BlockingConfig::spin`].
    pub fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }
    /// These settings with another [`BlockingConfig::default_deadline`].
    pub fn with_default_deadline(mut self, deadline: Option<Duration>) -> Self {
        self.default_deadline = deadline;
        self
    }
}

/// A connected stream socket the blocking client and server can use: `std`'s TCP and Unix
/// stream sockets.
pub trait BlockingSocket: io::Read + Write + AsRawFd + Send + Sized + 'static {
    /// Puts the socket in blocking mode and sets per-connection options (TCP: no Nagle
    /// delay).
    fn prepare(&self) -> io::Result<()>;
    /// `SO_RCVTIMEO` (`None`: wait forever).
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()>;
    /// `SO_SNDTIMEO` (`None`: wait forever).
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()>;
    /// Another handle on the same socket.
    fn try_clone(&self) -> io::Result<Self>;
    /// Shuts the socket down in one or both directions.
    fn shutdown(&self, how: Shutdown) -> io::Result<()>;
}

impl BlockingSocket for std::net::TcpStream {
    fn prepare(&self) -> io::Result<()> {
        self.set_nonblocking(false)?;
        self.set_nodelay(true)
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        std::net::TcpStream::set_read_timeout(self, t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        std::net::TcpStream::set_write_timeout(self, t)
    }
    fn try_clone(&self) -> io::Result<Self> {
        std::net::TcpStream::try_clone(self)
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        std::net::TcpStream::shutdown(self, how)
    }
}

impl BlockingSocket for std::os::unix::net::UnixStream {
    fn prepare(&self) -> io::Result<()> {
        self.set_nonblocking(false)
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        std::os::unix::net::UnixStream::set_read_timeout(self, t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        std::os::unix::net::UnixStream::set_write_timeout(self, t)
    }
    fn try_clone(&self) -> io::Result<Self> {
        std::os::unix::net::UnixStream::try_clone(self)
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        std::os::unix::net::UnixStream::shutdown(self, how)
    }
}

/// A listening socket [`BlockingServer::serve`] accepts on: `std`'s TCP and Unix listeners.
pub trait BlockingListener: AsRawFd + Send + 'static {
    /// The connections it accepts.
    type Socket: BlockingSocket;
    /// Waits for the next connection.
    fn accept_socket(&self) -> io::Result<Self::Socket>;
}

impl BlockingListener for std::net::TcpListener {
    type Socket = std::net::TcpStream;
    fn accept_socket(&self) -> io::Result<Self::Socket> {
        self.accept().map(|(s, _)| s)
    }
}

impl BlockingListener for std::os::unix::net::UnixListener {
    type Socket = std::os::unix::net::UnixStream;
    fn accept_socket(&self) -> io::Result<Self::Socket> {
        self.accept().map(|(s, _)| s)
    }
}

/// What one read of a frame gave.
#[derive(Debug)]
enum Got {
    Message(Message),
    /// A message over the limit: its header, its payload being skipped.
    TooLarge {
        len: u64,
        max: u64,
        header: transport_core::HeaderBytes,
    },
    /// The peer closed the connection between frames.
    Closed,
    /// The caller's time limit passed (between frames, or within the frame timeout).
    TimedOut,
}

/// How long [`FrameReader::next`] may wait.
#[derive(Debug, Clone, Copy)]
enum Limit {
    /// Until then for the whole message (`None`: no limit).
    Deadline(Option<Instant>),
    /// Until then for a message to start (`None`: no limit).
    Idle(Option<Instant>),
}

/// Reads frames off a blocking socket: [`FrameDecoder`] over a buffer that grows only by
/// what arrives, with the socket's receive timeout kept in step with the time limits.
struct FrameReader {
    metrics: Arc<Metrics>,
    /// How long to poll before a blocking `recv` (zero: never).
    spin: Duration,
    decoder: FrameDecoder,
    buf: BytesMut,
    frame_timeout: Duration,
    /// The receive timeout last set on the socket (saves a `setsockopt` per read).
    timeout_set: Option<Option<Duration>>,
}

impl FrameReader {
    fn new(config: &BlockingConfig, metrics: Arc<Metrics>) -> FrameReader {
        FrameReader {
            metrics,
            spin: transport_core::spin::useful_budget(
                config.spin,
                transport_core::spin::available_cpus(),
            ),
            decoder: FrameDecoder::new(config.max_message_size),
            buf: BytesMut::new(),
            frame_timeout: config.frame_timeout,
            timeout_set: None,
        }
    }

    /// The next message, waiting until `until` (`None`: forever): for the whole message (a
    /// call's deadline), or with `Limit::Idle` only for one to start (a message arriving is
    /// not idle; the frame timeout bounds it).
    fn next<S: BlockingSocket>(
        &mut self,
        socket: &mut S,
        limit: Limit,
    ) -> Result<Got, TransportError> {
        loop {
            let until = match limit {
                Limit::Deadline(u) => u,
                Limit::Idle(_) if !self.decoder.is_idle(&self.buf) => None,
                Limit::Idle(u) => u,
            };
            match self.decoder.decode(&mut self.buf) {
                Ok(Some(m)) => {
                    self.metrics.messages_received.incr();
                    return Ok(Got::Message(m));
                }
                Ok(None) => {}
                Err(TransportError::MessageTooLarge { len, max, header }) => {
                    return Ok(Got::TooLarge { len, max, header })
                }
                Err(e) => return Err(e),
            }
            let started = !self.decoder.is_idle(&self.buf);
            // No limit (between frames, no deadline): no clock read.
            let now = (started || until.is_some()).then(Instant::now);
            let stall_at = now.filter(|_| started).map(|n| n + self.frame_timeout);
            let limit = match (stall_at, until) {
                (Some(s), Some(u)) => Some(s.min(u)),
                (s, u) => s.or(u),
            };
            let timeout = match (limit, now) {
                (Some(l), Some(now)) if l <= now => return Ok(Got::TimedOut),
                // SO_RCVTIMEO rounds to microseconds; zero would mean "forever".
                (Some(l), Some(now)) => Some((l - now).max(Duration::from_micros(1))),
                _ => None,
            };
            if self.timeout_set != Some(timeout) {
                socket.set_read_timeout(timeout)?;
                self.timeout_set = Some(timeout);
            }
            // Between frames read a chunk; within one, at most its rest and at most as much
            // as has arrived (at least a chunk): memory follows bytes received.
            let want = match self.decoder.pending_frame_len() {
                Some(len) => (len - self.buf.len()).min(READ_CHUNK.max(self.buf.len())),
                None => READ_CHUNK,
            };
            let mut got = None;
            if !self.spin.is_zero() {
                let (buf, metrics) = (&mut self.buf, &self.metrics);
                transport_core::spin::spin(self.spin, || {
                    match recv_into(socket, buf, want, libc::MSG_DONTWAIT, metrics) {
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
                        r => {
                            got = Some(r);
                            true
                        }
                    }
                });
            }
            let got = match got {
                Some(r) => r,
                None => recv_into(socket, &mut self.buf, want, 0, &self.metrics),
            };
            match got {
                Ok(0) if !started => return Ok(Got::Closed),
                Ok(0) => {
                    let (received, expected) = self.decoder.progress(&self.buf);
                    return Err(TransportError::Truncated { received, expected });
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if timed_out(&e) => {
                    if let Some(s) = stall_at {
                        if Instant::now() >= s && until.is_none_or(|u| s <= u) {
                            let (received, expected) = self.decoder.progress(&self.buf);
                            return Err(TransportError::Stalled {
                                received,
                                expected,
                                after: self.frame_timeout,
                            });
                        }
                    }
                    if until.is_some_and(|u| Instant::now() >= u) {
                        return Ok(Got::TimedOut);
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// Reads at most `max` bytes from `socket` into the spare capacity of `buf` (no zeroing),
/// with `recv` flags `flags`, counting the system call and the bytes in `metrics`.
fn recv_into<S: AsRawFd>(
    socket: &S,
    buf: &mut BytesMut,
    max: usize,
    flags: libc::c_int,
    metrics: &Metrics,
) -> io::Result<usize> {
    metrics.syscalls.incr();
    buf.reserve(max);
    let spare = buf.spare_capacity_mut();
    let len = spare.len().min(max);
    let n = transport_framed::sock::recv_uninit(socket.as_raw_fd(), &mut spare[..len], flags)?;
    // SAFETY: `recv_uninit` initialised the first `n` (<= len) bytes of the spare capacity.
    unsafe { buf.set_len(buf.len() + n) };
    metrics.bytes_received.add(n as u64);
    Ok(n)
}

/// Payloads up to this size are copied behind the header and written with one `write`;
/// larger ones go by vectored writes from where they are.
const SMALL_FRAME_PAYLOAD: usize = 224;

/// Writes one frame (prefix + RPC header, then the payload), counted in `metrics`: small
/// frames as one contiguous `write`, others with vectored writes.
fn write_frame<S: Write>(
    socket: &mut S,
    header: RpcHeader,
    payload: &[u8],
    metrics: &Metrics,
) -> io::Result<()> {
    const HEAD: usize = PREFIX_LEN + RPC_HEADER_LEN;
    // A small payload is copied behind the header: the frame is one part.
    let small = payload.len() <= SMALL_FRAME_PAYLOAD;
    let mut head = [0u8; HEAD + SMALL_FRAME_PAYLOAD];
    head[..PREFIX_LEN].copy_from_slice(&encode_prefix(RPC_HEADER_LEN, payload.len()));
    head[PREFIX_LEN..HEAD].copy_from_slice(&header.encode());
    let (head, rest) = if small {
        head[HEAD..HEAD + payload.len()].copy_from_slice(payload);
        (&head[..HEAD + payload.len()], &[][..])
    } else {
        (&head[..HEAD], payload)
    };
    let mut parts = [IoSlice::new(head), IoSlice::new(rest)];
    let mut slices: &mut [IoSlice<'_>] = if rest.is_empty() {
        &mut parts[..1]
    } else {
        &mut parts[..]
    };
    while !slices.is_empty() {
        metrics.syscalls.incr();
        // One part left: a plain write(2), which spares the kernel importing an iovec array
        // (a `void o()` call and its reply are frames of 32 bytes).
        let written = match &*slices {
            [one] => socket.write(one),
            more => socket.write_vectored(more),
        };
        match written {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                metrics.bytes_sent.add(n as u64);
                IoSlice::advance_slices(&mut slices, n)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    metrics.messages_sent.incr();
    Ok(())
}

fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// A synchronous RPC client: one call at a time on the calling thread, no runtime.
///
/// A call writes its request and blocks in `recv` for the answer. Errors are those of
/// [`RpcClient`](super::RpcClient): after a connection error every later call fails with it.
pub struct BlockingClient<S: BlockingSocket> {
    socket: S,
    metrics: Arc<Metrics>,
    reader: FrameReader,
    next_id: u64,
    config: BlockingConfig,
    failed: Option<RpcError>,
    /// The send timeout last set on the socket.
    write_timeout_set: Option<Option<Duration>>,
}

impl<S: BlockingSocket> std::fmt::Debug for BlockingClient<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockingClient")
            .field("fd", &self.socket.as_raw_fd())
            .field("next_id", &self.next_id)
            .field("failed", &self.failed)
            .finish()
    }
}

impl<S: BlockingSocket> BlockingClient<S> {
    /// A client on a connected socket (put in blocking mode; TCP without Nagle delay).
    pub fn new(socket: S, config: BlockingConfig) -> io::Result<BlockingClient<S>> {
        socket.prepare()?;
        let metrics = Arc::new(Metrics::default());
        Ok(BlockingClient {
            socket,
            reader: FrameReader::new(&config, metrics.clone()),
            metrics,
            next_id: 1,
            config,
            failed: None,
            write_timeout_set: None,
        })
    }

    /// Calls `method` and waits for its answer (with the default deadline, if configured).
    pub fn call(&mut self, method: u32, payload: &[u8]) -> Result<Bytes, RpcError> {
        self.call_with(method, payload, self.config.default_deadline)
    }

    /// Calls `method` with a deadline for the whole call (`None`: none).
    pub fn call_with(
        &mut self,
        method: u32,
        payload: &[u8],
        deadline: Option<Duration>,
    ) -> Result<Bytes, RpcError> {
        self.usable(payload.len())?;
        let until = deadline.map(|d| Instant::now() + d);
        let id = self.next_id;
        self.next_id += 1;
        let header = RpcHeader::new(Kind::Request, method, id, payload.len());
        if let Err(e) = self.write(header, payload, deadline) {
            let err = self.fail_io(e);
            return Err(match (deadline, &err) {
                (Some(d), RpcError::ConnectionLost(_))
                    if until.is_some_and(|u| Instant::now() >= u) =>
                {
                    RpcError::DeadlineExceeded(d)
                }
                _ => err,
            });
        }
        loop {
            let got = match self.reader.next(&mut self.socket, Limit::Deadline(until)) {
                Ok(got) => got,
                Err(e) => return Err(self.fail(e.into())),
            };
            let (h, result) = match got {
                Got::Message(m) => {
                    let h = match RpcHeader::decode(m.header.as_slice()) {
                        Ok(h) => h,
                        Err(e) => return Err(self.fail(e.into())),
                    };
                    if let Err(e) = h.check_payload(m.payload.len()) {
                        return Err(self.fail(e.into()));
                    }
                    let result = match h.kind {
                        Kind::Response => Ok(m.payload),
                        Kind::Error => Err(RpcError::Remote(Status::decode(&m.payload))),
                        kind => {
                            return Err(self.fail(
                                ProtocolError::UnexpectedKind {
                                    from: "server",
                                    kind,
                                }
                                .into(),
                            ))
                        }
                    };
                    (h, result)
                }
                Got::TooLarge { len, max, header } => match RpcHeader::decode(header.as_slice()) {
                    Ok(h) => (h, Err(RpcError::ResponseTooLarge { len, max })),
                    Err(e) => return Err(self.fail(e.into())),
                },
                Got::Closed => return Err(self.fail(RpcError::ConnectionClosed)),
                Got::TimedOut => {
                    let d = deadline.expect("only a call with a deadline times out");
                    self.cancel(id);
                    return Err(RpcError::DeadlineExceeded(d));
                }
            };
            match h.request_id {
                // The late answer of a call that gave up: skipped.
                r if r < id => continue,
                r if r == id => return result,
                _ => {
                    let e = ProtocolError::UnexpectedKind {
                        from: "server",
                        kind: h.kind,
                    };
                    return Err(self.fail(e.into()));
                }
            }
        }
    }

    /// Sends a oneway call; returns once it is written.
    pub fn oneway(&mut self, method: u32, payload: &[u8]) -> Result<(), RpcError> {
        self.usable(payload.len())?;
        let header = RpcHeader::new(Kind::Oneway, method, 0, payload.len());
        self.write(header, payload, self.config.default_deadline)
            .map_err(|e| self.fail_io(e))
    }

    /// The socket, for options and queries.
    pub fn socket(&self) -> &S {
        &self.socket
    }

    /// The connection's counters: messages, bytes and system calls (reads and writes).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    fn usable(&self, payload_len: usize) -> Result<(), RpcError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let len = (RPC_HEADER_LEN + payload_len) as u64;
        if len > self.config.max_message_size as u64 || u32::try_from(payload_len).is_err() {
            return Err(RpcError::RequestTooLarge {
                len,
                max: self.config.max_message_size as u64,
            });
        }
        Ok(())
    }

    fn write(
        &mut self,
        header: RpcHeader,
        payload: &[u8],
        timeout: Option<Duration>,
    ) -> io::Result<()> {
        if self.write_timeout_set != Some(timeout) {
            self.socket
                .set_write_timeout(timeout.map(|t| t.max(Duration::from_micros(1))))?;
            self.write_timeout_set = Some(timeout);
        }
        write_frame(&mut self.socket, header, payload, &self.metrics)
    }

    /// Tells the server to drop call `id`, if the socket has room soon; a cancel that cannot
    /// be written whole leaves the stream unusable, so the connection fails then.
    fn cancel(&mut self, id: u64) {
        let header = RpcHeader::new(Kind::Cancel, 0, id, 0);
        if let Err(e) = self.write(header, &[], Some(CANCEL_WRITE_TIMEOUT)) {
            self.fail_io(e);
        }
    }

    fn fail_io(&mut self, e: io::Error) -> RpcError {
        let timed_out = timed_out(&e);
        let err = self.fail(RpcError::ConnectionLost(Arc::new(TransportError::Io(e))));
        if timed_out {
            // Part of a frame may be written: nothing more can follow it.
            let _ = self.socket.shutdown(Shutdown::Both);
        }
        err
    }

    fn fail(&mut self, e: RpcError) -> RpcError {
        if e.is_connection_error() && self.failed.is_none() {
            self.failed = Some(e.clone());
        }
        e
    }
}

/// Shuts one socket down from another thread.
type Stopper = Box<dyn Fn() + Send>;

struct Inner<H> {
    handler: H,
    server: ServerConfig,
    config: BlockingConfig,
    runtime: tokio::runtime::Handle,
    stopping: AtomicBool,
    /// Sockets being served (by connection number) and listeners accepting, to shut down.
    live: Mutex<HashMap<u64, Stopper>>,
    next: AtomicU64,
    connections: AtomicUsize,
    refused: AtomicU64,
}

/// A thread-per-connection RPC server: each connection's requests are read, handled and
/// answered one after another on its own thread.
///
/// Handlers are the async [`Handler`]s of [`RpcServer`](super::RpcServer), run to completion
/// on the connection's thread with [`tokio::runtime::Handle::block_on`]: a handler that
/// answers at once costs no runtime work; one that waits on I/O or timers needs the runtime
/// behind the handle to drive them (a multi-thread runtime, or a current-thread one whose
/// thread is in `block_on`).
pub struct BlockingServer<H> {
    inner: Arc<Inner<H>>,
}

impl<H> Clone for BlockingServer<H> {
    fn clone(&self) -> Self {
        BlockingServer {
            inner: self.inner.clone(),
        }
    }
}

impl<H: Handler> BlockingServer<H> {
    /// A server running `handler`, with the async server's settings `server` (handler and
    /// idle timeouts) and this module's `config`; handlers run with `runtime`.
    pub fn new(
        handler: H,
        server: ServerConfig,
        config: BlockingConfig,
        runtime: tokio::runtime::Handle,
    ) -> BlockingServer<H> {
        BlockingServer {
            inner: Arc::new(Inner {
                handler,
                server,
                config,
                runtime,
                stopping: AtomicBool::new(false),
                live: Mutex::new(HashMap::new()),
                next: AtomicU64::new(0),
                connections: AtomicUsize::new(0),
                refused: AtomicU64::new(0),
            }),
        }
    }

    /// Accepts on `listener` and serves each connection on a thread of its own, until
    /// [`BlockingServer::shutdown`]. Beyond [`BlockingConfig::max_connections`] a new
    /// connection is closed at once. Failed accepts (out of descriptors, ...) are retried
    /// after a pause.
    pub fn serve<L: BlockingListener>(&self, listener: L) -> io::Result<()> {
        let id = self.inner.next.fetch_add(1, Ordering::Relaxed);
        // Shutting the listener down wakes the accept below (Linux: it then fails).
        let fd = listener.as_raw_fd();
        self.live().insert(
            id,
            Box::new(move || {
                // SAFETY: `shutdown` takes no pointers; `fd` stays open while it is in the
                // map, since `serve` removes it (below) before `listener` is dropped.
                unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
            }),
        );
        let _registered = Deregister(&self.inner.live, id);
        if self.is_shutting_down() {
            return Ok(());
        }
        let mut pause = Duration::from_millis(5);
        loop {
            let accepted = listener.accept_socket();
            if self.is_shutting_down() {
                return Ok(());
            }
            let socket = match accepted {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "blocking accept failed; backing off");
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_secs(1));
                    continue;
                }
            };
            pause = Duration::from_millis(5);
            let n = self.inner.connections.fetch_add(1, Ordering::AcqRel);
            if n >= self.inner.config.max_connections {
                self.inner.connections.fetch_sub(1, Ordering::AcqRel);
                self.inner.refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("blocking server at max_connections; connection closed");
                continue;
            }
            let this = self.clone();
            let spawned = std::thread::Builder::new()
                .name("rpc-blocking".into())
                .spawn(move || {
                    let _count = Counted(&this.inner.connections);
                    if let Err(e) = this.serve_connection_counted(socket) {
                        tracing::debug!(error = %e, "blocking rpc connection ended with an error");
                    }
                });
            if let Err(e) = spawned {
                self.inner.connections.fetch_sub(1, Ordering::AcqRel);
                tracing::warn!(error = %e, "no thread for a connection; closed");
            }
        }
    }

    /// Serves one connection on the calling thread until the peer closes it, it fails, it
    /// is idle past [`ServerConfig::idle_timeout`], or the server shuts down.
    pub fn serve_connection<S: BlockingSocket>(&self, socket: S) -> Result<(), RpcError> {
        self.inner.connections.fetch_add(1, Ordering::AcqRel);
        let _count = Counted(&self.inner.connections);
        self.serve_connection_counted(socket)
    }

    /// Stops accepting and shuts every connection down: each thread ends once the call it
    /// runs, if any, has been answered.
    pub fn shutdown(&self) {
        self.inner.stopping.store(true, Ordering::SeqCst);
        for stop in self.live().values() {
            stop();
        }
    }

    /// True once [`BlockingServer::shutdown`] was called.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.stopping.load(Ordering::SeqCst)
    }

    /// Connections being served now.
    pub fn connections(&self) -> usize {
        self.inner.connections.load(Ordering::Acquire)
    }

    /// Connections closed at once because [`BlockingConfig::max_connections`] were served.
    pub fn refused(&self) -> u64 {
        self.inner.refused.load(Ordering::Relaxed)
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Stopper>> {
        self.inner.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn serve_connection_counted<S: BlockingSocket>(&self, mut socket: S) -> Result<(), RpcError> {
        socket.prepare().map_err(TransportError::Io)?;
        let id = self.inner.next.fetch_add(1, Ordering::Relaxed);
        let handle = socket.try_clone().map_err(TransportError::Io)?;
        self.live().insert(
            id,
            Box::new(move || {
                let _ = handle.shutdown(Shutdown::Read);
            }),
        );
        let _registered = Deregister(&self.inner.live, id);
        if self.is_shutting_down() {
            return Ok(());
        }
        let inner = &*self.inner;
        let metrics = Arc::new(Metrics::default());
        let mut reader = FrameReader::new(&inner.config, metrics.clone());
        let pool: Arc<dyn transport_core::BufferPool> = Arc::new(HeapPool);
        loop {
            let until = inner.server.idle_timeout.map(|t| Instant::now() + t);
            let msg = match reader.next(&mut socket, Limit::Idle(until))? {
                Got::Message(m) => m,
                Got::TooLarge { len, max, header } => {
                    match RpcHeader::decode(header.as_slice())? {
                        h if h.kind == Kind::Request => {
                            let status = Status::request_too_large(len, max);
                            answer(
                                &mut socket,
                                h.request_id,
                                Err(status),
                                &inner.config,
                                &metrics,
                            )?;
                        }
                        _ => tracing::warn!(len, max, "oversized oneway message dropped"),
                    }
                    continue;
                }
                Got::Closed | Got::TimedOut => return Ok(()),
            };
            let h = RpcHeader::decode(msg.header.as_slice())?;
            h.check_payload(msg.payload.len())?;
            match h.kind {
                Kind::Request | Kind::Oneway => {
                    let oneway = h.kind == Kind::Oneway;
                    let req = Request {
                        method: h.method,
                        request_id: h.request_id,
                        payload: msg.payload,
                        oneway,
                        pool: pool.clone(),
                    };
                    let result = run_handler(inner, req);
                    if !oneway {
                        answer(&mut socket, h.request_id, result, &inner.config, &metrics)?;
                    }
                }
                // Calls run one at a time: a cancel arrives after its call was answered.
                Kind::Cancel => {}
                kind => {
                    return Err(ProtocolError::UnexpectedKind {
                        from: "client",
                        kind,
                    }
                    .into())
                }
            }
            if self.is_shutting_down() {
                return Ok(());
            }
        }
    }
}

/// Runs the handler for `req` to completion on this thread. Most handlers answer at their
/// first poll: that poll runs inside the runtime's context but without `block_on` (which
/// costs a park handle and a seed per call); a handler that waits is finished by `block_on`.
fn run_handler<H: Handler>(inner: &Inner<H>, req: Request) -> Result<Bytes, Status> {
    let _context = inner.runtime.enter();
    let work = inner.handler.call(req);
    match inner.server.handler_timeout {
        None => {
            let mut work = std::pin::pin!(work);
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            match work.as_mut().poll(&mut cx) {
                std::task::Poll::Ready(r) => r,
                std::task::Poll::Pending => inner.runtime.block_on(work),
            }
        }
        Some(t) => inner.runtime.block_on(async move {
            tokio::time::timeout(t, work)
                .await
                .unwrap_or_else(|_| Err(Status::handler_timed_out(t)))
        }),
    }
}

/// Writes the answer to call `id`; a response over `max` becomes a
/// [`code::MESSAGE_TOO_LARGE`] error.
fn answer<S: BlockingSocket>(
    socket: &mut S,
    id: u64,
    result: Result<Bytes, Status>,
    config: &BlockingConfig,
    metrics: &Metrics,
) -> Result<(), RpcError> {
    let max = config.max_message_size;
    let result = match result {
        Ok(p) if (RPC_HEADER_LEN + p.len()) as u64 > max as u64 => Err(Status::new(
            code::MESSAGE_TOO_LARGE,
            format!(
                "response of {} bytes exceeds the limit of {max} bytes",
                RPC_HEADER_LEN + p.len()
            ),
        )),
        r => r,
    };
    let (kind, payload) = match result {
        Ok(p) => (Kind::Response, p),
        Err(status) => (Kind::Error, status.encode()),
    };
    write_frame(
        socket,
        RpcHeader::new(kind, 0, id, payload.len()),
        &payload,
        metrics,
    )
    .map_err(|e| RpcError::ConnectionLost(Arc::new(TransportError::Io(e))))
}

/// Removes entry `.1` from the map when dropped.
struct Deregister<'a>(&'a Mutex<HashMap<u64, Stopper>>, u64);

impl Drop for Deregister<'_> {
    fn drop(&mut self) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.1);
    }
}

/// Takes one off the count when dropped (also when a handler panics).
struct Counted<'a>(&'a AtomicUsize);

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests;
