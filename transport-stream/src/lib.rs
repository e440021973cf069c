//! # transport-stream
//!
//! A byte stream (tokio [`AsyncRead`] + [`AsyncWrite`] + [`AsyncBufRead`]) over any
//! `transport-core` [`Connection`], so that stream-based frameworks (tonic, hyper, tarpc, TLS,
//! ...) run unchanged on every backend: TCP, Unix sockets and verbs.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//! use transport_core::Transport;
//! use transport_stream::{ByteStream, ByteStreamConfig, StreamListener};
//! use transport_uds::UdsTransport;
//!
//! let uds = UdsTransport::default();
//! let addr = "/tmp/stream-demo.sock".parse().unwrap();
//! let mut listener = StreamListener::bind(&uds, &addr, ByteStreamConfig::default()).await?;
//! let mut client = ByteStream::connect(&uds, &addr, ByteStreamConfig::default()).await?;
//! let mut server = listener.accept().await?;
//!
//! client.write_all(b"hello").await?;
//! client.shutdown().await?; // flushes, then sends the end-of-stream marker
//! let mut got = Vec::new();
//! server.read_to_end(&mut got).await?;
//! assert_eq!(got, b"hello");
//! # Ok(()) }
//! ```
//!
//! With the `tonic` feature, [`tonic_support`] serves and calls gRPC over any transport
//! (`Server::builder().serve_with_incoming(listener.incoming())`,
//! `Endpoint::connect_with_connector(Connector::new(..))`); the `hyper` feature alone gives the
//! [`Connector`](hyper_support::Connector) for hyper clients.
//!
//! ## How bytes map to messages
//!
//! - **Writes** are collected in a send buffer taken from the connection's
//!   [`BufferPool`] (registered memory on verbs) until it holds
//!   [`ByteStreamConfig::chunk_size`] bytes or the stream is flushed; then the buffer goes out as one
//!   message. A write of at least `chunk_size` bytes into an empty buffer becomes one message of
//!   its own (up to the transport's max message size), so large writes cost one message each,
//!   not one per chunk. Vectored writes (`poll_write_vectored`, used by hyper/h2) are gathered
//!   into one message. While one message is being sent the next buffer fills, so copying and
//!   sending overlap; a second full buffer waits (back-pressure, bounded memory).
//! - **Reads** hand out the received message payloads ([`bytes::Bytes`], pooled receive buffers
//!   on backends that have them) directly: `poll_read` copies from the payload into the caller's
//!   buffer, [`AsyncBufRead`] and [`ByteStream::read_chunk`] lend or return the payload itself.
//! - **Shutdown** (`poll_shutdown`) flushes, sends an end-of-stream marker (a message with a
//!   one-byte header; data messages have none) and closes the sending direction: the peer reads
//!   EOF (`Ok(0)`) and can still write back (half close).
//! - **A peer that goes away** without shutting the stream down (process killed, connection
//!   dropped) is an [`io::Error`] on the reading side (`UnexpectedEof` when the connection ended
//!   cleanly but without the marker, as TLS does for a missing close_notify; the transport's
//!   error otherwise), and a failed send is an error on the writing side. No operation waits for a
//!   peer that is gone. As with a socket buffer, writes can be accepted into the transport's send
//!   queue before the death is noticed; the error then comes from a later write, flush or
//!   `shutdown` (which needs the peer to take its end-of-stream marker).
//! - **After an error** a half stays failed: every later call returns an error of the same
//!   [`io::ErrorKind`] that still carries the first one, typed. A transport failure comes back
//!   as [`TransportError::Failed`] (inside the `io::Error`), whose [`source`] is the first
//!   [`TransportError`]; a peer that broke the byte-stream protocol gives the same
//!   [`ByteStreamError`] every time:
//!
//!   ```
//!   # use std::error::Error;
//!   # use transport_core::TransportError;
//!   # fn first_cause(e: &std::io::Error) -> Option<&TransportError> {
//!   let transport = e.get_ref()?.downcast_ref::<TransportError>()?;
//!   Some(transport.original()) // the first error, also when this is a later call's
//!   # }
//!   ```
//!
//! [`source`]: std::error::Error::source
//!
//! ## Copies: what the stream model forces
//!
//! | path | payload copies | why |
//! |---|---|---|
//! | `AsyncWrite::poll_write(&[u8])` | 1 (caller's slice → pool buffer) | the caller keeps its slice; the send outlives the call |
//! | [`ByteStream::write_chunk`]`(Bytes)` | 0 (if the `Bytes` is backend memory; else the backend's own rule) | ownership passes to the transport |
//! | `AsyncRead::poll_read(ReadBuf)` | 1 (payload → caller's buffer) | the caller owns the destination |
//! | [`AsyncBufRead`], [`ByteStream::read_chunk`] | 0 | the payload is lent / returned as is |
//!
//! So through `AsyncRead`/`AsyncWrite` a byte crosses exactly one copy on each side, the one the
//! trait signatures force; the copy on the sending side lands in memory the backend sends from
//! without a further copy or registration (registered slabs on verbs). The adapter adds the
//! bytes it copies to the connection's [`Metrics::payload_bytes_copied`], so tools see them next
//! to the backend's own. On top of that the framework itself copies: tonic/prost encode into
//! their own buffer and h2 frames it, so a gRPC message is copied several times before it reaches
//! the stream (`grpc-demo`'s `grpc-vs-native` measures what that costs against native RPC).
//!
//! ## Framework settings worth knowing
//!
//! h2 (tonic, hyper) flushes after every HTTP/2 frame it writes, and a flush sends a message:
//! with h2's default 16 KiB frames a 1 MiB gRPC call becomes ~64 messages. Raising
//! `max_frame_size` (and the flow-control windows) on both ends makes it a few.

use bytes::{Buf, BufMut, Bytes};
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncBufRead, AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::ReusableBoxFuture;
use transport_core::{
    BufferPool, Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender,
    Metrics, SendBuffer, Transport, TransportError,
};

#[cfg(feature = "hyper")]
pub mod hyper_support;
#[cfg(feature = "tonic")]
pub mod tonic_support;

/// Default coalescing chunk: 256 KiB.
pub const DEFAULT_CHUNK_SIZE: usize = 256 << 10;

/// Header of the end-of-stream marker message. Data messages have an empty header.
const EOS_HEADER: [u8; 1] = [0xE0];

/// Settings of a [`ByteStream`]: bytes carried over a message connection. (Not
/// `transport_framed::StreamConfig`, which goes the other way: messages over a byte
/// stream.)
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ByteStreamConfig {
    /// Bytes collected from small writes before they go out as one message (clamped to the
    /// transport's max message size). Writes at least this large go out as messages of their own.
    pub chunk_size: usize,
}

/// The former name of [`ByteStreamConfig`].
#[deprecated(
    note = "renamed ByteStreamConfig: it configures bytes over messages, the opposite of \
                     transport_framed::StreamConfig"
)]
pub type StreamConfig = ByteStreamConfig;

impl Default for ByteStreamConfig {
    fn default() -> Self {
        ByteStreamConfig {
            chunk_size: DEFAULT_CHUNK_SIZE,
        }
    }
}

impl ByteStreamConfig {
    /// These settings with another [`ByteStreamConfig::chunk_size`].
    pub fn with_chunk_size(mut self, chunk_size: usize) -> ByteStreamConfig {
        self.chunk_size = chunk_size;
        self
    }
}

/// Maps a transport error to the `io::Error` a stream user expects: an
/// [`TransportError::Io`] error as it is, any other inside an `io::Error` of a matching kind
/// (`e.get_ref()` downcasts to the [`TransportError`]). [`TransportError::Failed`] gets the
/// kind of the error it carries.
///
/// ```
/// use std::io;
/// use transport_core::TransportError;
/// use transport_stream::to_io_error;
///
/// let e = to_io_error(TransportError::Truncated { received: 1, expected: 9 });
/// assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
/// let inner = e.get_ref().and_then(|i| i.downcast_ref::<TransportError>());
/// assert!(matches!(inner, Some(TransportError::Truncated { received: 1, expected: 9 })));
/// ```
pub fn to_io_error(e: TransportError) -> io::Error {
    match e {
        TransportError::Io(e) => e,
        e => io::Error::new(io_kind(&e), e),
    }
}

/// The `io::ErrorKind` [`to_io_error`] gives `e`.
fn io_kind(e: &TransportError) -> io::ErrorKind {
    match e.original() {
        TransportError::Io(e) => e.kind(),
        TransportError::Closed => io::ErrorKind::BrokenPipe,
        TransportError::Truncated { .. } => io::ErrorKind::UnexpectedEof,
        TransportError::Malformed(_) | TransportError::MessageTooLarge { .. } => {
            io::ErrorKind::InvalidData
        }
        TransportError::InvalidAddress { .. } => io::ErrorKind::InvalidInput,
        TransportError::Unsupported(_) => io::ErrorKind::Unsupported,
        _ => io::ErrorKind::ConnectionAborted,
    }
}

/// How the peer broke the byte-stream protocol: the inner error of the [`io::Error`] a
/// [`StreamReader`] returns then (`e.get_ref()` downcasts to it), the same at every later
/// read.
///
/// ```
/// # async fn demo(mut stream: impl tokio::io::AsyncRead + Unpin) {
/// use tokio::io::AsyncReadExt;
/// use transport_stream::ByteStreamError;
///
/// if let Err(e) = stream.read(&mut [0u8; 64]).await {
///     match e.get_ref().and_then(|i| i.downcast_ref::<ByteStreamError>()) {
///         Some(ByteStreamError::MissingEndOfStream) => eprintln!("peer died"),
///         Some(other) => eprintln!("not a byte-stream peer: {other}"),
///         None => eprintln!("transport error: {e}"),
///     }
/// }
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ByteStreamError {
    /// A message with a header a [`ByteStream`] never sends: the peer is not a `ByteStream`.
    NotAByteStream {
        /// The message's header.
        header: HeaderBytes,
    },
    /// The connection ended cleanly but without the end-of-stream marker: the peer died or
    /// dropped its stream without shutting it down (as TLS's missing close_notify).
    MissingEndOfStream,
}

impl ByteStreamError {
    /// `InvalidData` for a foreign message, `UnexpectedEof` for a missing end.
    pub fn kind(&self) -> io::ErrorKind {
        match self {
            ByteStreamError::NotAByteStream { .. } => io::ErrorKind::InvalidData,
            ByteStreamError::MissingEndOfStream => io::ErrorKind::UnexpectedEof,
        }
    }
}

impl std::fmt::Display for ByteStreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ByteStreamError::NotAByteStream { header } => write!(
                f,
                "not a byte-stream message (header {:02x?}): is the peer a ByteStream?",
                header.as_slice()
            ),
            ByteStreamError::MissingEndOfStream => f.write_str(
                "the peer's connection ended without an end-of-stream marker \
                 (peer died or dropped the stream without shutting it down)",
            ),
        }
    }
}

impl std::error::Error for ByteStreamError {}

impl From<ByteStreamError> for io::Error {
    fn from(e: ByteStreamError) -> io::Error {
        io::Error::new(e.kind(), e)
    }
}

/// What a half failed with, kept typed to report again (`io::Error` is not `Clone`).
#[derive(Debug, Clone)]
enum StickyError {
    /// The transport failed: later calls report [`TransportError::Failed`] with this inside.
    Transport(Arc<TransportError>),
    /// The peer broke the byte-stream protocol: later calls report the same.
    Protocol(ByteStreamError),
}

impl StickyError {
    /// Keeps `e` (a copy: the caller gets `e` itself).
    fn transport(e: &TransportError) -> StickyError {
        StickyError::Transport(match e {
            // Already a repeat: keep the first error, not a second layer.
            TransportError::Failed(first) => first.clone(),
            e => Arc::new(e.duplicate()),
        })
    }

    /// The error for a call after the failure: same kind, the first error inside.
    fn to_io(&self) -> io::Error {
        match self {
            StickyError::Transport(first) => to_io_error(TransportError::Failed(first.clone())),
            StickyError::Protocol(e) => e.clone().into(),
        }
    }
}

enum WriteOp {
    Data(Bytes),
    Eos,
}

type SendFuture<S> = ReusableBoxFuture<'static, (S, Result<(), TransportError>)>;

async fn run_send<S: MessageSender>(mut sender: S, op: WriteOp) -> (S, Result<(), TransportError>) {
    let r = match op {
        WriteOp::Data(payload) => sender.send(Message::new(HeaderBytes::EMPTY, payload)).await,
        WriteOp::Eos => {
            let marker = Message::new(HeaderBytes::from(EOS_HEADER), Bytes::new());
            match sender.send(marker).await {
                Ok(()) => sender.close().await,
                Err(e) => Err(e),
            }
        }
    };
    (sender, r)
}

/// The writing half of a [`ByteStream`]: [`AsyncWrite`] over a [`MessageSender`].
pub struct StreamWriter<S: MessageSender> {
    /// The sender when no send is in flight.
    sender: Option<S>,
    /// The in-flight send (owns the sender meanwhile); allocated once, reused.
    inflight: Option<SendFuture<S>>,
    in_progress: bool,
    pool: Arc<dyn BufferPool>,
    metrics: Arc<Metrics>,
    /// Small writes collect here.
    buf: Option<SendBuffer>,
    chunk_size: usize,
    max_payload: usize,
    shutdown_started: bool,
    shut: bool,
    error: Option<StickyError>,
}

impl<S: MessageSender> StreamWriter<S> {
    /// A writer over `sender`.
    pub fn new(sender: S, config: &ByteStreamConfig) -> StreamWriter<S> {
        // The EOS marker carries a 1-byte header; data messages none.
        let max_payload = sender
            .max_message_size()
            .saturating_sub(EOS_HEADER.len())
            .max(1);
        StreamWriter {
            pool: sender.buffer_pool(),
            metrics: sender.metrics().clone(),
            sender: Some(sender),
            inflight: None,
            in_progress: false,
            buf: None,
            chunk_size: config.chunk_size.clamp(1, max_payload),
            max_payload,
            shutdown_started: false,
            shut: false,
            error: None,
        }
    }

    /// The connection's counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    fn buffered(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }

    /// Remembers the transport's error `e` and returns it as an `io::Error`.
    fn fail(&mut self, e: TransportError) -> io::Error {
        self.error = Some(StickyError::transport(&e));
        to_io_error(e)
    }

    /// Drives the in-flight send. `Ready(Ok)` when the sender is idle.
    fn poll_inflight(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.in_progress {
            return Poll::Ready(Ok(()));
        }
        let fut = self
            .inflight
            .as_mut()
            .expect("in-flight send without a future");
        let (sender, result) = ready!(fut.poll(cx));
        self.in_progress = false;
        self.sender = Some(sender);
        match result {
            Ok(()) => Poll::Ready(Ok(())),
            Err(e) => Poll::Ready(Err(self.fail(e))),
        }
    }

    /// Starts sending `op` (the sender must be idle) and drives it once.
    fn start(&mut self, cx: &mut Context<'_>, op: WriteOp) -> io::Result<()> {
        let sender = self.sender.take().expect("start with a send in flight");
        let fut = run_send(sender, op);
        match &mut self.inflight {
            Some(f) => f.set(fut),
            None => self.inflight = Some(ReusableBoxFuture::new(fut)),
        }
        self.in_progress = true;
        match self.poll_inflight(cx) {
            Poll::Ready(r) => r,
            Poll::Pending => Ok(()),
        }
    }

    fn check_open(&self) -> io::Result<()> {
        if let Some(e) = &self.error {
            return Err(e.to_io());
        }
        if self.shutdown_started {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "write after shutdown of the stream",
            ));
        }
        Ok(())
    }

    fn poll_write_slices(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.check_open()?;
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Poll::Ready(Ok(0));
        }
        let idle = match self.poll_inflight(cx) {
            Poll::Ready(r) => {
                r?;
                true
            }
            Poll::Pending => false,
        };
        let buffered = self.buffered();
        if buffered == 0 && total >= self.chunk_size {
            // A large write: one message of its own, copied once into pool memory.
            if !idle {
                return Poll::Pending;
            }
            let n = total.min(self.max_payload);
            let mut b = self.pool.alloc(n);
            put_slices(&mut b, bufs, n);
            self.metrics.payload_bytes_copied.add(n as u64);
            self.start(cx, WriteOp::Data(b.freeze()))?;
            return Poll::Ready(Ok(n));
        }
        if buffered >= self.chunk_size {
            // Full buffer, previous send still going: back-pressure.
            if !idle {
                return Poll::Pending;
            }
            self.send_buffer(cx)?;
        }
        let room = self.chunk_size - self.buffered();
        let n = total.min(room);
        let chunk = self.chunk_size;
        let pool = &self.pool;
        let b = self.buf.get_or_insert_with(|| pool.alloc(chunk));
        put_slices(b, bufs, n);
        self.metrics.payload_bytes_copied.add(n as u64);
        if b.len() >= self.chunk_size && self.sender.is_some() {
            self.send_buffer(cx)?;
        }
        Poll::Ready(Ok(n))
    }

    /// Sends the collected buffer (the sender must be idle).
    fn send_buffer(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        match self.buf.take() {
            Some(b) if !b.is_empty() => self.start(cx, WriteOp::Data(b.freeze())),
            other => {
                self.buf = other;
                Ok(())
            }
        }
    }

    fn poll_flush_inner(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(e) = &self.error {
            return Poll::Ready(Err(e.to_io()));
        }
        loop {
            ready!(self.poll_inflight(cx))?;
            if self.buffered() == 0 {
                return Poll::Ready(Ok(()));
            }
            self.send_buffer(cx)?;
        }
    }

    fn poll_shutdown_inner(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.shut {
            return Poll::Ready(Ok(()));
        }
        if !self.shutdown_started {
            ready!(self.poll_flush_inner(cx))?;
            self.shutdown_started = true;
            self.start(cx, WriteOp::Eos)?;
        }
        ready!(self.poll_inflight(cx))?;
        self.shut = true;
        Poll::Ready(Ok(()))
    }

    /// Sends `payload` as one message (several if it exceeds the max message size) without
    /// copying it, after what earlier writes left in the buffer.
    pub async fn write_chunk(&mut self, mut payload: Bytes) -> io::Result<()> {
        self.check_open()?;
        std::future::poll_fn(|cx| self.poll_flush_inner(cx)).await?;
        while !payload.is_empty() {
            let part = payload.split_to(payload.len().min(self.max_payload));
            std::future::poll_fn(|cx| self.poll_inflight(cx)).await?;
            std::future::poll_fn(|cx| Poll::Ready(self.start(cx, WriteOp::Data(part.clone()))))
                .await?;
        }
        std::future::poll_fn(|cx| self.poll_inflight(cx)).await
    }
}

fn put_slices(b: &mut SendBuffer, bufs: &[IoSlice<'_>], mut n: usize) {
    for s in bufs {
        if n == 0 {
            break;
        }
        let take = s.len().min(n);
        b.put_slice(&s[..take]);
        n -= take;
    }
}

impl<S: MessageSender> Unpin for StreamWriter<S> {}

impl<S: MessageSender> AsyncWrite for StreamWriter<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_slices(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_slices(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_flush_inner(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_shutdown_inner(cx)
    }
}

type RecvFuture<R> = ReusableBoxFuture<'static, (R, Result<Option<Message>, TransportError>)>;

async fn run_recv<R: MessageReceiver>(
    mut receiver: R,
) -> (R, Result<Option<Message>, TransportError>) {
    let r = receiver.recv().await;
    (receiver, r)
}

/// The reading half of a [`ByteStream`]: [`AsyncRead`] and [`AsyncBufRead`] over a
/// [`MessageReceiver`].
pub struct StreamReader<R: MessageReceiver> {
    receiver: Option<R>,
    inflight: Option<RecvFuture<R>>,
    in_progress: bool,
    metrics: Arc<Metrics>,
    /// The unread rest of the current payload.
    current: Bytes,
    eof: bool,
    error: Option<StickyError>,
}

impl<R: MessageReceiver> StreamReader<R> {
    /// A reader over `receiver`.
    pub fn new(receiver: R) -> StreamReader<R> {
        StreamReader {
            metrics: receiver.metrics().clone(),
            receiver: Some(receiver),
            inflight: None,
            in_progress: false,
            current: Bytes::new(),
            eof: false,
            error: None,
        }
    }

    /// The connection's counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Remembers the transport's error `e` and returns it as an `io::Error`.
    fn fail(&mut self, e: TransportError) -> io::Error {
        self.error = Some(StickyError::transport(&e));
        to_io_error(e)
    }

    /// Remembers the peer's protocol error `e` and returns it as an `io::Error`.
    fn fail_protocol(&mut self, e: ByteStreamError) -> io::Error {
        self.error = Some(StickyError::Protocol(e.clone()));
        e.into()
    }

    /// Makes `current` non-empty, or reports EOF (`Ok(false)`) or an error.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<bool>> {
        loop {
            if !self.current.is_empty() {
                return Poll::Ready(Ok(true));
            }
            if self.eof {
                return Poll::Ready(Ok(false));
            }
            if let Some(e) = &self.error {
                return Poll::Ready(Err(e.to_io()));
            }
            if !self.in_progress {
                let receiver = self.receiver.take().expect("idle reader without receiver");
                let fut = run_recv(receiver);
                match &mut self.inflight {
                    Some(f) => f.set(fut),
                    None => self.inflight = Some(ReusableBoxFuture::new(fut)),
                }
                self.in_progress = true;
            }
            let fut = self
                .inflight
                .as_mut()
                .expect("in-flight receive without a future");
            let (receiver, result) = ready!(fut.poll(cx));
            self.in_progress = false;
            self.receiver = Some(receiver);
            match result {
                Ok(Some(msg)) if msg.header.is_empty() => self.current = msg.payload,
                Ok(Some(msg)) if msg.header.as_slice() == EOS_HEADER => self.eof = true,
                Ok(Some(msg)) => {
                    let e = ByteStreamError::NotAByteStream { header: msg.header };
                    return Poll::Ready(Err(self.fail_protocol(e)));
                }
                Ok(None) => {
                    let e = ByteStreamError::MissingEndOfStream;
                    return Poll::Ready(Err(self.fail_protocol(e)));
                }
                Err(e) => return Poll::Ready(Err(self.fail(e))),
            }
        }
    }

    /// Polls for the next received payload without copying it; `None` at end of stream.
    pub fn poll_read_chunk(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Option<Bytes>>> {
        Poll::Ready(match ready!(self.poll_fill(cx)) {
            Ok(true) => Ok(Some(std::mem::take(&mut self.current))),
            Ok(false) => Ok(None),
            Err(e) => Err(e),
        })
    }

    /// The next received payload (or its unread rest), without copying; `None` at end of stream.
    pub async fn read_chunk(&mut self) -> io::Result<Option<Bytes>> {
        std::future::poll_fn(|cx| self.poll_read_chunk(cx)).await
    }
}

impl<R: MessageReceiver> Unpin for StreamReader<R> {}

impl<R: MessageReceiver> AsyncRead for StreamReader<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        if ready!(this.poll_fill(cx))? {
            let n = buf.remaining().min(this.current.len());
            buf.put_slice(&this.current[..n]);
            this.current.advance(n);
            this.metrics.payload_bytes_copied.add(n as u64);
        }
        Poll::Ready(Ok(()))
    }
}

impl<R: MessageReceiver> AsyncBufRead for StreamReader<R> {
    fn poll_fill_buf(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<&[u8]>> {
        let this = self.get_mut();
        ready!(this.poll_fill(cx))?;
        Poll::Ready(Ok(&this.current[..]))
    }

    fn consume(self: Pin<&mut Self>, amt: usize) {
        self.get_mut().current.advance(amt);
    }
}

/// A byte stream over a message connection: [`AsyncRead`], [`AsyncBufRead`] and [`AsyncWrite`].
///
/// See the crate docs for how bytes map to messages, shutdown, peer death and copies.
pub struct ByteStream<C: Connection> {
    reader: StreamReader<C::Receiver>,
    writer: StreamWriter<C::Sender>,
    peer: String,
}

impl<C: Connection> ByteStream<C> {
    /// A stream over an established connection (both ends must use `ByteStream`).
    pub fn new(conn: C, config: &ByteStreamConfig) -> ByteStream<C> {
        let peer = conn.peer();
        let (s, r) = conn.split();
        ByteStream {
            reader: StreamReader::new(r),
            writer: StreamWriter::new(s, config),
            peer,
        }
    }

    /// Connects through `transport` and wraps the connection.
    pub async fn connect<T>(
        transport: &T,
        addr: &T::Addr,
        config: ByteStreamConfig,
    ) -> io::Result<ByteStream<C>>
    where
        T: Transport<Connection = C>,
    {
        let conn = transport.connect(addr).await.map_err(to_io_error)?;
        Ok(ByteStream::new(conn, &config))
    }

    /// The peer's address, for logs.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The connection's counters (messages, bytes, payload bytes copied, ...).
    pub fn metrics(&self) -> &Arc<Metrics> {
        self.writer.metrics()
    }

    /// Splits into halves that can be used from different tasks.
    pub fn into_split(self) -> (StreamReader<C::Receiver>, StreamWriter<C::Sender>) {
        (self.reader, self.writer)
    }

    /// The next received payload without copying; `None` at end of stream.
    pub async fn read_chunk(&mut self) -> io::Result<Option<Bytes>> {
        self.reader.read_chunk().await
    }

    /// Sends `payload` as a message without copying it (after anything buffered).
    pub async fn write_chunk(&mut self, payload: Bytes) -> io::Result<()> {
        self.writer.write_chunk(payload).await
    }
}

impl<C: Connection> Unpin for ByteStream<C> {}

impl<C: Connection> std::fmt::Debug for ByteStream<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteStream")
            .field("peer", &self.peer)
            .field("buffered", &self.writer.buffered())
            .field("unread", &self.reader.current.len())
            .finish()
    }
}

impl<C: Connection> AsyncRead for ByteStream<C> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().reader).poll_read(cx, buf)
    }
}

impl<C: Connection> AsyncBufRead for ByteStream<C> {
    fn poll_fill_buf(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<&[u8]>> {
        Pin::new(&mut self.get_mut().reader).poll_fill_buf(cx)
    }

    fn consume(self: Pin<&mut Self>, amt: usize) {
        Pin::new(&mut self.get_mut().reader).consume(amt)
    }
}

impl<C: Connection> AsyncWrite for ByteStream<C> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().writer).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().writer).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().writer).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().writer).poll_shutdown(cx)
    }
}

/// How long [`StreamListener::incoming`] waits after a failed accept before yielding the error
/// (the same pause `RpcServer::serve` makes).
pub const ACCEPT_ERROR_BACKOFF: std::time::Duration = std::time::Duration::from_millis(10);

/// A listener that yields [`ByteStream`]s.
pub struct StreamListener<L: Listener> {
    inner: L,
    config: ByteStreamConfig,
}

impl<L: Listener> StreamListener<L> {
    /// Wraps a transport listener.
    pub fn new(inner: L, config: ByteStreamConfig) -> StreamListener<L> {
        StreamListener { inner, config }
    }

    /// Listens through `transport` at `addr`.
    pub async fn bind<T>(
        transport: &T,
        addr: &T::Addr,
        config: ByteStreamConfig,
    ) -> io::Result<StreamListener<L>>
    where
        T: Transport<Listener = L>,
    {
        let inner = transport.listen(addr).await.map_err(to_io_error)?;
        Ok(StreamListener::new(inner, config))
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> io::Result<L::Addr> {
        self.inner.local_addr().map_err(to_io_error)
    }

    /// Waits for the next connection. Cancel safe.
    pub async fn accept(&mut self) -> io::Result<ByteStream<L::Connection>> {
        let conn = self.inner.accept().await.map_err(to_io_error)?;
        Ok(ByteStream::new(conn, &self.config))
    }

    /// The accepted streams as a [`futures_util::Stream`] (what
    /// `tonic::transport::Server::serve_with_incoming` takes).
    ///
    /// A failed accept is yielded as an error after a pause of [`ACCEPT_ERROR_BACKOFF`]:
    /// servers such as tonic log the error and poll again at once, and an error that lasts
    /// (out of file descriptors, say) would otherwise keep a core busy until it clears.
    pub fn incoming(
        self,
    ) -> impl futures_util::Stream<Item = io::Result<ByteStream<L::Connection>>> + Send + 'static
    {
        futures_util::stream::unfold(self, |mut l| async move {
            let r = l.accept().await;
            if r.is_err() {
                tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
            }
            Some((r, l))
        })
    }
}

#[cfg(test)]
mod tests;
