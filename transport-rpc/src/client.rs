//! The RPC client: many calls in flight on one connection, matched by request id.

use super::error::{ProtocolError, RpcError, Status};
use super::header::{Kind, RpcHeader, RPC_HEADER_LEN};
use bytes::Bytes;
use futures_util::future::Either;
use futures_util::lock::{Mutex as AsyncMutex, MutexGuard as AsyncMutexGuard};
use slab::Slab;
use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::ReusableBoxFuture;
use transport_core::{
    BufferPool, Connection, HeaderBytes, Message, MessageReceiver, MessageSender, Metrics,
    SendBuffer, TransportError, TryRecv,
};

mod inbox;
mod pending;
mod write;
use inbox::*;
use pending::*;

/// Client settings.
///
/// ```
/// use std::time::Duration;
/// use transport_rpc::ClientConfig;
///
/// let config = ClientConfig::default()
///     .with_max_in_flight(64)
///     .with_default_deadline(Some(Duration::from_secs(5)));
/// assert_eq!(config.max_in_flight, 64);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClientConfig {
    /// Most calls in flight at once on the connection; further calls wait for a slot.
    pub max_in_flight: usize,
    /// Deadline for calls that do not set one (`None`: wait as long as the connection lives).
    pub default_deadline: Option<Duration>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            max_in_flight: 4096,
            default_deadline: None,
        }
    }
}

impl ClientConfig {
    /// These settings with another [`ClientConfig::max_in_flight`].
    pub fn with_max_in_flight(mut self, max_in_flight: usize) -> ClientConfig {
        self.max_in_flight = max_in_flight;
        self
    }

    /// These settings with another [`ClientConfig::default_deadline`].
    pub fn with_default_deadline(mut self, deadline: Option<Duration>) -> ClientConfig {
        self.default_deadline = deadline;
        self
    }
}

/// Per-call options.
#[derive(Debug, Clone, Copy, Default)]
pub struct CallOptions {
    /// Give up after this long (covers waiting for a slot, sending and the response).
    pub deadline: Option<Duration>,
}

impl CallOptions {
    /// Options with a deadline.
    pub fn deadline(d: Duration) -> CallOptions {
        CallOptions { deadline: Some(d) }
    }
}

/// The receiving half taken out of [`State`] by the task reading it; put back (and the next
/// task that waits for it woken) when dropped, also when the reading future is cancelled.
struct Reading<'a, S> {
    shared: &'a Shared<S>,
    inbox: Option<Box<dyn DynReceiver>>,
}

impl<S> Reading<'_, S> {
    fn rx(&mut self) -> &mut dyn DynReceiver {
        &mut **self.inbox.as_mut().expect("held until dropped")
    }
}

impl<S> Drop for Reading<'_, S> {
    fn drop(&mut self) {
        // Put back already by a reader that took its reply in the same look at the state.
        let Some(inbox) = self.inbox.take() else {
            return;
        };
        let wake = {
            let mut st = self.shared.state();
            st.inbox = Some(inbox);
            st.pass_inbox()
        };
        wake_all(wake);
    }
}

/// Counts a call among those waiting for a slot ([`State::slot_waiters`]) until it has one
/// or goes away.
struct SlotWait<'a, S> {
    shared: &'a Shared<S>,
}

impl<'a, S> SlotWait<'a, S> {
    fn new(shared: &'a Shared<S>) -> SlotWait<'a, S> {
        shared.state().slot_waiters += 1;
        SlotWait { shared }
    }
}

impl<S> Drop for SlotWait<'_, S> {
    fn drop(&mut self) {
        let mut st = self.shared.state();
        st.slot_waiters -= 1;
        // Slots went free while this call waited, and it goes away without one (its
        // connection ended, its deadline passed): the next waiting call looks instead.
        if st.slot_waiters > 0 && st.pending.len() < self.shared.max_in_flight() {
            drop(st);
            self.shared.slot_freed.notify_one();
        }
    }
}

/// What a waiting call found when it looked at its entry.
enum Step {
    /// Another task read its reply and put it in its entry.
    Answered(Reply),
    /// It found its own reply at the receiving half, in the same look: the entry is out and
    /// the receiving half back, with the wakers of whoever waits for it next.
    Mine(Reply, (Option<Waker>, Option<Waker>)),
    /// Its entry is gone: the client is going away without an answer.
    Gone,
    /// It took the receiving half: it reads, starting with what the look found there, if
    /// anything.
    Read(Box<dyn DynReceiver>, Option<Found>),
}

/// Messages waiting to be written, in call order.
struct Outbox {
    queue: Vec<Message>,
    /// Messages ever given a ticket (queued, or written at once by [`Shared::send`]); a
    /// message's ticket is this count right after it got one.
    queued: u64,
}

/// The sending half, taken by one caller at a time (see [`Shared::write_through`]).
///
/// A write the transport could not finish at once stays here, not in the future of the call
/// that started it, so that it survives that call being dropped: whoever holds the writer
/// next drives it to the end ([`Shared::finish_write`]). Senders are cancel safe, which is all
/// that takes: what a dropped `send_batch` left half-written goes out with the next `flush`,
/// and the messages it did not take are still in its vector.
struct Writer<S> {
    sender: S,
    /// The ticket of the last message of a write that has not finished; its messages not
    /// yet taken by the transport are in `batch`.
    unfinished: Option<u64>,
    /// The batch being written; between writes an empty vector kept for its capacity (the
    /// next batch swaps it for the queue, so queuing and writing allocate nothing per call).
    batch: Vec<Message>,
}

/// What one read of the receiving half gave.
enum Read {
    /// The answer to a call (or a late one, to a call that is gone: dropped).
    Reply(u64, Reply),
    /// The connection is done for: every pending call has been failed.
    Ended,
}

struct Shared<S> {
    /// Taken by one writer at a time (an async lock whose release with nobody waiting is one
    /// atomic operation).
    writer: AsyncMutex<Writer<S>>,
    outbox: Mutex<Outbox>,
    /// Every message with a ticket up to this one has been taken by the transport.
    written: AtomicU64,
    state: Mutex<State>,
    /// Woken (one at a time) when an entry of `pending` is removed while calls wait for a
    /// slot, and (all) when the connection fails.
    slot_freed: Notify,
    /// Woken when `pending` empties while `close` waits.
    idle: Notify,
    /// Set by `close`: later calls fail before they wait for a slot.
    closing: std::sync::atomic::AtomicBool,
    metrics: Arc<Metrics>,
    pool: Arc<dyn BufferPool>,
    max_message_size: usize,
    config: ClientConfig,
}

impl<S> Shared<S> {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A poisoned lock only means a panic elsewhere while holding it; the map stays valid.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn outbox(&self) -> std::sync::MutexGuard<'_, Outbox> {
        self.outbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Enters a new call in the table if a slot is free ([`Shared::enter`]); `None` when the
    /// call must wait for one ([`Shared::register_when_free`]). With the call's id comes
    /// whether other calls are in flight (for [`Shared::send`]).
    fn try_register(&self) -> Option<Result<(u64, bool), RpcError>> {
        let mut st = self.state();
        self.enter(&mut st, false)
    }

    /// A new call's entry if a slot is free for it, `None` if not; the connection's error
    /// once it has ended. A call that has not waited yet leaves the free slots to those that
    /// do (`queued` false): slots go to calls in the order they came.
    fn enter(&self, st: &mut State, queued: bool) -> Option<Result<(u64, bool), RpcError>> {
        if let Some(e) = &st.closed {
            return Some(Err(e.clone()));
        }
        if st.pending.len() >= self.max_in_flight() || (!queued && st.slot_waiters > 0) {
            return None;
        }
        let id = st.pending.insert();
        self.metrics.in_flight.enter();
        Some(Ok((id, st.pending.len() > 1)))
    }

    /// Calls in flight at most.
    fn max_in_flight(&self) -> usize {
        self.config.max_in_flight.clamp(1, MAX_IN_FLIGHT)
    }

    /// Waits for a slot: each entry removed while calls wait wakes the one that has waited
    /// longest ([`State::remove`]); the connection's end wakes them all.
    async fn register_when_free(&self) -> Result<(u64, bool), RpcError> {
        let _counted = SlotWait::new(self);
        loop {
            let mut freed = std::pin::pin!(self.slot_freed.notified());
            {
                let mut st = self.state();
                if let Some(entered) = self.enter(&mut st, true) {
                    return entered;
                }
                // Registered before the lock is released: no removal can be missed.
                freed.as_mut().enable();
            }
            freed.await;
        }
    }

    /// Wakes whoever an entry's removal concerns (see [`State::remove`]).
    fn wake_freed(&self, freed: Freed) {
        if freed.slot {
            self.slot_freed.notify_one();
        }
        if freed.idle {
            self.idle.notify_waiters();
        }
    }

    /// Removes a call that is going away; true if it had no answer yet. If it had been woken
    /// to take the receiving half, the next waiting call is woken instead.
    fn forget(&self, id: u64) -> bool {
        let mut freed = Freed::default();
        let (unanswered, wake) = {
            let mut st = self.state();
            let unanswered = st.remove(id, &mut freed).is_some_and(|w| w.reply.is_none());
            st.orphaned |= unanswered;
            (unanswered, st.pass_inbox())
        };
        if unanswered {
            self.metrics.in_flight.exit();
        }
        wake_all(wake);
        self.wake_freed(freed);
        unanswered
    }

    /// Hands a reply read on one task over to the call waiting for it on another.
    fn complete(&self, id: u64, reply: Reply) {
        let waker = {
            let mut st = self.state();
            match st.pending.get_mut(id) {
                Some(w) if w.reply.is_none() => {
                    w.reply = Some(reply);
                    w.waker.take()
                }
                // Unknown id: a call that timed out or was cancelled; its late answer is
                // dropped.
                _ => return,
            }
        };
        self.metrics.in_flight.exit();
        self.metrics.handoffs.incr();
        if let Some(w) = waker {
            w.wake();
        }
    }

    fn fail_all(&self, err: RpcError) {
        let mut wakers = Vec::new();
        {
            let mut st = self.state();
            if st.closed.is_none() {
                st.closed = Some(err.clone());
            }
            for w in st.pending.values_mut() {
                if w.reply.is_none() {
                    w.reply = Some(Err(err.clone()));
                    self.metrics.in_flight.exit();
                    wakers.extend(w.waker.take());
                }
            }
            st.want_inbox.clear();
            wakers.extend(st.writer_waker.take());
        }
        for w in wakers {
            w.wake();
        }
        // Calls waiting for a slot look again and find the connection's error.
        self.slot_freed.notify_waiters();
    }

    /// Reads one message: a reply, or the end of the connection (every pending call failed).
    /// Cancel safe: the receiver's `recv` is, and nothing after it awaits.
    async fn read_one(&self, rx: &mut dyn DynReceiver) -> Read {
        let got = std::future::poll_fn(|cx| rx.poll_recv(cx)).await;
        self.on_read(got)
    }

    /// What a read of the receiving half gave, as [`Shared::read_one`] returns it (the end or
    /// an error fails every pending call).
    fn on_read(&self, got: Result<Option<Message>, TransportError>) -> Read {
        let err = match got {
            Ok(Some(msg)) => return self.on_decoded(decode_reply(msg)),
            Ok(None) => RpcError::ConnectionClosed,
            Err(TransportError::MessageTooLarge { len, max, header }) => {
                match RpcHeader::decode(header.as_slice()) {
                    Ok(h) => {
                        return Read::Reply(
                            h.request_id,
                            Err(RpcError::ResponseTooLarge { len, max }),
                        )
                    }
                    Err(e) => RpcError::from(e),
                }
            }
            Err(e) => RpcError::from(e),
        };
        self.ended(err)
    }

    /// [`Shared::on_read`] of a message, once decoded.
    fn on_decoded(&self, decoded: Result<(u64, Reply), RpcError>) -> Read {
        match decoded {
            Ok((id, reply)) => Read::Reply(id, reply),
            Err(e) => self.ended(e),
        }
    }

    /// The connection is done for: every pending call fails with `err`.
    fn ended(&self, err: RpcError) -> Read {
        tracing::debug!(error = %err, "rpc client connection ended");
        self.fail_all(err);
        Read::Ended
    }

    /// Waits for the reply to call `id`: takes the receiving half and reads on this task, so
    /// a lone call's reply wakes its caller directly (no hop through a reader task); replies
    /// to other calls read meanwhile are handed over to them. While another task reads, waits
    /// for it to hand the reply over, or to leave the receiver to this call. `None` when the
    /// client is going away without an answer.
    async fn wait_reply(&self, id: u64) -> Option<Reply> {
        loop {
            let mut freed = Freed::default();
            let step = std::future::poll_fn(|cx| {
                let mut guard = self.state();
                let st = &mut *guard;
                let Some(w) = st.pending.get_mut(id) else {
                    return Poll::Ready(Step::Gone);
                };
                if w.reply.is_some() {
                    let w = st.remove(id, &mut freed).expect("looked up above");
                    return Poll::Ready(Step::Answered(w.reply.expect("checked above")));
                }
                if let Some(mut inbox) = st.inbox.take() {
                    // The receiving half is free: what it has at once is read under this
                    // lock, so a call that finds its own reply there (a lone call, a ping)
                    // takes it, leaves its entry and puts the receiving half back in one look.
                    return Poll::Ready(match inbox.try_now() {
                        Some(Found::Decoded(Ok((rid, reply)))) if rid == id => {
                            st.remove(id, &mut freed);
                            st.inbox = Some(inbox);
                            Step::Mine(reply, st.pass_inbox())
                        }
                        found => Step::Read(inbox, found),
                    });
                }
                match &w.waker {
                    Some(waker) if waker.will_wake(cx.waker()) => {}
                    _ => w.waker = Some(cx.waker().clone()),
                }
                if !w.wants_inbox {
                    w.wants_inbox = true;
                    st.want_inbox.push_back(id);
                }
                Poll::Pending
            })
            .await;
            let (inbox, mut found) = match step {
                Step::Answered(reply) => {
                    self.wake_freed(freed);
                    return Some(reply);
                }
                Step::Mine(reply, wake) => {
                    self.metrics.in_flight.exit();
                    wake_all(wake);
                    self.wake_freed(freed);
                    return Some(reply);
                }
                Step::Gone => return None,
                Step::Read(inbox, found) => (inbox, found),
            };
            let mut reading = Reading {
                shared: self,
                inbox: Some(inbox),
            };
            loop {
                let read = match found.take() {
                    Some(Found::Decoded(decoded)) => self.on_decoded(decoded),
                    Some(Found::Other(got)) => self.on_read(*got),
                    None => {
                        // Polled here rather than through `read_one`: one future less on
                        // every call.
                        let got = std::future::poll_fn(|cx| reading.rx().poll_recv(cx)).await;
                        self.on_read(got)
                    }
                };
                match read {
                    Read::Reply(rid, reply) if rid == id => {
                        // One look at the state: the entry out, the receiving half back.
                        let (mine, wake) = {
                            let mut st = self.state();
                            let mine = st.remove(id, &mut freed);
                            st.inbox = reading.inbox.take();
                            (mine, st.pass_inbox())
                        };
                        wake_all(wake);
                        self.wake_freed(freed);
                        return match mine {
                            Some(Waiting { reply: None, .. }) => {
                                self.metrics.in_flight.exit();
                                Some(reply)
                            }
                            // Answered already (the connection's error): that answer stands.
                            Some(Waiting { reply: answer, .. }) => answer,
                            None => None,
                        };
                    }
                    Read::Reply(rid, reply) => self.complete(rid, reply),
                    // `fail_all` has answered this call with the connection's error: the
                    // next look at its entry finds it.
                    Read::Ended => break,
                }
            }
        }
    }

    /// Awaits `fut` (a write), reading replies meanwhile while no one else reads them: a peer
    /// that stops reading requests until its replies are taken must not stall the write.
    async fn read_while<F: Future + Unpin>(&self, fut: &mut F) -> F::Output {
        let take = std::future::poll_fn(|cx| {
            let mut st = self.state();
            match st.inbox.take() {
                Some(inbox) => Poll::Ready(inbox),
                None => {
                    st.writer_waker = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        });
        let inbox = tokio::select! {
            biased;
            out = &mut *fut => return out,
            inbox = take => inbox,
        };
        let mut reading = Reading {
            shared: self,
            inbox: Some(inbox),
        };
        loop {
            let read = tokio::select! {
                biased;
                out = &mut *fut => return out,
                r = self.read_one(reading.rx()) => r,
            };
            match read {
                Read::Reply(id, reply) => self.complete(id, reply),
                Read::Ended => {
                    drop(reading);
                    return fut.await;
                }
            }
        }
    }
}

/// An RPC client over one connection. Cheap to clone; clones share the connection and may call
/// concurrently (that is how requests are pipelined).
///
/// ```no_run
/// # async fn demo<C: transport_core::Connection>(conn: C) -> Result<(), transport_rpc::RpcError> {
/// use bytes::Bytes;
/// use std::time::Duration;
/// use transport_rpc::{CallOptions, ClientConfig, RpcClient};
///
/// let client = RpcClient::new(conn, ClientConfig::default());
/// let reply = client.call(7, Bytes::from_static(b"ping")).await?;
/// client.oneway(8, Bytes::from_static(b"log line")).await?;
/// let quick = client
///     .call_with(7, Bytes::new(), CallOptions::deadline(Duration::from_millis(100)))
///     .await;
/// # Ok(()) }
/// ```
///
/// Requests of concurrent calls coalesce: calls made while an earlier request is still being
/// written queue behind it and go out together in the next write (one vectored write on the
/// socket backends), and while other calls are in flight the writer first lets the current
/// turn of the runtime finish, so calls started together leave together. No writer task, and
/// a lone call (nothing else in flight) is written at once.
///
/// Replies are read by the calls that wait for them (leader/followers, as in classic ORBs),
/// not by a reader task: a waiting call takes the receiving half and reads on its own task;
/// replies to other calls that it reads are handed over to them (counted in
/// [`Metrics::handoffs`]), and once it has its own it leaves the receiver to the next waiting
/// call. A lone call (a ping loop) thus reads its reply itself: the reply wakes the caller
/// directly, with no hop through another task. The calls in flight, their replies and the
/// receiving half sit under one plain lock: a waiting call leaves its waker in its entry, the
/// reader puts a reply there and wakes it, and the reader that leaves wakes the oldest waiting
/// call to read next (no channel per call and no async lock around the receiver, which cost
/// the client hundreds of instructions per call; docs/notes/2026-12-03-bench-gap-at-64-256k.md).
/// A write the peer does not drain reads replies meanwhile, so a peer that waits for its
/// replies to be taken cannot stall it; when no reply can come (no call in flight, none gone
/// unanswered: a stream of oneway calls) it waits for the write alone. With no call waiting
/// nothing reads: a connection that died while idle fails the next call (its write or its
/// read).
///
/// When the connection dies, every pending call fails with [`RpcError::ConnectionClosed`] or
/// [`RpcError::ConnectionLost`], and so does every later call. Calls run on a tokio runtime
/// (a cancelled call's cancel is sent from a spawned task).
pub struct RpcClient<S: MessageSender> {
    shared: Arc<Shared<S>>,
}

impl<S: MessageSender> Clone for RpcClient<S> {
    fn clone(&self) -> Self {
        RpcClient {
            shared: self.shared.clone(),
        }
    }
}

impl<S: MessageSender> RpcClient<S> {
    /// Starts a client on a connection.
    pub fn new<C>(conn: C, config: ClientConfig) -> RpcClient<S>
    where
        C: Connection<Sender = S>,
    {
        let metrics = conn.metrics();
        let (sender, receiver) = conn.split();
        let shared = Arc::new(Shared {
            max_message_size: sender.max_message_size(),
            pool: sender.buffer_pool(),
            writer: AsyncMutex::new(Writer {
                sender,
                unfinished: None,
                batch: Vec::new(),
            }),
            outbox: Mutex::new(Outbox {
                queue: Vec::new(),
                queued: 0,
            }),
            written: AtomicU64::new(0),
            state: Mutex::new(State {
                pending: Pending::default(),
                closed: None,
                inbox: Some(Box::new(Inbox::new(receiver))),
                want_inbox: VecDeque::new(),
                writer_waker: None,
                orphaned: false,
                slot_waiters: 0,
                close_waits: false,
            }),
            slot_freed: Notify::new(),
            idle: Notify::new(),
            closing: std::sync::atomic::AtomicBool::new(false),
            metrics,
            config,
        });
        RpcClient { shared }
    }

    /// Calls `method` and waits for its response (with the default deadline, if configured).
    ///
    /// Dropping the returned future cancels the call: the server is sent a cancel.
    pub fn call(
        &self,
        method: u32,
        payload: Bytes,
    ) -> impl Future<Output = Result<Bytes, RpcError>> + '_ {
        self.call_with(method, payload, CallOptions::default())
    }

    /// Calls `method` with per-call options.
    ///
    /// Dropping the returned future cancels the call: the server is sent a cancel.
    pub fn call_with(
        &self,
        method: u32,
        payload: Bytes,
        opts: CallOptions,
    ) -> impl Future<Output = Result<Bytes, RpcError>> + '_ {
        // Not an `async fn`: a call without a deadline is the call itself, with no future
        // around it (each layer costs every call its own turn of polling and moving).
        match opts.deadline.or(self.shared.config.default_deadline) {
            None => Either::Left(self.call_inner(method, payload)),
            Some(d) => Either::Right(within(d, self.call_inner(method, payload))),
        }
    }

    async fn call_inner(&self, method: u32, payload: Bytes) -> Result<Bytes, RpcError> {
        self.check_size(payload.len())?;
        if self.shared.closing.load(Ordering::Relaxed) {
            return Err(RpcError::ClientClosed);
        }
        // The call's entry in the table is its slot (at most `max_in_flight`), until its
        // reply is taken or it goes away.
        // A free slot is taken at once; the wait for one is a future of its own.
        let (id, others) = match self.shared.try_register() {
            Some(entered) => entered?,
            None => self.shared.register_when_free().await?,
        };
        let guard = PendingCall {
            shared: &self.shared,
            id,
            method,
        };
        let header = RpcHeader::new(Kind::Request, method, id, payload.len());
        let shared = &self.shared;
        // `Shared::send`, its first step taken here (see `Shared::start_send`).
        let mut msg = Some(Message::new(HeaderBytes::from(header.encode()), payload));
        let started =
            std::future::poll_fn(|cx| Poll::Ready(shared.start_send(&mut msg, Some(others), cx)))
                .await?;
        if let Some((ticket, writer)) = started {
            shared.write_through(ticket, writer).await?;
        }
        let reply = self.shared.wait_reply(id).await;
        // The call has ended: nothing to forget or cancel (and no drop to run).
        std::mem::forget(guard);
        match reply {
            Some(r) => r,
            // The call was dropped from the table without an answer: the client is going away.
            None => Err(self.closed_error()),
        }
    }

    /// Sends a oneway call: no response, no error from the handler. Returns once the transport
    /// has taken the message.
    pub async fn oneway(&self, method: u32, payload: Bytes) -> Result<(), RpcError> {
        self.check_size(payload.len())?;
        // A connection that has ended fails the call in `Shared::start_send`.
        let header = RpcHeader::new(Kind::Oneway, method, 0, payload.len());
        let msg = Message::new(HeaderBytes::from(header.encode()), payload);
        self.shared.send(msg, None).await
    }

    /// A payload buffer from the connection's pool (registered memory on verbs: no copy).
    pub fn alloc(&self, capacity: usize) -> SendBuffer {
        self.shared.pool.alloc(capacity)
    }

    /// The connection's counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.shared.metrics
    }

    /// Calls in flight now.
    pub fn in_flight(&self) -> usize {
        let st = self.shared.state();
        st.pending.values().filter(|w| w.reply.is_none()).count()
    }

    /// Largest request payload this client can send.
    pub fn max_payload(&self) -> usize {
        self.shared.max_message_size.saturating_sub(RPC_HEADER_LEN)
    }

    /// Closes the client: new calls fail with [`RpcError::ClientClosed`] at once; calls in
    /// flight finish first (answered, failed, past their deadline or dropped), then the
    /// sending direction is closed. A server cancels whatever still runs for a connection its
    /// peer closed (`ServerConfig::cancel_on_close`), so closing does not cut calls short.
    /// Give calls deadlines (or wrap `close` in a timeout) if the server may never answer.
    pub async fn close(&self) -> Result<(), RpcError> {
        {
            let mut st = self.shared.state();
            if st.closed.is_none() {
                st.closed = Some(RpcError::ClientClosed);
            }
        }
        self.shared.closing.store(true, Ordering::Relaxed);
        // Calls waiting for a slot fail now (the state is closed).
        self.shared.slot_freed.notify_waiters();
        // Every call keeps its entry until it ends: an empty table means no call in flight
        // (on a connection that failed, calls take their error and go).
        loop {
            let mut idle = std::pin::pin!(self.shared.idle.notified());
            {
                let mut st = self.shared.state();
                if st.pending.is_empty() {
                    break;
                }
                st.close_waits = true;
                idle.as_mut().enable();
            }
            idle.await;
        }
        let mut writer = self.shared.writer.lock().await;
        self.shared.finish_write(&mut writer).await;
        writer.sender.close().await.map_err(RpcError::from)
    }

    fn check_size(&self, payload_len: usize) -> Result<(), RpcError> {
        let len = RPC_HEADER_LEN + payload_len;
        if len > self.shared.max_message_size || payload_len > u32::MAX as usize {
            return Err(RpcError::RequestTooLarge {
                len: len as u64,
                max: self.shared.max_message_size as u64,
            });
        }
        Ok(())
    }

    fn closed_error(&self) -> RpcError {
        self.shared
            .state()
            .closed
            .clone()
            .unwrap_or(RpcError::ClientClosed)
    }
}

/// `call` bounded by deadline `d`.
async fn within(
    d: Duration,
    call: impl Future<Output = Result<Bytes, RpcError>>,
) -> Result<Bytes, RpcError> {
    match tokio::time::timeout(d, call).await {
        Ok(r) => r,
        Err(_) => Err(RpcError::DeadlineExceeded(d)),
    }
}

/// A call waiting for its response. If the call future is dropped (deadline or cancellation)
/// before the call ends, the call is forgotten and the server is sent a cancel. A call that
/// ends `mem::forget`s it (it holds a reference and numbers only: nothing leaks).
struct PendingCall<'a, S: MessageSender> {
    shared: &'a Arc<Shared<S>>,
    id: u64,
    method: u32,
}

impl<S: MessageSender> Drop for PendingCall<'_, S> {
    fn drop(&mut self) {
        if !self.shared.forget(self.id) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let shared = self.shared.clone();
        let header = RpcHeader::new(Kind::Cancel, self.method, self.id, 0);
        rt.spawn(async move {
            // Best effort: a failure here shows up on the next call or in the reader.
            let _ = shared
                .send(
                    Message::new(HeaderBytes::from(header.encode()), Bytes::new()),
                    None,
                )
                .await;
        });
    }
}

#[cfg(test)]
mod tests;
