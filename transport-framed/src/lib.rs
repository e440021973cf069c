//! # transport-framed
//!
//! Messages framed over any byte stream: the connection the TCP and Unix-socket backends
//! share. (The opposite direction, a byte stream over a transport's messages for stream-based
//! frameworks, is `transport-stream`.)
//!
//! - [`frame`]: the sans-IO frame codec (an 8-byte prefix, header, payload);
//! - [`StreamConnection`], [`StreamSender`], [`StreamReceiver`]: a connection over a socket or
//!   any `AsyncRead + AsyncWrite`;
//! - [`sock`]: the one socket system call made here.
//!
//! [`StreamSender`] writes each message as prefix + header + payload with one vectored write
//! (the payload is never copied into a staging buffer; a frame without payload goes by a plain
//! write); [`StreamReceiver`] reads into a buffer
//! and hands payloads out as zero-copy slices of it. A frame larger than the read buffer is
//! read straight into a buffer of its own size taken from a small per-connection pool (its
//! last read also takes the next frame's prefix and header, so a stream of large frames costs
//! one read per frame, as a plain OS reader's does): the
//! buffer goes back to the pool when the last view of the payload drops, so a steady stream of
//! large messages reuses memory whose pages are already mapped instead of faulting in fresh
//! pages for every message (on Linux ~120 page faults per 500 KB response). Framing is
//! [`crate::frame`]: the sender queues [`FrameEncoder`] frames, the
//! receiver's small and large frames both come out of its one [`FrameDecoder`] (a large one
//! is taken over with [`FrameDecoder::detach`]).
//!
//! # What a peer can make a receiver hold
//!
//! Nothing is allocated from an announced length alone, unreserved. A large frame's buffer is
//! reused from the pool when one fits; else, while more than half the budget is free, its
//! whole length is reserved against the budget at once (honest peers: no growth, no copy);
//! else it starts at twice the bytes that arrived with its prefix (at least 64 KiB, at most its
//! length) and doubles as its bytes arrive. Every byte of it is charged to the
//! [`StreamConfig::memory_budget`] shared by all receivers made from that config (frames being
//! read, received large payloads the application still holds, and the buffers pooled for
//! reuse). When the budget is spent a receiver waits for bytes to come back instead of
//! allocating; pooled buffers are dropped rather than kept once half the budget is in use. A
//! frame that has started and makes no progress (no bytes, or no budget) for
//! [`StreamConfig::frame_timeout`] fails the receiver with [`TransportError::Stalled`]. Small
//! frames live in the read buffer ([`StreamConfig::read_buffer_size`]), which is not charged.

use crate::frame::{EncodedFrame, FrameDecoder, FrameEncoder, FramePrefix, PREFIX_LEN};
use bytes::{BufMut, Bytes, BytesMut};
use std::collections::VecDeque;
use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::{pin, Pin};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::{Instant, Sleep};
use tokio_util::codec::Decoder;
use transport_core::budget::{Charge, MemoryBudget};
use transport_core::{
    Capabilities, Message, MessageReceiver, MessageSender, Metrics, TransportError, MAX_HEADER_LEN,
};

pub mod frame;
pub mod sock;
mod socket;
mod unix;
pub use socket::{SocketReceiver, SocketSender, StreamConnection, StreamSocket};
pub use unix::{UnixReadHalf, UnixWriteHalf, CLEAN_WRITES_TO_DEREGISTER};

/// Default largest message: 64 MiB.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 64 << 20;
/// Default read buffer: 64 KiB.
pub const DEFAULT_READ_BUFFER: usize = 64 << 10;
/// Default memory budget of the receivers made from one [`StreamConfig`]: 512 MiB.
pub const DEFAULT_RECEIVE_BUDGET: usize = 512 << 20;
/// Default time a started frame may go without progress: 30 s.
pub const DEFAULT_FRAME_TIMEOUT: Duration = Duration::from_secs(30);
/// Smallest first allocation for a large frame whose buffer is not reused from the pool:
/// twice what has arrived, at least this; it then doubles as bytes arrive. So an announced
/// length alone costs at most this much, and holding budget takes sending half of it.
const LARGE_FIRST_CHUNK: usize = 64 << 10;
/// Slices per vectored write (two per message; well under IOV_MAX).
const MAX_SLICES: usize = 64;
/// Most large-frame buffers a receiver keeps for reuse: enough for a window of 64 large
/// replies held at once (a window larger than the pool allocates the rest afresh).
const LARGE_POOL_MAX_BUFFERS: usize = 64;
/// Most bytes of large-frame buffers a receiver keeps for reuse.
const LARGE_POOL_MAX_BYTES: usize = 64 << 20;
/// Larger buffers are never kept (a rare huge message should not pin its memory).
const LARGE_POOL_MAX_BUFFER: usize = 16 << 20;
/// Longest read into the read buffer right after a large frame. Large frames tend to follow
/// large frames, and whatever a read takes of the next one's payload has to be copied into
/// that frame's own buffer: a full 64 KiB read ahead costs a stream of 256 KB messages a
/// quarter of a payload copy per message. A short read costs one more system call instead.
const READ_AFTER_LARGE: usize = 1024;
/// How far the last read of a large frame reaches into the stream beyond it: the next
/// frame's prefix and largest header. A stream of large frames then takes one read per frame
/// (the frame's rest and the next one's start) instead of two (the next frame's start being
/// a read of its own), at the price of copying these few bytes into the read buffer.
const READ_PAST_LARGE: usize = PREFIX_LEN + MAX_HEADER_LEN;

/// Settings shared by the stream backends.
///
/// Cloning shares the [`memory_budget`](StreamConfig::memory_budget): every connection of a
/// transport made from one config draws on the same budget.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct StreamConfig {
    /// Largest message (header + payload) accepted on receive and allowed on send.
    pub max_message_size: usize,
    /// Size of the read buffer small frames are read into.
    pub read_buffer_size: usize,
    /// Bytes all receivers of this config may hold in large frames being read, received
    /// large payloads not yet dropped, and pooled buffers (default
    /// [`DEFAULT_RECEIVE_BUDGET`]). Over budget a receiver waits instead of allocating.
    /// Should be at least `max_message_size`.
    pub memory_budget: Arc<MemoryBudget>,
    /// Longest time a frame that has started may go without progress (no bytes arrive or
    /// no budget is free) before the receiver fails with [`TransportError::Stalled`]
    /// (default [`DEFAULT_FRAME_TIMEOUT`]; `None`: wait forever). Time between messages is
    /// not limited here (see the RPC server's idle timeout). A limit needs a tokio runtime
    /// with its time driver enabled.
    pub frame_timeout: Option<Duration>,
}

impl StreamConfig {
    /// These settings with another [`StreamConfig::max_message_size`].
    pub fn with_max_message_size(mut self, max: usize) -> StreamConfig {
        self.max_message_size = max;
        self
    }

    /// These settings with another [`StreamConfig::read_buffer_size`].
    pub fn with_read_buffer_size(mut self, size: usize) -> StreamConfig {
        self.read_buffer_size = size;
        self
    }

    /// These settings drawing on another [`StreamConfig::memory_budget`].
    pub fn with_memory_budget(mut self, budget: Arc<MemoryBudget>) -> StreamConfig {
        self.memory_budget = budget;
        self
    }

    /// These settings with another [`StreamConfig::frame_timeout`].
    pub fn with_frame_timeout(mut self, timeout: Option<Duration>) -> StreamConfig {
        self.frame_timeout = timeout;
        self
    }

    /// The capability table of a connection framed by this module: reliable, ordered,
    /// zero-copy both ways, nothing registered or one-sided. `event_fd` says whether progress
    /// is driven by a pollable descriptor (a socket: yes; an in-memory pipe: no).
    pub fn capabilities(&self, name: &'static str, event_fd: bool) -> Capabilities {
        let mut caps = Capabilities::new(name, self.max_message_size);
        caps.zero_copy_send = true;
        caps.zero_copy_recv = true;
        caps.event_fd = event_fd;
        caps
    }
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            read_buffer_size: DEFAULT_READ_BUFFER,
            memory_budget: MemoryBudget::new(DEFAULT_RECEIVE_BUDGET),
            frame_timeout: Some(DEFAULT_FRAME_TIMEOUT),
        }
    }
}

/// The sending half of a stream connection.
///
/// Messages are queued as (prefix + header, payload) pairs and written with vectored writes
/// straight from the caller's [`Bytes`]: no payload copy. What is left to write in one piece
/// (a frame with an empty payload) is written with a plain `write`, which costs the kernel
/// less than a one-element `writev`. The queue is also what makes `send`
/// cancel safe: a frame whose future was dropped half-written stays at the front of the queue
/// and the next operation finishes it, so the stream never carries half a frame.
#[derive(Debug)]
pub struct StreamSender<W> {
    io: W,
    metrics: Arc<Metrics>,
    encoder: FrameEncoder,
    queue: VecDeque<EncodedFrame>,
    /// Bytes of the queue's front frame already written.
    offset: usize,
}

impl<W: AsyncWrite + Unpin + Send + 'static> StreamSender<W> {
    /// Wraps the write half of a stream.
    pub fn new(io: W, metrics: Arc<Metrics>, config: &StreamConfig) -> Self {
        StreamSender {
            io,
            metrics,
            encoder: FrameEncoder::new(config.max_message_size),
            queue: VecDeque::new(),
            offset: 0,
        }
    }

    /// Writes the queue out. Cancel safe: progress is recorded after every write.
    async fn write_queue(&mut self) -> Result<(), TransportError> {
        let StreamSender {
            io,
            metrics,
            queue,
            offset,
            ..
        } = self;
        while !queue.is_empty() {
            // The slices are built inside each poll, on the stack: kept across the await they
            // would make this future (and every future holding it, such as the RPC client's
            // boxed write) over a KiB larger, too large for the allocator's fast path.
            let n = std::future::poll_fn(|cx| {
                // One frame queued (a lone `send`, the usual case): its rest is one or two
                // parts, written without filling the array of `MAX_SLICES` slices below (a
                // KiB of stores per write, about a tenth of a small send's instructions).
                // One contiguous part (a frame with an empty payload, such as a `void o()`
                // call or its reply, or the payload's rest) is a plain write, which spares the
                // kernel importing an iovec array
                // (docs/notes/2026-12-03-bench-one-contiguous-write.md).
                if queue.len() == 1 {
                    let [head, payload] = queue[0].parts();
                    let io = std::pin::Pin::new(&mut *io);
                    return if *offset >= head.len() {
                        io.poll_write(cx, &payload[*offset - head.len()..])
                    } else if payload.is_empty() {
                        io.poll_write(cx, &head[*offset..])
                    } else {
                        let parts = [IoSlice::new(&head[*offset..]), IoSlice::new(payload)];
                        io.poll_write_vectored(cx, &parts)
                    };
                }
                let mut slices = [IoSlice::new(&[]); MAX_SLICES];
                let mut n_slices = 0;
                let mut skip = *offset;
                'fill: for frame in queue.iter() {
                    for part in frame.parts() {
                        if skip >= part.len() {
                            skip -= part.len();
                            continue;
                        }
                        slices[n_slices] = IoSlice::new(&part[skip..]);
                        skip = 0;
                        n_slices += 1;
                        if n_slices == MAX_SLICES {
                            break 'fill;
                        }
                    }
                }
                // Two frames or more: at least two parts (every frame's head is non-empty).
                std::pin::Pin::new(&mut *io).poll_write_vectored(cx, &slices[..n_slices])
            })
            .await?;
            metrics.syscalls.incr();
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::WriteZero).into());
            }
            metrics.bytes_sent.add(n as u64);
            *offset += n;
            while let Some(front) = queue.front() {
                let len = front.wire_len();
                if *offset < len {
                    break;
                }
                *offset -= len;
                queue.pop_front();
                metrics.messages_sent.incr();
            }
        }
        Ok(())
    }
}

impl<W: AsyncWrite + Unpin + Send + 'static> MessageSender for StreamSender<W> {
    async fn send(&mut self, msg: Message) -> Result<(), TransportError> {
        self.queue.push_back(self.encoder.encode_frame(msg)?);
        self.write_queue().await
    }

    async fn send_batch(&mut self, msgs: &mut Vec<Message>) -> Result<(), TransportError> {
        // All or nothing: a message over the limit fails the batch before any is queued.
        for m in msgs.iter() {
            self.encoder.check(m)?;
        }
        self.queue.reserve(msgs.len());
        for m in msgs.drain(..) {
            self.queue.push_back(self.encoder.encode_frame(m)?);
        }
        self.write_queue().await
    }

    async fn flush(&mut self) -> Result<(), TransportError> {
        self.write_queue().await
    }

    fn max_message_size(&self) -> usize {
        self.encoder.max_message_size()
    }

    async fn close(&mut self) -> Result<(), TransportError> {
        self.write_queue().await?;
        self.io.shutdown().await?;
        Ok(())
    }

    fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

/// Buffers of received large frames, returned when their payload is dropped. Each keeps its
/// charge to the budget while pooled.
#[derive(Debug)]
struct LargePool {
    free: Mutex<Vec<(Vec<u8>, Charge)>>,
    budget: Arc<MemoryBudget>,
}

impl LargePool {
    fn new(budget: Arc<MemoryBudget>) -> LargePool {
        LargePool {
            free: Mutex::default(),
            budget,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(Vec<u8>, Charge)>> {
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An empty buffer with room for `total` bytes, if one is pooled that fits without
    /// much waste: the one given back last, whose bytes are the likeliest to still be in
    /// the CPU cache for the kernel's copy into it (taking the oldest cycles a window of
    /// replies through every pooled buffer). The order makes no throughput difference beyond
    /// the noise; it is kept because it is the one a cache wants.
    fn take(&self, total: usize) -> Option<(Vec<u8>, Charge)> {
        let mut free = self.lock();
        let i = free
            .iter()
            .rposition(|(b, _)| b.capacity() >= total && b.capacity() / 2 <= total)?;
        // `remove`, not `swap_remove`: the rest keep their order, newest last.
        let (mut b, charge) = free.remove(i);
        b.clear();
        Some((b, charge))
    }

    /// Keeps `buf` for reuse if it is not too large, the pool is not full, and at most half
    /// the budget is in use (pooled memory must not keep other connections from reading);
    /// otherwise frees it and its charge.
    fn give(&self, buf: Vec<u8>, charge: Charge) {
        if buf.capacity() > LARGE_POOL_MAX_BUFFER || self.budget.used() > self.budget.limit() / 2 {
            return;
        }
        let mut free = self.lock();
        let held: usize = free.iter().map(|(b, _)| b.capacity()).sum();
        if free.len() < LARGE_POOL_MAX_BUFFERS && held + buf.capacity() <= LARGE_POOL_MAX_BYTES {
            free.push((buf, charge));
        }
    }
}

/// Owner of a received large frame; gives the buffer back to its pool on drop.
struct PooledFrame {
    buf: Vec<u8>,
    charge: Charge,
    pool: Arc<LargePool>,
}

impl AsRef<[u8]> for PooledFrame {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for PooledFrame {
    fn drop(&mut self) {
        self.pool.give(
            std::mem::take(&mut self.buf),
            std::mem::take(&mut self.charge),
        );
    }
}

/// A large frame being read: prefix, header and payload land in `buf` until it holds
/// `prefix.frame_len()` bytes. `charge` covers `buf`'s capacity.
#[derive(Debug)]
struct LargeFrame {
    buf: Vec<u8>,
    charge: Charge,
    /// As the receiver's decoder parsed it.
    prefix: FramePrefix,
}

/// Runs `f` until `deadline` (if any); `None` if the deadline passed first.
///
/// `timer` is the receiver's one stall timer, kept across waits: a wait whose future is
/// ready at once never touches it, and a later deadline does not re-register it (which
/// takes the timer driver's lock); when it fires before `deadline` it is moved to
/// `deadline` then. So a steady stream re-arms it about once per frame timeout, not once
/// per read.
async fn until<F: Future>(
    timer: &mut Option<Pin<Box<Sleep>>>,
    deadline: Option<Instant>,
    f: F,
) -> Option<F::Output> {
    let Some(deadline) = deadline else {
        return Some(f.await);
    };
    let mut f = pin!(f);
    let timer = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
    loop {
        tokio::select! {
            biased;
            v = &mut f => return Some(v),
            () = timer.as_mut() => {
                if Instant::now() >= deadline {
                    return None;
                }
                timer.as_mut().reset(deadline);
            }
        }
    }
}

/// The receiving half of a stream connection.
///
/// A fatal error is returned once as what happened (`Truncated`, `Malformed`, `Stalled`, an
/// I/O error, ...); every later [`recv`](MessageReceiver::recv) returns
/// [`TransportError::Failed`] carrying that first error, also after a clean end (`Ok(None)`,
/// then `Failed(Closed)`):
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::sync::Arc;
/// use tokio::io::AsyncWriteExt;
/// use transport_framed::{StreamConfig, StreamReceiver};
/// use transport_core::{MessageReceiver, TransportError};
///
/// let (mut peer, ours) = tokio::io::duplex(1024);
/// let mut rx = StreamReceiver::new(ours, Arc::default(), &StreamConfig::default());
/// peer.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
/// assert!(matches!(rx.recv().await, Err(TransportError::Malformed(_))));
/// let again = rx.recv().await.unwrap_err();
/// assert!(matches!(again, TransportError::Failed(_)));
/// assert!(matches!(again.original(), TransportError::Malformed(_)));
/// # }
/// ```
#[derive(Debug)]
pub struct StreamReceiver<R> {
    io: R,
    buf: BytesMut,
    decoder: FrameDecoder,
    metrics: Arc<Metrics>,
    read_buffer_size: usize,
    /// The first fatal error (or [`TransportError::Closed`] after a clean end), reported
    /// again by every later `recv` as [`TransportError::Failed`].
    failed: Option<Arc<TransportError>>,
    large: Option<LargeFrame>,
    large_pool: Arc<LargePool>,
    /// The last frame was large: read only [`READ_AFTER_LARGE`] bytes ahead until a small
    /// frame shows up again.
    after_large: bool,
    frame_timeout: Option<Duration>,
    /// When the frame in progress times out, if it does not progress before.
    stall_deadline: Option<Instant>,
    /// Bytes arrived (or a message was taken) since `stall_deadline` was set.
    progressed: bool,
    /// Armed on the first wait inside a frame, then kept (see [`until`]).
    stall_timer: Option<Pin<Box<Sleep>>>,
    /// The socket, for spinning before the runtime parks ([`transport_core::spin`]).
    spin_fd: Option<std::os::fd::RawFd>,
}

impl<R: AsyncRead + Unpin + Send + 'static> StreamReceiver<R> {
    /// Wraps the read half of a stream.
    pub fn new(io: R, metrics: Arc<Metrics>, config: &StreamConfig) -> Self {
        StreamReceiver {
            io,
            buf: BytesMut::with_capacity(config.read_buffer_size),
            decoder: FrameDecoder::new(config.max_message_size),
            metrics,
            read_buffer_size: config.read_buffer_size.max(PREFIX_LEN + MAX_HEADER_LEN),
            failed: None,
            large: None,
            large_pool: Arc::new(LargePool::new(config.memory_budget.clone())),
            after_large: false,
            frame_timeout: config.frame_timeout,
            stall_deadline: None,
            progressed: true,
            stall_timer: None,
            spin_fd: None,
        }
    }

    /// Names the socket this receiver reads, so that a runtime thread with
    /// [`transport_core::spin::park_hook`] installed polls it before parking while a read waits.
    pub fn set_spin_fd(&mut self, fd: std::os::fd::RawFd) {
        self.spin_fd = Some(fd);
    }

    /// Capacity of the current read buffer (for tests of the allocation bound).
    pub fn buffer_capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// Remembers a fatal `e` for later calls; returns it.
    fn fail(&mut self, e: TransportError) -> TransportError {
        if e.is_fatal() && self.failed.is_none() {
            self.failed = Some(Arc::new(e.duplicate()));
        }
        e
    }

    /// The deadline of the frame in progress: renewed when it progressed since the last wait.
    /// Reads the clock only then.
    fn stall_deadline(&mut self) -> Option<Instant> {
        let t = self.frame_timeout?;
        if self.progressed || self.stall_deadline.is_none() {
            self.stall_deadline = Some(Instant::now() + t);
            self.progressed = false;
        }
        self.stall_deadline
    }

    /// Fails with [`TransportError::Stalled`] at the frame in progress: the large frame
    /// being read, else the decoder's.
    fn stalled(&mut self) -> TransportError {
        let (received, expected) = match &self.large {
            Some(lf) => (lf.buf.len() as u64, lf.prefix.frame_len() as u64),
            None => self.decoder.progress(&self.buf),
        };
        let e = TransportError::Stalled {
            received,
            expected,
            after: self.frame_timeout.unwrap_or_default(),
        };
        self.fail(e)
    }

    /// Moves the start of a frame larger than the read buffer (`prefix`, as the decoder
    /// parsed and accepted it) into a buffer of its own: a pooled one that fits, or a new one
    /// charged to the budget (its whole length while the budget is less than half used, else
    /// a first chunk; waiting for budget if need be). The decoder hands the frame over
    /// ([`FrameDecoder::detach`]) and the rest is read straight into that buffer. Cancel
    /// safe: nothing changes until the buffer is had.
    async fn start_large(&mut self, prefix: FramePrefix) -> Result<(), TransportError> {
        let total = prefix.frame_len();
        // Room for the frame and the start of the next one (`READ_PAST_LARGE`).
        let whole_room = total.saturating_add(READ_PAST_LARGE);
        let (mut buf, charge) = match self.large_pool.take(whole_room) {
            Some(reused) => reused,
            None => {
                let budget = self.large_pool.budget.clone();
                // With more than half the budget free the whole frame is reserved at once
                // (no growth, no copy); otherwise its buffer grows with what arrives.
                let whole = (budget.used().saturating_add(whole_room) <= budget.limit() / 2)
                    .then(|| budget.try_charge(whole_room))
                    .flatten();
                match whole {
                    Some(charge) => (Vec::with_capacity(whole_room), charge),
                    None => {
                        let first = total.min(LARGE_FIRST_CHUNK.max(2 * self.buf.len()));
                        let deadline = self.stall_deadline();
                        match until(&mut self.stall_timer, deadline, budget.charge(first)).await {
                            Some(charge) => (Vec::with_capacity(first), charge),
                            None => return Err(self.stalled()),
                        }
                    }
                }
            }
        };
        // The payload bytes that were read ahead into the read buffer have to be moved.
        let read_ahead = self
            .buf
            .len()
            .saturating_sub(PREFIX_LEN + prefix.header_len());
        let prefix = self
            .decoder
            .detach(&mut self.buf, &mut buf)
            .expect("start_large is called with the decoder's pending frame");
        self.metrics.payload_bytes_copied.add(read_ahead as u64);
        self.large = Some(LargeFrame {
            buf,
            charge,
            prefix,
        });
        Ok(())
    }

    /// Reads the large frame in progress to its end, growing its buffer (and its charge) as
    /// bytes arrive. A buffer with room beyond the frame takes up to [`READ_PAST_LARGE`]
    /// bytes of the stream after it in the same read; they move to the read buffer, where
    /// the next frame starts. Cancel safe: progress stays in `large`.
    async fn finish_large(&mut self) -> Result<Message, TransportError> {
        loop {
            let (len, total, full, end) = {
                let lf = self.large.as_ref().expect("a large frame is in progress");
                let len = lf.buf.len();
                let total = lf.prefix.frame_len();
                let cap = lf.buf.capacity();
                // Read past the frame only into room the buffer already has.
                let end = if cap > total {
                    cap.min(total.saturating_add(READ_PAST_LARGE))
                } else {
                    total
                };
                (len, total, len == cap, end)
            };
            if len >= total {
                break;
            }
            let deadline = self.stall_deadline();
            if full {
                let lf = self.large.as_mut().expect("a large frame is in progress");
                let more = total.min(len.saturating_mul(2)) - len;
                if until(&mut self.stall_timer, deadline, lf.charge.grow(more))
                    .await
                    .is_none()
                {
                    return Err(self.stalled());
                }
                lf.buf.reserve_exact(more);
                // Growing may move what arrived so far.
                self.metrics.payload_bytes_copied.add(len as u64);
            }
            let read = {
                let lf = self.large.as_mut().expect("a large frame is in progress");
                let mut room = (&mut lf.buf).limit(end - len);
                until(&mut self.stall_timer, deadline, self.io.read_buf(&mut room)).await
            };
            let n = match read {
                Some(Ok(n)) => n,
                Some(Err(e)) => return Err(self.fail(e.into())),
                None => return Err(self.stalled()),
            };
            self.metrics.syscalls.incr();
            if n == 0 {
                let e = TransportError::Truncated {
                    received: len as u64,
                    expected: total as u64,
                };
                return Err(self.fail(e));
            }
            self.progressed = true;
            self.metrics.bytes_received.add(n as u64);
        }
        let mut lf = self.large.take().expect("a large frame is in progress");
        let total = lf.prefix.frame_len();
        if lf.buf.len() > total {
            // The next frame's start. The read buffer is empty: all it held of this frame
            // moved to `lf.buf` (`start_large`), and it is not read into meanwhile.
            debug_assert!(self.buf.is_empty());
            self.buf.extend_from_slice(&lf.buf[total..]);
            lf.buf.truncate(total);
        }
        let frame = Bytes::from_owner(PooledFrame {
            buf: lf.buf,
            charge: lf.charge,
            pool: self.large_pool.clone(),
        });
        lf.prefix.split_frame(frame).map_err(|e| self.fail(e))
    }

    /// Makes room for the next read: exactly one frame's worth for a large frame whose
    /// length is known (and validated), otherwise the usual read buffer.
    fn prepare_read(&mut self) {
        match self.decoder.pending_frame_len() {
            Some(total) if total > self.buf.capacity() => {
                let mut exact = BytesMut::with_capacity(total);
                exact.extend_from_slice(&self.buf);
                self.buf = exact;
            }
            Some(total) if total <= self.buf.capacity() => {}
            _ => {
                if self.buf.capacity() - self.buf.len() < PREFIX_LEN + MAX_HEADER_LEN {
                    self.buf.reserve(self.read_buffer_size);
                }
            }
        }
    }
}

impl<R: AsyncRead + Unpin + Send + 'static> MessageReceiver for StreamReceiver<R> {
    async fn recv(&mut self) -> Result<Option<Message>, TransportError> {
        if let Some(first) = &self.failed {
            return Err(TransportError::Failed(first.clone()));
        }
        loop {
            if self.large.is_some() {
                let msg = self.finish_large().await?;
                self.after_large = true;
                self.progressed = true;
                self.metrics.messages_received.incr();
                return Ok(Some(msg));
            }
            match self.decoder.decode(&mut self.buf) {
                Ok(Some(msg)) => {
                    self.after_large = false;
                    self.progressed = true;
                    self.metrics.messages_received.incr();
                    return Ok(Some(msg));
                }
                Ok(None) => {}
                Err(e) => return Err(self.fail(e)),
            }
            if let Some(prefix) = self.decoder.pending_prefix() {
                if prefix.frame_len() > self.read_buffer_size {
                    self.start_large(prefix).await?;
                    continue;
                }
            }
            self.prepare_read();
            let limit = if self.after_large && self.decoder.pending_frame_len().is_none() {
                READ_AFTER_LARGE
            } else {
                usize::MAX
            };
            // Between messages a read may wait forever; inside one (also one being skipped),
            // only `frame_timeout`.
            let deadline = if self.decoder.is_idle(&self.buf) {
                None
            } else {
                self.stall_deadline()
            };
            let read = until(
                &mut self.stall_timer,
                deadline,
                transport_core::spin::spinning(
                    self.spin_fd,
                    self.io.read_buf(&mut (&mut self.buf).limit(limit)),
                ),
            )
            .await;
            let n = match read {
                Some(Ok(n)) => n,
                Some(Err(e)) => return Err(self.fail(e.into())),
                None => return Err(self.stalled()),
            };
            self.progressed = true;
            self.metrics.syscalls.incr();
            if n == 0 {
                return match self.decoder.decode_eof(&mut self.buf) {
                    Ok(Some(msg)) => Ok(Some(msg)),
                    Ok(None) => {
                        self.failed = Some(Arc::new(TransportError::Closed));
                        Ok(None)
                    }
                    Err(e) => Err(self.fail(e)),
                };
            }
            self.metrics.bytes_received.add(n as u64);
        }
    }

    fn remaining_in_message(&self) -> Option<usize> {
        match &self.large {
            Some(lf) => Some(lf.prefix.frame_len().saturating_sub(lf.buf.len())),
            None => self
                .decoder
                .pending_frame_len()
                .map(|total| total.saturating_sub(self.buf.len())),
        }
    }

    fn has_buffered_message(&self) -> bool {
        self.large.is_none() && self.decoder.holds_frame(&self.buf)
    }

    fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::encode_prefix;
    use bytes::Bytes;
    use transport_core::HeaderBytes;

    fn pair(
        max: usize,
    ) -> (
        StreamSender<tokio::io::DuplexStream>,
        StreamReceiver<tokio::io::DuplexStream>,
        tokio::io::DuplexStream,
    ) {
        let (a, b) = tokio::io::duplex(1 << 16);
        let (c, d) = tokio::io::duplex(1 << 16);
        drop(c);
        let cfg = StreamConfig {
            max_message_size: max,
            read_buffer_size: 4096,
            ..StreamConfig::default()
        };
        let m = Arc::new(Metrics::default());
        (
            StreamSender::new(a, m.clone(), &cfg),
            StreamReceiver::new(b, m, &cfg),
            d,
        )
    }

    /// The write futures stay small: the RPC client boxes one per batch it writes, and a
    /// future over ~1 KiB misses the allocator's per-thread cache (the vectored write's 64
    /// slices would make it 1.1 KiB; docs/notes/2026-12-03-bench-instructions-per-call.md).
    #[test]
    fn write_futures_keep_their_slices_off_the_future() {
        let (mut tx, _rx, _) = pair(1 << 20);
        let mut batch = vec![Message::new(HeaderBytes::EMPTY, Bytes::new())];
        let send_batch = std::mem::size_of_val(&tx.send_batch(&mut batch));
        let send = std::mem::size_of_val(&tx.send(Message::new(HeaderBytes::EMPTY, Bytes::new())));
        let slices = MAX_SLICES * std::mem::size_of::<IoSlice<'static>>();
        assert!(
            send_batch < slices && send < slices,
            "send_batch future {send_batch} B, send future {send} B: the {slices} B of slices \
             are kept across the write's await"
        );
    }

    #[tokio::test]
    async fn messages_round_trip_in_order() {
        let (mut tx, mut rx, _) = pair(1 << 20);
        let writer = tokio::spawn(async move {
            for i in 0u32..200 {
                let payload = Bytes::from(vec![i as u8; (i as usize) * 37]);
                tx.send(Message::new(HeaderBytes::from(i.to_le_bytes()), payload))
                    .await
                    .unwrap();
            }
            let mut batch: Vec<Message> = (0..10)
                .map(|i| Message::new(HeaderBytes::from([i as u8]), Bytes::new()))
                .collect();
            tx.send_batch(&mut batch).await.unwrap();
            assert!(batch.is_empty());
            tx.close().await.unwrap();
        });
        for i in 0u32..200 {
            let m = rx.recv().await.unwrap().unwrap();
            assert_eq!(m.header.as_slice(), i.to_le_bytes());
            assert_eq!(m.payload.len(), i as usize * 37);
            assert!(m.payload.iter().all(|&b| b == i as u8));
        }
        for i in 0..10u8 {
            assert_eq!(rx.recv().await.unwrap().unwrap().header.as_slice(), [i]);
        }
        assert!(rx.recv().await.unwrap().is_none(), "clean EOF");
        writer.await.unwrap();
    }

    /// A lone frame (the writer's one-frame path) written a few bytes at a time, so that its
    /// writes start inside its head, at the head's end and inside its payload, arrives whole,
    /// for every mix of empty and non-empty header and payload.
    #[tokio::test]
    async fn lone_frames_written_in_pieces_arrive_whole() {
        let (a, b) = tokio::io::duplex(3);
        let cfg = StreamConfig::default();
        let mut tx = StreamSender::new(a, Arc::default(), &cfg);
        let m = Arc::new(Metrics::default());
        let mut rx = StreamReceiver::new(b, m.clone(), &cfg);
        let cases: Vec<(Vec<u8>, Vec<u8>)> = [0usize, 1, 7]
            .iter()
            .flat_map(|&h| [0usize, 1, 13].map(|p| (vec![h as u8; h], vec![p as u8; p])))
            .collect();
        let sent = cases.clone();
        let writer = tokio::spawn(async move {
            for (h, p) in sent {
                let msg = Message::new(HeaderBytes::new(&h).unwrap(), Bytes::from(p));
                tx.send(msg).await.unwrap();
            }
        });
        let wait = std::time::Duration::from_secs(10);
        for (h, p) in cases {
            let got = tokio::time::timeout(wait, rx.recv())
                .await
                .expect("in time");
            let got = got.unwrap().unwrap();
            assert_eq!((got.header.as_slice(), &got.payload[..]), (&h[..], &p[..]));
        }
        tokio::time::timeout(wait, writer).await.unwrap().unwrap();
        // The 3-byte pipe made the writer write in pieces (and the reader read in them).
        assert!(m.snapshot().syscalls > 2 * 9, "{:?}", m.snapshot().syscalls);
    }

    #[tokio::test]
    async fn large_frame_gets_exact_allocation() {
        let (mut tx, mut rx, _) = pair(4 << 20);
        let payload = Bytes::from((0..(3 << 20)).map(|i| i as u8).collect::<Vec<_>>());
        let p2 = payload.clone();
        tokio::spawn(async move { tx.send(Message::new(HeaderBytes::EMPTY, p2)).await });
        let m = rx.recv().await.unwrap().unwrap();
        assert_eq!(m.payload, payload);
        assert!(rx.buffer_capacity() <= (3 << 20) + PREFIX_LEN + 4096);
    }

    /// Back-to-back large frames are read into their own buffers, not first into the read
    /// buffer and then copied: after a large frame the receiver reads only a little ahead.
    /// A small frame after the large ones still arrives, and reads return to full size.
    #[tokio::test]
    async fn large_frames_in_a_row_are_barely_copied() {
        let (mut rx, m) = eight_large_frames_then_a_small_one().await;
        recv_the_eight_large_frames(&mut rx).await;
        let small = rx.recv().await.unwrap().unwrap();
        assert_eq!(
            (small.header.as_slice(), &small.payload[..]),
            (&[9u8][..], &b"small"[..])
        );
        // The first frame's start came with a full read buffer; the other seven with at most
        // READ_AFTER_LARGE bytes each, not a full read buffer.
        let copied = m.snapshot().payload_bytes_copied;
        assert!(
            copied <= (64 << 10) + 7 * READ_AFTER_LARGE as u64,
            "{copied} payload bytes copied"
        );
    }

    /// A stream of large frames takes one read per frame: each frame's last read also takes
    /// the next frame's start (`READ_PAST_LARGE`), so that start is not a read of its own.
    /// A small frame caught in that read arrives without another.
    #[tokio::test]
    async fn large_frames_in_a_row_take_one_read_each() {
        let (mut rx, m) = eight_large_frames_then_a_small_one().await;
        recv_the_eight_large_frames(&mut rx).await;
        let reads_for_large = m.snapshot().syscalls;
        let small = rx.recv().await.unwrap().unwrap();
        assert_eq!(&small.payload[..], b"small");
        // The first read fills the read buffer; then one read per frame, each ending in the
        // next frame's start (two per frame without the read past the frame).
        assert_eq!(reads_for_large, 1 + 8, "reads for 8 large frames");
        assert_eq!(
            m.snapshot().syscalls,
            reads_for_large,
            "the small frame came with the last large frame's read"
        );
    }

    /// A receiver (read buffer 64 KiB) with 8 frames of 256 KiB (header `[i]`, payload all
    /// `i`) and then a small one (header `[9]`, payload "small") written before its first
    /// read, so every read could take a full buffer; and the receiver's own counters.
    async fn eight_large_frames_then_a_small_one(
    ) -> (StreamReceiver<tokio::io::DuplexStream>, Arc<Metrics>) {
        let (a, b) = tokio::io::duplex(8 << 20);
        let cfg = StreamConfig {
            max_message_size: 1 << 20,
            read_buffer_size: 64 << 10,
            ..StreamConfig::default()
        };
        let mut tx = StreamSender::new(a, Arc::default(), &cfg);
        let m = Arc::new(Metrics::default());
        let rx = StreamReceiver::new(b, m.clone(), &cfg);
        for i in 0..8u8 {
            let payload = Bytes::from(vec![i; 256 << 10]);
            tx.send(Message::new(HeaderBytes::from([i]), payload))
                .await
                .unwrap();
        }
        let small = Message::new(HeaderBytes::from([9]), Bytes::from_static(b"small"));
        tx.send(small).await.unwrap();
        (rx, m)
    }

    /// Receives and checks the 8 large frames of [`eight_large_frames_then_a_small_one`].
    async fn recv_the_eight_large_frames(rx: &mut StreamReceiver<tokio::io::DuplexStream>) {
        for i in 0..8u8 {
            let msg = rx.recv().await.unwrap().unwrap();
            assert_eq!(msg.header.as_slice(), [i]);
            assert_eq!(msg.payload.len(), 256 << 10);
            assert!(msg.payload.iter().all(|&b| b == i));
        }
    }

    /// The receiver reports how much of a partly received message is still to come, for
    /// small frames (in the read buffer) and large ones (in their own buffer), and nothing
    /// between messages.
    #[tokio::test]
    async fn remaining_in_message_follows_partial_frames() {
        use tokio::io::AsyncWriteExt;
        let (mut w, b) = tokio::io::duplex(1 << 20);
        let cfg = StreamConfig {
            max_message_size: 1 << 20,
            read_buffer_size: 4096,
            ..StreamConfig::default()
        };
        let mut rx = StreamReceiver::new(b, Arc::default(), &cfg);
        assert_eq!(rx.remaining_in_message(), None);
        for len in [1000usize, 100_000] {
            let mut frame = encode_prefix(2, len).to_vec();
            frame.extend_from_slice(&[1, 2]);
            frame.extend(std::iter::repeat_n(9u8, len));
            w.write_all(&frame[..500]).await.unwrap();
            let pending = tokio::time::timeout(std::time::Duration::from_millis(20), rx.recv());
            assert!(pending.await.is_err(), "the frame is incomplete");
            assert_eq!(rx.remaining_in_message(), Some(frame.len() - 500));
            w.write_all(&frame[500..]).await.unwrap();
            let msg = rx.recv().await.unwrap().unwrap();
            assert_eq!(msg.payload.len(), len);
            assert_eq!(rx.remaining_in_message(), None);
        }
    }

    /// A window of more than 16 large frames held at once goes back to the pool whole, and
    /// the next window reuses every buffer (a pool of 16 would make a window of 32 RPC
    /// replies of 64 KiB allocate half its buffers afresh).
    #[tokio::test]
    async fn a_window_of_32_large_frames_reuses_all_its_buffers() {
        let (mut tx, mut rx, _) = pair(8 << 20);
        let writer = tokio::spawn(async move {
            for i in 0..64u8 {
                let payload = Bytes::from(vec![i; 100_000]);
                tx.send(Message::new(HeaderBytes::from([0u8; 3]), payload))
                    .await
                    .unwrap();
            }
            tx
        });
        let mut first = Vec::new();
        for _ in 0..32 {
            first.push(rx.recv().await.unwrap().unwrap());
        }
        let buffers: std::collections::HashSet<usize> =
            first.iter().map(|m| m.payload.as_ptr() as usize).collect();
        assert_eq!(buffers.len(), 32, "held frames have buffers of their own");
        drop(first);
        let mut second = Vec::new();
        for i in 32..64u8 {
            let m = rx.recv().await.unwrap().unwrap();
            assert!(m.payload.iter().all(|&b| b == i));
            second.push(m);
        }
        let reused = second
            .iter()
            .filter(|m| buffers.contains(&(m.payload.as_ptr() as usize)))
            .count();
        assert_eq!(reused, 32, "every buffer of the first window is reused");
        drop(writer.await.unwrap());
    }

    /// The pool hands out the buffer given back last (the one whose bytes are likeliest
    /// still cached), not the oldest: a window of replies then cycles through few buffers.
    #[tokio::test]
    async fn the_large_buffer_given_back_last_is_reused_first() {
        let (mut tx, mut rx, _) = pair(4 << 20);
        let writer = tokio::spawn(async move {
            for i in 0..4u8 {
                let payload = Bytes::from(vec![i + 1; 100_000]);
                tx.send(Message::new(HeaderBytes::from([i; 3]), payload))
                    .await
                    .unwrap();
            }
            tx
        });
        let first = rx.recv().await.unwrap().unwrap();
        let second = rx.recv().await.unwrap().unwrap();
        let third = rx.recv().await.unwrap().unwrap();
        let buffer_of = |m: &Message| m.payload.as_ptr() as usize - (PREFIX_LEN + 3);
        let (a, b, c) = (buffer_of(&first), buffer_of(&second), buffer_of(&third));
        assert!(
            a != b && b != c && a != c,
            "held payloads have buffers of their own"
        );
        // Given back in the order first, second, third: the third is the newest.
        drop(first);
        drop(second);
        drop(third);
        let fourth = rx.recv().await.unwrap().unwrap();
        assert!(fourth.payload.iter().all(|&x| x == 4));
        assert_eq!(
            buffer_of(&fourth),
            c,
            "the buffer given back last is the one reused"
        );
        drop(writer.await.unwrap());
    }

    #[tokio::test]
    async fn large_frame_buffers_are_reused_once_dropped() {
        let (mut tx, mut rx, _) = pair(4 << 20);
        let m = rx.metrics().clone();
        let sizes = [300_000usize, 290_000, 300_000, 5_000];
        let writer = tokio::spawn(async move {
            for (i, n) in sizes.into_iter().enumerate() {
                let payload = Bytes::from(vec![i as u8 + 1; n]);
                tx.send(Message::new(HeaderBytes::from([i as u8; 3]), payload))
                    .await
                    .unwrap();
            }
            tx
        });
        let first = rx.recv().await.unwrap().unwrap();
        assert_eq!(first.header.as_slice(), [0u8; 3]);
        assert_eq!(first.payload.len(), 300_000);
        assert!(first.payload.iter().all(|&b| b == 1));
        // The frame's prefix and header sit right before its payload in the same buffer.
        let base = first.payload.as_ptr() as usize - (PREFIX_LEN + 3);
        drop(first);
        let second = rx.recv().await.unwrap().unwrap();
        assert_eq!(second.header.as_slice(), [1u8; 3]);
        assert_eq!(second.payload.len(), 290_000);
        assert!(second.payload.iter().all(|&b| b == 2));
        assert_eq!(
            second.payload.as_ptr() as usize - (PREFIX_LEN + 3),
            base,
            "a dropped large payload's buffer is reused for the next one that fits"
        );
        // Held payloads are never reused: the third frame gets memory of its own.
        let third = rx.recv().await.unwrap().unwrap();
        assert_eq!(third.header.as_slice(), [2u8; 3]);
        assert!(third.payload.iter().all(|&b| b == 3));
        assert!(
            second.payload.iter().all(|&b| b == 2),
            "untouched while held"
        );
        assert_ne!(third.payload.as_ptr(), second.payload.as_ptr());
        let small = rx.recv().await.unwrap().unwrap();
        assert_eq!(small.payload.len(), 5_000);
        assert!(small.payload.iter().all(|&b| b == 4));
        // What was read ahead into the read buffer had to be moved: counted, bounded by it.
        let copied = m.payload_bytes_copied.get();
        assert!(copied <= 3 * 16384, "copied {copied}");
        drop(writer.await.unwrap());
        assert!(rx.recv().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn large_frame_recv_is_cancel_safe_and_truncation_is_reported() {
        let (mut raw, b) = tokio::io::duplex(1 << 16);
        let cfg = StreamConfig {
            max_message_size: 1 << 20,
            read_buffer_size: 4096,
            ..StreamConfig::default()
        };
        let mut rx = StreamReceiver::new(b, Arc::new(Metrics::default()), &cfg);
        let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut wire = encode_prefix(2, payload.len()).to_vec();
        wire.extend_from_slice(b"hh");
        wire.extend_from_slice(&payload);
        // Half the frame, then the recv future is dropped.
        raw.write_all(&wire[..50_000]).await.unwrap();
        let r = tokio::time::timeout(std::time::Duration::from_millis(50), rx.recv()).await;
        assert!(r.is_err(), "no whole message yet");
        raw.write_all(&wire[50_000..]).await.unwrap();
        let m = rx.recv().await.unwrap().unwrap();
        assert_eq!(m.header.as_slice(), b"hh");
        assert_eq!(&m.payload[..], &payload[..]);
        // A second large frame cut short by the peer's death.
        raw.write_all(&wire[..30_000]).await.unwrap();
        drop(raw);
        match rx.recv().await {
            Err(TransportError::Truncated { received, expected }) => {
                assert_eq!(received, 30_000);
                assert_eq!(expected, wire.len() as u64);
            }
            other => panic!("expected Truncated, got {other:?}"),
        }
        assert!(matches!(
            first_failure(rx.recv().await),
            TransportError::Truncated {
                received: 30_000,
                ..
            }
        ));
    }

    /// The error a receiver reports after it failed: `Failed`, fatal, with the first error
    /// (typed) as its source; returns that first error.
    fn first_failure(r: Result<Option<Message>, TransportError>) -> TransportError {
        use std::error::Error;
        let e = r.expect_err("the receiver stays failed");
        assert!(e.is_fatal());
        let TransportError::Failed(first) = &e else {
            panic!("expected Failed, got {e:?}");
        };
        let source = e.source().expect("the first error is the source");
        let typed = source
            .downcast_ref::<TransportError>()
            .expect("the source is a TransportError");
        assert!(std::ptr::eq(typed, &**first));
        assert!(std::ptr::eq(e.original(), typed));
        typed.duplicate()
    }

    #[tokio::test]
    async fn cancelled_send_is_finished_by_the_next_operation() {
        let (a, b) = tokio::io::duplex(1024);
        let cfg = StreamConfig::default();
        let m = Arc::new(Metrics::default());
        let mut tx = StreamSender::new(a, m.clone(), &cfg);
        let mut rx = StreamReceiver::new(b, m, &cfg);
        let big = Bytes::from(vec![5u8; 100_000]);
        // Only 1 KiB fits in the pipe: the send stalls part-way and is dropped.
        let r = tokio::time::timeout(
            std::time::Duration::from_millis(20),
            tx.send(Message::new(HeaderBytes::from(*b"big"), big.clone())),
        )
        .await;
        assert!(r.is_err(), "the send must have stalled");
        let reader = tokio::spawn(async move {
            let first = rx.recv().await.unwrap().unwrap();
            let second = rx.recv().await.unwrap().unwrap();
            (first, second)
        });
        tx.send(Message::new(
            HeaderBytes::from(*b"next"),
            Bytes::from_static(b"x"),
        ))
        .await
        .unwrap();
        let (first, second) = reader.await.unwrap();
        assert_eq!(first.header.as_slice(), b"big");
        assert_eq!(first.payload, big);
        assert_eq!(second.header.as_slice(), b"next");
    }

    #[tokio::test]
    async fn oversize_send_writes_nothing() {
        let (mut tx, _rx, _) = pair(10);
        let e = tx
            .send(Message::new(HeaderBytes::EMPTY, Bytes::from(vec![0; 11])))
            .await
            .unwrap_err();
        assert!(matches!(
            e,
            TransportError::MessageTooLarge {
                len: 11,
                max: 10,
                ..
            }
        ));
        assert_eq!(tx.metrics().bytes_sent.get(), 0);
    }

    /// A batch refuses a message over the limit before writing anything, and leaves it (and
    /// the rest) in the batch: one message alone, or among others.
    #[tokio::test]
    async fn oversize_batch_writes_nothing_and_keeps_its_messages() {
        for others in [0, 2] {
            let (mut tx, _rx, _) = pair(10);
            let mut batch =
                vec![Message::new(HeaderBytes::EMPTY, Bytes::from_static(b"ok")); others];
            batch.push(Message::new(HeaderBytes::EMPTY, Bytes::from(vec![0; 11])));
            let e = tx.send_batch(&mut batch).await.unwrap_err();
            assert!(
                matches!(
                    e,
                    TransportError::MessageTooLarge {
                        len: 11,
                        max: 10,
                        ..
                    }
                ),
                "{e:?}"
            );
            assert_eq!(batch.len(), others + 1, "the batch keeps its messages");
            assert_eq!(tx.metrics().bytes_sent.get(), 0);
        }
    }

    #[tokio::test]
    async fn huge_length_is_rejected_before_allocating_and_stream_recovers() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let cfg = StreamConfig {
            max_message_size: 1024,
            read_buffer_size: 4096,
            ..StreamConfig::default()
        };
        let mut rx = StreamReceiver::new(b, Arc::new(Metrics::default()), &cfg);
        let mut raw = a;
        // A frame claiming 4 GiB, of which only 10 bytes are ever sent... then a valid frame
        // can not follow (the skip would swallow it), so the peer closes: expect Truncated.
        let mut wire = encode_prefix(3, u32::MAX as usize).to_vec();
        wire.extend_from_slice(b"abc");
        wire.extend_from_slice(&[0u8; 10]);
        raw.write_all(&wire).await.unwrap();
        let e = rx.recv().await.unwrap_err();
        assert!(
            matches!(e, TransportError::MessageTooLarge { ref header, .. } if header.as_slice() == b"abc")
        );
        assert!(!e.is_fatal());
        assert!(
            rx.buffer_capacity() <= 8192,
            "no allocation for the claimed length"
        );
        drop(raw);
        assert!(matches!(
            rx.recv().await,
            Err(TransportError::Truncated { .. })
        ));
    }

    #[tokio::test]
    async fn peer_dies_mid_message() {
        let (mut raw, b) = tokio::io::duplex(1 << 16);
        let cfg = StreamConfig::default();
        let mut rx = StreamReceiver::new(b, Arc::new(Metrics::default()), &cfg);
        let mut wire = encode_prefix(0, 1000).to_vec();
        wire.extend_from_slice(&[1u8; 400]);
        raw.write_all(&wire).await.unwrap();
        drop(raw);
        match rx.recv().await {
            Err(TransportError::Truncated { received, expected }) => {
                assert_eq!(received, 408);
                assert_eq!(expected, 1008);
            }
            other => panic!("expected Truncated, got {other:?}"),
        }
        for _ in 0..2 {
            assert!(matches!(
                first_failure(rx.recv().await),
                TransportError::Truncated {
                    received: 408,
                    expected: 1008
                }
            ));
        }
    }

    /// After a clean end the receiver answers `Failed(Closed)`; after a malformed frame,
    /// `Failed(Malformed)`: the first error's type, not a string.
    #[tokio::test]
    async fn after_the_end_or_a_fatal_error_the_first_error_is_kept_typed() {
        let (raw, b) = tokio::io::duplex(1 << 16);
        let mut rx = StreamReceiver::new(b, Arc::default(), &StreamConfig::default());
        drop(raw);
        assert!(rx.recv().await.unwrap().is_none(), "clean end");
        let again = rx.recv().await;
        assert!(matches!(first_failure(again), TransportError::Closed));

        let (mut raw, b) = tokio::io::duplex(1 << 16);
        let mut rx = StreamReceiver::new(b, Arc::default(), &StreamConfig::default());
        raw.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        let first = rx.recv().await.unwrap_err();
        assert!(matches!(first, TransportError::Malformed(m) if m.contains("magic")));
        // More (valid) bytes do not revive it.
        raw.write_all(&encode_prefix(0, 0)).await.unwrap();
        assert!(matches!(
            first_failure(rx.recv().await),
            TransportError::Malformed(m) if m.contains("magic")
        ));
        let shown = rx.recv().await.unwrap_err().to_string();
        assert!(
            shown.starts_with("the connection failed earlier: malformed frame: bad magic"),
            "{shown}"
        );
    }

    #[tokio::test]
    async fn garbage_is_malformed() {
        let (mut raw, b) = tokio::io::duplex(1 << 16);
        let mut rx = StreamReceiver::new(b, Arc::new(Metrics::default()), &StreamConfig::default());
        raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        assert!(matches!(rx.recv().await, Err(TransportError::Malformed(_))));
    }

    /// A receiver with its own budget, read side fed by hand.
    fn budgeted(
        budget: usize,
    ) -> (
        tokio::io::DuplexStream,
        StreamReceiver<tokio::io::DuplexStream>,
    ) {
        let (raw, b) = tokio::io::duplex(8 << 20);
        let cfg = StreamConfig {
            max_message_size: 64 << 20,
            read_buffer_size: 4096,
            memory_budget: MemoryBudget::new(budget),
            frame_timeout: Some(Duration::from_secs(30)),
        };
        (raw, StreamReceiver::new(b, Arc::default(), &cfg))
    }

    /// Announcing a 60 MiB frame to a receiver whose budget is short (64 MiB: the frame is
    /// more than half of it) costs one first chunk, not 60 MiB: what it holds grows with what
    /// arrives, charged to the budget.
    #[tokio::test(start_paused = true)]
    async fn an_announced_length_alone_allocates_one_first_chunk() {
        let (mut raw, mut rx) = budgeted(64 << 20);
        let budget = rx.large_pool.budget.clone();
        let len = 60 << 20;
        let mut head = encode_prefix(2, len).to_vec();
        head.extend_from_slice(b"hh");
        raw.write_all(&head).await.unwrap();
        let r = tokio::time::timeout(Duration::from_secs(1), rx.recv()).await;
        assert!(r.is_err(), "nothing to deliver yet");
        assert_eq!(budget.used(), LARGE_FIRST_CHUNK, "one first chunk, charged");
        // 3 MiB arrive: the buffer doubles to 4 MiB, not to 60.
        raw.write_all(&vec![1u8; 3 << 20]).await.unwrap();
        let r = tokio::time::timeout(Duration::from_secs(1), rx.recv()).await;
        assert!(r.is_err(), "still incomplete");
        assert_eq!(budget.used(), 4 << 20, "grown with the bytes that arrived");
        drop(raw);
        assert!(matches!(
            rx.recv().await,
            Err(TransportError::Truncated { .. })
        ));
        drop(rx);
        assert_eq!(budget.used(), 0, "everything given back");
    }

    /// Many connections announcing large frames together hold at most the budget: the others
    /// wait for budget, and a frame that gets neither bytes nor budget for `frame_timeout`
    /// fails with `Stalled`.
    #[tokio::test(start_paused = true)]
    async fn announcements_on_many_connections_stay_within_the_budget_then_stall() {
        // 20 first chunks of 64 KiB would be 1.25 MiB: 8 fit, 12 wait.
        let budget = MemoryBudget::new(512 << 10);
        let mut peers = Vec::new();
        let mut tasks = Vec::new();
        for _ in 0..20 {
            let (raw, b) = tokio::io::duplex(1 << 16);
            let cfg = StreamConfig {
                max_message_size: 64 << 20,
                read_buffer_size: 4096,
                memory_budget: budget.clone(),
                frame_timeout: Some(Duration::from_secs(30)),
            };
            let mut rx = StreamReceiver::new(b, Arc::default(), &cfg);
            let mut raw = raw;
            raw.write_all(&encode_prefix(0, 60 << 20)).await.unwrap();
            raw.write_all(&[7u8; 100]).await.unwrap();
            peers.push(raw);
            tasks.push(tokio::spawn(async move { rx.recv().await.map(|_| ()) }));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            budget.used(),
            512 << 10,
            "the budget is spent, not exceeded"
        );
        for t in tasks {
            match tokio::time::timeout(Duration::from_secs(40), t).await {
                Ok(Ok(Err(TransportError::Stalled { expected, .. }))) => {
                    assert_eq!(expected, (60 << 20) + PREFIX_LEN as u64)
                }
                other => panic!("expected Stalled, got {other:?}"),
            }
        }
        assert_eq!(budget.used(), 0);
        drop(peers);
    }

    /// A frame too large to accept is refused and its payload skipped; if the peer stops
    /// half-way through that payload, the skip times out like any started frame.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_skip_of_an_oversized_frame_times_out() {
        let (mut raw, b) = tokio::io::duplex(1 << 20);
        let cfg = StreamConfig {
            max_message_size: 1 << 20,
            read_buffer_size: 4096,
            ..StreamConfig::default()
        };
        let mut rx = StreamReceiver::new(b, Arc::default(), &cfg);
        let mut wire = encode_prefix(1, 4 << 20).to_vec();
        wire.extend_from_slice(&[0u8; 1001]);
        raw.write_all(&wire).await.unwrap();
        assert!(matches!(
            rx.recv().await,
            Err(TransportError::MessageTooLarge { .. })
        ));
        let start = tokio::time::Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(120), rx.recv()).await;
        // It reports how far into the rejected frame it got: prefix, header, 1000 bytes.
        let frame_len = (PREFIX_LEN + 1 + (4 << 20)) as u64;
        assert!(
            matches!(r, Ok(Err(TransportError::Stalled { received: 1009, expected, .. })) if expected == frame_len),
            "expected Stalled, got {r:?}"
        );
        assert!(start.elapsed() <= DEFAULT_FRAME_TIMEOUT + Duration::from_secs(1));
    }

    /// Peers that announce large frames and then trickle hold a first chunk each, not the
    /// budget: an honest large frame on another connection still gets through.
    #[tokio::test]
    async fn bare_announcements_leave_budget_for_an_honest_frame() {
        let budget = MemoryBudget::new(4 << 20);
        let cfg = StreamConfig {
            max_message_size: 64 << 20,
            read_buffer_size: 4096,
            memory_budget: budget.clone(),
            frame_timeout: Some(Duration::from_secs(30)),
        };
        let mut hostile = Vec::new();
        for _ in 0..16 {
            let (mut raw, b) = tokio::io::duplex(1 << 16);
            let mut rx = StreamReceiver::new(b, Arc::default(), &cfg);
            raw.write_all(&encode_prefix(0, 60 << 20)).await.unwrap();
            raw.write_all(&[1u8]).await.unwrap();
            let pending = tokio::time::timeout(Duration::from_millis(20), rx.recv()).await;
            assert!(pending.is_err());
            hostile.push((raw, rx));
        }
        assert_eq!(budget.used(), 16 * LARGE_FIRST_CHUNK, "a first chunk each");
        let (mut raw, b) = tokio::io::duplex(4 << 20);
        let mut rx = StreamReceiver::new(b, Arc::default(), &cfg);
        let mut wire = encode_prefix(0, 2 << 20).to_vec();
        wire.extend(std::iter::repeat_n(5u8, 2 << 20));
        raw.write_all(&wire).await.unwrap();
        let m = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("the honest frame is not starved")
            .unwrap()
            .unwrap();
        assert!(m.payload.len() == 2 << 20 && m.payload.iter().all(|&x| x == 5));
        drop(hostile);
    }

    /// A small frame that stops half-way fails after `frame_timeout`; an idle connection
    /// (nothing started) does not.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_small_frame_times_out_but_idle_does_not() {
        let (mut raw, mut rx) = budgeted(1 << 20);
        let idle = tokio::time::timeout(Duration::from_secs(600), rx.recv()).await;
        assert!(idle.is_err(), "no limit between messages");
        let mut wire = encode_prefix(0, 100).to_vec();
        wire.extend_from_slice(&[1u8; 10]);
        raw.write_all(&wire).await.unwrap();
        let start = tokio::time::Instant::now();
        match rx.recv().await {
            Err(TransportError::Stalled {
                received,
                expected,
                after,
            }) => {
                assert_eq!((received, expected), (18, 108));
                assert_eq!(after, Duration::from_secs(30));
            }
            other => panic!("expected Stalled, got {other:?}"),
        }
        assert!(start.elapsed() >= Duration::from_secs(30));
        assert!(start.elapsed() < Duration::from_secs(31));
        assert!(matches!(
            first_failure(rx.recv().await),
            TransportError::Stalled {
                received: 18,
                expected: 108,
                ..
            }
        ));
    }

    /// A frame that keeps arriving slowly is not cut: the limit counts from the last byte.
    #[tokio::test(start_paused = true)]
    async fn a_slow_frame_that_progresses_is_not_cut() {
        let (mut raw, mut rx) = budgeted(64 << 20);
        let payload = vec![3u8; 200_000];
        let mut wire = encode_prefix(0, payload.len()).to_vec();
        wire.extend_from_slice(&payload);
        let writer = tokio::spawn(async move {
            for chunk in wire.chunks(20_000) {
                tokio::time::sleep(Duration::from_secs(20)).await;
                raw.write_all(chunk).await.unwrap();
            }
            raw
        });
        let m = rx
            .recv()
            .await
            .expect("20 s gaps are within the 30 s limit")
            .unwrap();
        assert_eq!(m.payload.len(), payload.len());
        let _raw = writer.await.unwrap();
    }

    /// A received large payload stays charged while the application holds it; a receiver
    /// that needs more waits until it is dropped.
    #[tokio::test]
    async fn held_payloads_count_and_their_return_unblocks_a_waiting_receiver() {
        let budget = MemoryBudget::new(2 << 20);
        let cfg = StreamConfig {
            max_message_size: 64 << 20,
            read_buffer_size: 4096,
            memory_budget: budget.clone(),
            frame_timeout: Some(Duration::from_secs(30)),
        };
        let frame = |fill: u8| {
            let mut w = encode_prefix(0, 1_500_000).to_vec();
            w.extend(std::iter::repeat_n(fill, 1_500_000));
            w
        };
        let (mut raw_a, a) = tokio::io::duplex(4 << 20);
        let (mut raw_b, b) = tokio::io::duplex(4 << 20);
        let mut rx_a = StreamReceiver::new(a, Arc::default(), &cfg);
        let mut rx_b = StreamReceiver::new(b, Arc::default(), &cfg);
        raw_a.write_all(&frame(1)).await.unwrap();
        raw_b.write_all(&frame(2)).await.unwrap();
        let held = rx_a.recv().await.unwrap().unwrap();
        assert!(budget.used() >= 1_500_000, "the held payload is charged");
        let waiting = tokio::spawn(async move { rx_b.recv().await });
        let early = tokio::time::timeout(Duration::from_millis(100), async {
            while !waiting.is_finished() {
                tokio::task::yield_now().await;
            }
        })
        .await;
        assert!(
            early.is_err(),
            "b waits for budget while a's payload is held"
        );
        assert!(held.payload.iter().all(|&x| x == 1));
        drop(held);
        let m = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("b proceeds once the payload is dropped")
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(m.payload.len() == 1_500_000 && m.payload.iter().all(|&x| x == 2));
    }

    #[tokio::test]
    async fn recv_is_cancel_safe() {
        let (mut raw, b) = tokio::io::duplex(1 << 16);
        let mut rx = StreamReceiver::new(b, Arc::new(Metrics::default()), &StreamConfig::default());
        let mut wire = encode_prefix(1, 5).to_vec();
        wire.extend_from_slice(b"h12345");
        raw.write_all(&wire[..6]).await.unwrap();
        // The partial frame is read, then the recv future is dropped.
        let r = tokio::time::timeout(std::time::Duration::from_millis(50), rx.recv()).await;
        assert!(r.is_err(), "no whole message yet");
        raw.write_all(&wire[6..]).await.unwrap();
        let m = rx.recv().await.unwrap().unwrap();
        assert_eq!(m.header.as_slice(), b"h");
        assert_eq!(&m.payload[..], b"12345");
    }
}
