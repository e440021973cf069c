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

type Reply = Result<Bytes, RpcError>;

/// A call waiting for its reply.
struct Waiting {
    /// Its request id (see [`Pending`]).
    id: u64,
    /// Its reply, once read (or the connection's error).
    reply: Option<Reply>,
    /// Woken when the reply is put here, or when the receiving half is free for it to read.
    waker: Option<Waker>,
    /// Queued in [`State::want_inbox`].
    wants_inbox: bool,
}

/// The calls in flight, by request id: a slab whose slot index is the id's low 32 bits and
/// whose high 32 bits are a generation that changes with every call (never 0, so no call has
/// id 0, the id of oneway calls). A reply to a call that went away finds its slot empty or
/// taken by a later call under another generation: it is dropped. Entering and removing a
/// call costs a few instructions, not a hash table's probe.
#[derive(Default)]
struct Pending {
    calls: Slab<Waiting>,
    generation: u32,
}

impl Pending {
    /// Enters a new call; its id.
    fn insert(&mut self) -> u64 {
        self.generation = self.generation.wrapping_add(1).max(1);
        let entry = self.calls.vacant_entry();
        // Below 2^32: the table holds at most `MAX_IN_FLIGHT` calls.
        let id = u64::from(self.generation) << 32 | entry.key() as u64;
        entry.insert(Waiting {
            id,
            reply: None,
            waker: None,
            wants_inbox: false,
        });
        id
    }

    fn slot(id: u64) -> usize {
        (id & 0xffff_ffff) as usize
    }

    fn get_mut(&mut self, id: u64) -> Option<&mut Waiting> {
        self.calls.get_mut(Self::slot(id)).filter(|w| w.id == id)
    }

    fn remove(&mut self, id: u64) -> Option<Waiting> {
        let slot = Self::slot(id);
        if self.calls.get(slot)?.id != id {
            return None;
        }
        Some(self.calls.remove(slot))
    }

    fn len(&self) -> usize {
        self.calls.len()
    }

    fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    fn values(&self) -> impl Iterator<Item = &Waiting> {
        self.calls.iter().map(|(_, w)| w)
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut Waiting> {
        self.calls.iter_mut().map(|(_, w)| w)
    }
}

/// The most calls a client keeps in flight, whatever [`ClientConfig::max_in_flight`] says:
/// a call's slot index must fit in the low half of its id.
const MAX_IN_FLIGHT: usize = 1 << 31;

/// The calls in flight and the receiving half, under one lock (no channel per call, no
/// async lock for the receiver: a call that waits registers its waker in its entry).
struct State {
    pending: Pending,
    /// Set once the connection is gone: every later call fails with it.
    closed: Option<RpcError>,
    /// The receiving half while nobody reads it; taken by the call (or the blocked write)
    /// that reads, and put back when it stops ([`Reading`]).
    inbox: Option<Box<dyn DynReceiver>>,
    /// Calls without a reply that wait for the receiving half, oldest first (entries of calls
    /// that ended or got their reply since are skipped).
    want_inbox: VecDeque<u64>,
    /// A write the peer does not drain waits here to read replies meanwhile.
    writer_waker: Option<Waker>,
    /// A call went away before its answer was read: an answer may still come for it, which
    /// no entry of `pending` tells (see [`State::owes_nothing`]).
    orphaned: bool,
    /// Calls waiting for a slot (`pending` is full: [`ClientConfig::max_in_flight`]); each
    /// entry removed then wakes one of them ([`Shared::slot_freed`]).
    slot_waiters: usize,
    /// `close` waits for `pending` to empty ([`Shared::idle`]).
    close_waits: bool,
}

impl State {
    /// Whether no answer can be on its way: no call waits for one and none went away before
    /// its own arrived. A blocked write then has nothing to read meanwhile (a request that
    /// starts now is written only after it).
    fn owes_nothing(&self) -> bool {
        self.pending.is_empty() && !self.orphaned
    }

    /// When the receiving half is free and calls wait for it, the wakers that should come
    /// and take it: the oldest waiting call, and the blocked write if there is one.
    fn pass_inbox(&mut self) -> (Option<Waker>, Option<Waker>) {
        if self.inbox.is_none() {
            return (None, None);
        }
        let mut call = None;
        while let Some(id) = self.want_inbox.pop_front() {
            if let Some(w) = self.pending.get_mut(id) {
                w.wants_inbox = false;
                if w.reply.is_none() {
                    if let Some(waker) = w.waker.take() {
                        call = Some(waker);
                        break;
                    }
                }
            }
        }
        (call, self.writer_waker.take())
    }

    /// Removes call `id`'s entry, noting who must be woken for the slot it frees.
    fn remove(&mut self, id: u64, freed: &mut Freed) -> Option<Waiting> {
        let w = self.pending.remove(id)?;
        freed.slot |= self.slot_waiters > 0;
        freed.idle |= self.close_waits && self.pending.is_empty();
        Some(w)
    }
}

/// Who to wake once an entry has left `pending` (after the lock is released): a call waiting
/// for a slot, and `close` once none is left.
#[derive(Default)]
struct Freed {
    slot: bool,
    idle: bool,
}

fn wake_all((a, b): (Option<Waker>, Option<Waker>)) {
    if let Some(w) = a {
        w.wake();
    }
    if let Some(w) = b {
        w.wake();
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

/// What the receiving half had at once ([`DynReceiver::try_now`]).
enum Found {
    /// A message, decoded: a reply's call id and outcome, or why it is no reply.
    Decoded(Result<(u64, Reply), RpcError>),
    /// The end of the connection, or its error (boxed: rare, and it would make every look's
    /// result several times larger).
    Other(Box<Result<Option<Message>, TransportError>>),
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

/// A receiving half that can be read without naming its type (the client is generic over the
/// sender only).
trait DynReceiver: Send {
    /// Polls the read in progress (starting one if none is): cancel safe, the read stays
    /// here for whoever polls next.
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Message>, TransportError>>;

    /// What a read would return at once (a message decoded as a reply), when no read is in
    /// progress and the transport can tell without one ([`MessageReceiver::try_recv`]);
    /// `None` otherwise.
    fn try_now(&mut self) -> Option<Found>;
}

/// What one read of an [`Inbox`] gives: the message (or the end, or the error) and the
/// receiver back.
type Received<R> = (Result<Option<Message>, TransportError>, Box<R>);

/// The receiving half and its read: the read owns the (boxed) receiver while it runs and
/// hands it back with what it read, and the next read takes the same allocation. So a read
/// costs no allocation, and a read in progress lives here, not in the future of the call
/// that polled it (a call dropped mid-read leaves it to the next reader).
///
/// Between reads the receiver is `idle`, and a read first asks it for what it has at once
/// ([`MessageReceiver::try_recv`]): a reply that is already there (verbs: in the completion
/// queue) is taken without starting a read future.
struct Inbox<R: MessageReceiver> {
    /// The receiver while no read runs; `read` then holds a finished read (kept for its
    /// allocation) that is not polled again.
    idle: Option<Box<R>>,
    read: ReusableBoxFuture<'static, Received<R>>,
}

impl<R: MessageReceiver> Inbox<R> {
    fn new(rx: R) -> Inbox<R> {
        Inbox {
            idle: Some(Box::new(rx)),
            // A placeholder, never polled: the first read takes its own allocation, and the
            // reads after it reuse that one.
            read: ReusableBoxFuture::new(std::future::pending()),
        }
    }
}

/// One read, owning its receiver (async: it starts only when first polled).
async fn read_owned<R: MessageReceiver>(mut rx: Box<R>) -> Received<R> {
    let got = rx.recv().await;
    (got, rx)
}

impl<R: MessageReceiver> DynReceiver for Inbox<R> {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Message>, TransportError>> {
        if let Some(rx) = self.idle.as_mut() {
            if let TryRecv::Ready(got) = rx.try_recv() {
                return Poll::Ready(got);
            }
            // Nothing there yet (or the transport cannot tell): a read, in the same
            // allocation as the last one.
            let rx = self.idle.take().expect("checked above");
            self.read.set(read_owned(rx));
        }
        let (got, rx) = std::task::ready!(self.read.poll(cx));
        self.idle = Some(rx);
        Poll::Ready(got)
    }

    fn try_now(&mut self) -> Option<Found> {
        match self.idle.as_mut()?.try_recv() {
            // Decoded here, where the receiver's type is known: the message is not moved
            // through the trait object.
            TryRecv::Ready(Ok(Some(msg))) => Some(Found::Decoded(decode_reply(msg))),
            TryRecv::Ready(other) => Some(Found::Other(Box::new(other))),
            TryRecv::Empty | TryRecv::Unknown => None,
        }
    }
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

/// A reply's call id and outcome; an error when the message is no reply.
fn decode_reply(msg: Message) -> Result<(u64, Reply), RpcError> {
    let h = RpcHeader::decode(msg.header.as_slice())?;
    h.check_payload(msg.payload.len())?;
    match h.kind {
        Kind::Response => Ok((h.request_id, Ok(msg.payload))),
        Kind::Error => Ok((
            h.request_id,
            Err(RpcError::Remote(Status::decode(&msg.payload))),
        )),
        other => Err(ProtocolError::UnexpectedKind {
            from: "server",
            kind: other,
        }
        .into()),
    }
}

impl<S: MessageSender> Shared<S> {
    /// Sends one message: queues it, then writes it, together with whatever other calls
    /// queued meanwhile, unless an earlier writer already took it.
    ///
    /// Calls coalesce: while one batch is being written (on a stream, while the socket is
    /// full), the calls behind it queue their messages and the next writer sends them all in
    /// one `send_batch` (one vectored write). Requests then leave back to back, with one
    /// system call per batch instead of per call, and the server sees no gap between them.
    /// When other calls are in flight, a writer also yields to the runtime once before it
    /// writes, so that calls started in the same turn join its batch. Each caller still
    /// returns only once the transport has taken its own message.
    ///
    /// Dropping the future: a message not yet taken may still be sent by a later writer; a
    /// write already started is finished (by the next writer, or by a task spawned for it),
    /// so the connection never stalls on half a message.
    ///
    /// `others`: whether other calls are in flight, when the caller knows (`None`: looked up).
    async fn send(self: &Arc<Self>, msg: Message, others: Option<bool>) -> Result<(), RpcError> {
        let mut msg = Some(msg);
        let started =
            std::future::poll_fn(|cx| Poll::Ready(self.start_send(&mut msg, others, cx))).await?;
        match started {
            None => Ok(()),
            Some((ticket, writer)) => self.write_through(ticket, writer).await,
        }
    }

    /// [`Shared::send`]'s first step, within the caller's poll: writes `msg` (taken out of
    /// the option) at once if nobody is writing and no other call is in flight (a ping loop,
    /// a stream of oneway calls: see `write_alone`), else queues it. `None` once the
    /// transport has taken it; else its ticket and the writer if this caller holds it, for
    /// [`Shared::write_through`]. The callers on the hot path (a call, a oneway) take this
    /// step themselves, so that a write that goes through at once costs no future of its own.
    #[allow(clippy::type_complexity)]
    fn start_send(
        &self,
        msg: &mut Option<Message>,
        others: Option<bool>,
        cx: &mut Context<'_>,
    ) -> Result<Option<(u64, Option<AsyncMutexGuard<'_, Writer<S>>>)>, RpcError> {
        match self.writer.try_lock() {
            Some(mut w)
                if w.unfinished.is_none()
                    && !others.map_or_else(|| self.others_in_flight(), Ok)? =>
            {
                Ok(self
                    .write_alone(&mut w, msg, cx)?
                    .map(|ticket| (ticket, Some(w))))
            }
            w => {
                let Some(m) = msg.take() else {
                    return Err(RpcError::ClientClosed);
                };
                let mut outbox = self.outbox();
                outbox.queue.push(m);
                outbox.queued += 1;
                Ok(Some((outbox.queued, w)))
            }
        }
    }

    /// Whether calls other than the caller's own are in flight; the connection's error once
    /// it has ended (one look at the state for both).
    fn others_in_flight(&self) -> Result<bool, RpcError> {
        let st = self.state();
        match &st.closed {
            Some(e) => Err(e.clone()),
            None => Ok(st.pending.len() > 1),
        }
    }

    /// Writes `msg` (taken out of the option) while holding the writer with nothing
    /// unfinished: if no message is queued either, it takes the next ticket and goes straight
    /// to the transport, tried once within the caller's poll (one lock of the outbox, no trip
    /// through the queue, nothing of it kept in the caller's future); a write that cannot
    /// finish at once is left unfinished in the writer, as in [`Shared::write_through`].
    /// Otherwise it joins the queue behind the messages already there. `None` once the
    /// transport took it, else its ticket, for [`Shared::write_through`] to finish with the
    /// writer.
    fn write_alone(
        &self,
        writer: &mut Writer<S>,
        msg: &mut Option<Message>,
        cx: &mut Context<'_>,
    ) -> Result<Option<u64>, RpcError> {
        let Some(m) = msg.take() else {
            return Err(RpcError::ClientClosed);
        };
        let upto = {
            let mut outbox = self.outbox();
            outbox.queued += 1;
            if !outbox.queue.is_empty() {
                outbox.queue.push(m);
                return Ok(Some(outbox.queued));
            }
            outbox.queued
        };
        writer.batch.push(m);
        match self.write_once(writer, upto, cx) {
            Poll::Ready(Err(e)) => Err(e),
            Poll::Ready(Ok(())) => Ok(None),
            Poll::Pending => Ok(Some(upto)),
        }
    }

    /// One try at writing the writer's batch, whose last message has ticket `upto`, within
    /// the caller's poll (most writes go through at once: the socket has room, the send queue
    /// has slots). A write that has to wait is left unfinished in the writer: dropping the
    /// pending `send_batch` is allowed (see [`Writer`]). On an error the connection is failed
    /// and its error returned.
    fn write_once(
        &self,
        writer: &mut Writer<S>,
        upto: u64,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), RpcError>> {
        let first = std::pin::pin!(writer.sender.send_batch(&mut writer.batch)).poll(cx);
        let Poll::Ready(result) = first else {
            writer.unfinished = Some(upto);
            return Poll::Pending;
        };
        let failed = result.is_err();
        self.record_write(upto, result);
        writer.batch.clear();
        if failed {
            return Poll::Ready(Err(self.closed_error_or(RpcError::ClientClosed)));
        }
        Poll::Ready(Ok(()))
    }

    /// The error the connection ended with (set by `fail_all`), or `otherwise`.
    fn closed_error_or(&self, otherwise: RpcError) -> RpcError {
        self.state().closed.clone().unwrap_or(otherwise)
    }

    /// Writes until every message up to `ticket` has been taken by the transport, with the
    /// writer if the caller already holds it.
    async fn write_through(
        self: &Arc<Self>,
        ticket: u64,
        writer: Option<AsyncMutexGuard<'_, Writer<S>>>,
    ) -> Result<(), RpcError> {
        let mut writer = match writer {
            Some(w) => w,
            None => match self.writer.try_lock() {
                Some(w) => w,
                None => self.writer.lock().await,
            },
        };
        loop {
            self.finish_write(&mut writer).await;
            if self.written.load(Ordering::Acquire) >= ticket {
                return Ok(());
            }
            let others = {
                let st = self.state();
                if let Some(e) = &st.closed {
                    return Err(e.clone());
                }
                st.pending.len() > 1
            };
            if others {
                // Other calls are in flight: their replies tend to arrive together and the
                // calls they make room for start in the same turn of the runtime. Letting that
                // turn finish first puts their requests in this write (small calls then make
                // several times the calls/s:
                // docs/notes/2026-12-01-bench-rpc-against-raw-first-rounds.md); a lone call (a
                // ping loop) is written at once.
                tokio::task::yield_now().await;
            }
            let upto = {
                let mut outbox = self.outbox();
                std::mem::swap(&mut outbox.queue, &mut writer.batch);
                outbox.queued
            };
            // Tried at once, with no reading alongside; a write that has to wait is finished
            // by `finish_write` at the top of the loop. Its error, if any, has failed every
            // call: the state check above returns it on the next turn.
            let w = &mut *writer;
            let _ = std::future::poll_fn(|cx| Poll::Ready(self.write_once(w, upto, cx))).await;
        }
    }

    /// Records how a write of every message up to ticket `upto` ended.
    fn record_write(&self, upto: u64, result: Result<(), TransportError>) {
        match result {
            Ok(()) => self.written.store(upto, Ordering::Release),
            // Messages were checked against the size limit before they were queued, so an
            // error leaves the batch's fate unknown: the connection is done for.
            Err(e) => self.fail_all(RpcError::from(e)),
        }
    }

    /// Drives an unfinished write to its end (the rest of what the first try left
    /// half-written, then the messages it did not take) and records what became of it.
    async fn finish_write(self: &Arc<Self>, writer: &mut Writer<S>) {
        let Some(upto) = writer.unfinished else {
            return;
        };
        let mut finish = FinishOnDrop {
            shared: self,
            armed: true,
        };
        // Replies are read meanwhile only if one may come: a peer blocked on writing one to
        // us would otherwise not drain this write. Without any (a stream of oneway calls) the
        // write is awaited alone.
        let owes_nothing = self.state().owes_nothing();
        let result = {
            let Writer { sender, batch, .. } = &mut *writer;
            let mut write = std::pin::pin!(async {
                sender.flush().await?;
                sender.send_batch(batch).await
            });
            if owes_nothing {
                write.await
            } else {
                self.read_while(&mut write).await
            }
        };
        finish.armed = false;
        writer.unfinished = None;
        writer.batch.clear();
        self.record_write(upto, result);
    }
}

/// Finishes a started write on a spawned task when the call driving it is dropped, so the
/// connection is not left with half a message (the server would wait for the rest).
struct FinishOnDrop<'a, S: MessageSender> {
    shared: &'a Arc<Shared<S>>,
    armed: bool,
}

impl<S: MessageSender> Drop for FinishOnDrop<'_, S> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let shared = self.shared.clone();
        rt.spawn(async move {
            // Errors reach the calls through the connection state.
            let mut writer = shared.writer.lock().await;
            shared.finish_write(&mut writer).await;
        });
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
