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
mod tests;
