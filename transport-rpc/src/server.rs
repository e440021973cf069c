//! The RPC server: runs a [`Handler`] for every request, many at once per connection.

use super::error::{code, ProtocolError, RpcError, Status};
use super::header::{Kind, RpcHeader, RPC_HEADER_LEN};
use bytes::Bytes;
use futures_util::future::{AbortHandle, Abortable, Aborted, Either};
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::task::AtomicWaker;
use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use transport_core::budget::{Charge, MemoryBudget};
use transport_core::{
    BufferPool, Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender,
    Metrics, SendBuffer, TransportError, TryRecv,
};

/// One incoming call.
pub struct Request {
    /// Method id.
    pub method: u32,
    /// Request id (0 for oneway calls).
    pub request_id: u64,
    /// The request payload.
    pub payload: Bytes,
    /// True for a oneway call: the result is not sent anywhere.
    pub oneway: bool,
    pub(crate) pool: Arc<dyn BufferPool>,
}

impl Request {
    /// A response buffer from the connection's pool (registered memory on verbs: no copy).
    pub fn alloc(&self, capacity: usize) -> SendBuffer {
        self.pool.alloc(capacity)
    }
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("method", &self.method)
            .field("request_id", &self.request_id)
            .field("payload_len", &self.payload.len())
            .field("oneway", &self.oneway)
            .finish()
    }
}

/// Serves calls. Implemented for every `Fn(Request) -> impl Future<Output = Result<Bytes, Status>>`.
///
/// The returned future runs inside the connection's task, concurrently with the connection's
/// other calls; a handler that burns CPU for long should `tokio::spawn` that work.
pub trait Handler: Send + Sync + 'static {
    /// Handles one call.
    fn call(&self, req: Request) -> impl Future<Output = Result<Bytes, Status>> + Send + 'static;
}

impl<F, Fut> Handler for F
where
    F: Fn(Request) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Bytes, Status>> + Send + 'static,
{
    fn call(&self, req: Request) -> impl Future<Output = Result<Bytes, Status>> + Send + 'static {
        self(req)
    }
}

/// Default of [`ServerConfig::max_request_bytes_per_connection`]: 64 MiB.
pub const DEFAULT_REQUEST_BYTES_PER_CONNECTION: usize = 64 << 20;
/// Default of [`ServerConfig::memory_budget`]: 1 GiB.
pub const DEFAULT_SERVER_BUDGET: usize = 1 << 30;

/// Server settings.
///
/// Limits on what peers can make the server hold: calls and request bytes per connection,
/// request bytes over all connections (a shared [`MemoryBudget`]; clones of a config share
/// it). Past a limit the server stops reading the connection until handlers finish: the
/// peer's sends block (back-pressure); nothing is dropped and nothing grows.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ServerConfig {
    /// Most calls run at once per connection; the server stops reading that connection until
    /// one finishes (back-pressure instead of unbounded memory).
    pub max_in_flight_per_connection: usize,
    /// Most request payload bytes held by the running handlers of one connection (default
    /// [`DEFAULT_REQUEST_BYTES_PER_CONNECTION`]). A single larger request still runs when
    /// nothing else does.
    pub max_request_bytes_per_connection: usize,
    /// Request payload bytes held by running handlers over all connections of the server
    /// (default [`DEFAULT_SERVER_BUDGET`]). Bytes a transport holds while receiving are
    /// bounded by its own budget (`StreamConfig::memory_budget` on sockets).
    pub memory_budget: Arc<MemoryBudget>,
    /// Time limit for a handler; past it the call gets [`code::DEADLINE_EXCEEDED`].
    pub handler_timeout: Option<Duration>,
    /// Close a connection that has had no message and no running call for this long
    /// (default [`DEFAULT_IDLE_TIMEOUT`], 180 s, as omniORB's scan of idle incoming
    /// connections; `None` keeps idle connections open for ever). A peer that connects and
    /// never sends a frame holds one of [`ServerConfig::max_connections`] at most this long.
    /// The client of a closed connection gets an error at its next call; the application
    /// makes a new connection.
    pub idle_timeout: Option<Duration>,
    /// Most connections [`RpcServer::serve`] serves at once (default
    /// [`default_max_connections`]: fitted to `RLIMIT_NOFILE`). At the limit it stops
    /// accepting until a connection ends: new connections wait in the listener's queue (the
    /// kernel's backlog on sockets), nothing is refused, and the connections being served
    /// keep being served. Connections handed to [`RpcServer::serve_connection`] directly are
    /// counted in [`RpcServer::connections`] but not held back.
    pub max_connections: usize,
    /// When the peer closes the connection (or it fails), drop its running handlers, which
    /// cancels them and frees the requests they hold (default `true`). With `false` they run
    /// to the end and their replies are written if the peer still reads.
    /// [`RpcClient::close`](super::RpcClient::close) waits for its own calls before closing,
    /// so its calls are answered either way.
    pub cancel_on_close: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_in_flight_per_connection: 4096,
            max_request_bytes_per_connection: DEFAULT_REQUEST_BYTES_PER_CONNECTION,
            memory_budget: MemoryBudget::new(DEFAULT_SERVER_BUDGET),
            handler_timeout: None,
            idle_timeout: Some(DEFAULT_IDLE_TIMEOUT),
            max_connections: default_max_connections(),
            cancel_on_close: true,
        }
    }
}

/// Default of [`ServerConfig::idle_timeout`]: 180 s.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(180);

/// Default of [`ServerConfig::max_connections`]: the soft `RLIMIT_NOFILE` when the config is
/// made, less an eighth of it (at least 64) kept for the rest of the process: 896 with the
/// usual 1024, 917 504 with 1 048 576. A socket connection holds one descriptor; without the
/// limit, a flood of connections takes the last ones and accepts fail for everyone.
pub fn default_max_connections() -> usize {
    max_connections_for(soft_nofile())
}

/// This process's soft `RLIMIT_NOFILE` (`None`: `getrlimit` failed).
fn soft_nofile() -> Option<libc::rlim_t> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` only writes the limit into `lim`, a valid `rlimit`.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0;
    ok.then_some(lim.rlim_cur)
}

/// [`default_max_connections`] for a soft descriptor limit (`None`: unknown, taken as 1024;
/// `RLIM_INFINITY` and anything above 1 << 30 count as 1 << 30).
fn max_connections_for(soft: Option<libc::rlim_t>) -> usize {
    let soft = soft.map_or(1024, |n| n.min(1 << 30) as usize);
    soft.saturating_sub((soft / 8).max(64)).max(1)
}

/// Accept failures (out of file descriptors, memory, ...): wait before the next accept,
/// doubling up to a bound while they continue, and log at most once per interval with the
/// number of failures since the last line. Plain data: the caller supplies the time.
#[derive(Debug)]
pub(crate) struct AcceptBackoff {
    delay: Duration,
    failures_since_log: u64,
    last_log: Option<Instant>,
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(5);
    const MAX: Duration = Duration::from_secs(1);
    /// At most one log line per this interval.
    pub(crate) const LOG_INTERVAL: Duration = Duration::from_secs(10);

    pub(crate) fn new() -> AcceptBackoff {
        AcceptBackoff {
            delay: Self::FIRST,
            failures_since_log: 0,
            last_log: None,
        }
    }

    /// Records a failure at `now`: how long to wait, and `Some(count)` when a log line is
    /// due, `count` being the failures it reports.
    pub(crate) fn failed(&mut self, now: Instant) -> (Duration, Option<u64>) {
        self.failures_since_log += 1;
        let wait = self.delay;
        self.delay = (self.delay * 2).min(Self::MAX);
        let due = self
            .last_log
            .is_none_or(|t| now.duration_since(t) >= Self::LOG_INTERVAL);
        let log = due.then(|| {
            self.last_log = Some(now);
            std::mem::take(&mut self.failures_since_log)
        });
        (wait, log)
    }

    /// An accept succeeded: the next failure waits the shortest time again.
    pub(crate) fn succeeded(&mut self) {
        self.delay = Self::FIRST;
    }
}

/// Counts a connection in [`RpcServer::connections`] while it is served.
struct Served<'a>(&'a AtomicUsize);

impl Drop for Served<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

struct Inner<H> {
    handler: H,
    config: ServerConfig,
    shutdown: CancellationToken,
    /// Set with `shutdown`: a plain load, where `CancellationToken::is_cancelled` takes a lock.
    stopping: AtomicBool,
    /// One waker per connection being served, woken by `shutdown` (registering an
    /// `AtomicWaker` is lock-free, unlike polling a `CancellationToken` every loop turn).
    connection_wakers: std::sync::Mutex<HashMap<u64, Arc<AtomicWaker>>>,
    next_connection: AtomicU64,
    connections: TaskTracker,
    /// One permit per connection `serve` may serve at once (`max_connections`).
    slots: Arc<Semaphore>,
    /// Connections being served now.
    served: AtomicUsize,
}

/// An RPC server. Cheap to clone; clones share the handler and the shutdown switch.
///
/// Per connection it reads requests while any are readable, runs their handlers concurrently
/// (a handler that answers at once costs no task, timer or map entry), and writes the replies
/// that are ready with one batched send when there is nothing more to read, so many calls in
/// flight cost a few writes and client wake-ups instead of one per call. On stream
/// transports, small replies also wait while the next request is still arriving (at most
/// 512 KiB of it), so a client streaming large requests gets its replies in batches, while
/// a reply of 256 KiB or more is written before any request that has not arrived whole is
/// read (an echo server does not hold the next large request and the last large reply at
/// once). A client must therefore finish writing a message before it waits for the reply to
/// an earlier one ([`RpcClient`](super::RpcClient) always does).
///
/// ```no_run
/// # async fn demo<L: transport_core::Listener>(listener: L) -> Result<(), transport_core::TransportError> {
/// use bytes::Bytes;
/// use transport_rpc::{Request, RpcServer, ServerConfig, Status};
///
/// let server = RpcServer::new(
///     |req: Request| async move {
///         match req.method {
///             1 => Ok(req.payload), // echo
///             m => Err(Status::unknown_method(m)),
///         }
///     },
///     ServerConfig::default(),
/// );
/// let handle = server.clone();
/// tokio::spawn(async move { server.serve(listener).await });
/// // ... later: stop accepting, let calls in flight finish, close connections.
/// handle.shutdown().await;
/// # Ok(()) }
/// ```
pub struct RpcServer<H> {
    inner: Arc<Inner<H>>,
}

impl<H> Clone for RpcServer<H> {
    fn clone(&self) -> Self {
        RpcServer {
            inner: self.inner.clone(),
        }
    }
}

impl<H: Handler> RpcServer<H> {
    /// A server running `handler`.
    pub fn new(handler: H, config: ServerConfig) -> RpcServer<H> {
        let slots = config.max_connections.clamp(1, Semaphore::MAX_PERMITS);
        RpcServer {
            inner: Arc::new(Inner {
                handler,
                config,
                shutdown: CancellationToken::new(),
                stopping: AtomicBool::new(false),
                connection_wakers: Default::default(),
                next_connection: AtomicU64::new(0),
                connections: TaskTracker::new(),
                slots: Arc::new(Semaphore::new(slots)),
                served: AtomicUsize::new(0),
            }),
        }
    }

    /// Accepts connections and serves each in its own task, until [`RpcServer::shutdown`].
    ///
    /// At [`ServerConfig::max_connections`] connections it accepts no more until one ends
    /// (back-pressure: new connections wait in the listener's queue), logged at most once per
    /// 10 s. An accept that fails (out of file descriptors or memory, ...) is
    /// retried after a pause that doubles while failures continue (5 ms up to 1 s), and
    /// logged at most once per 10 s with the number of failures.
    pub async fn serve<L: Listener>(&self, mut listener: L) -> Result<(), TransportError> {
        let mut backoff = AcceptBackoff::new();
        let mut full_logged: Option<Instant> = None;
        loop {
            let slot = match self.inner.slots.clone().try_acquire_owned() {
                Ok(slot) => slot,
                Err(_) => {
                    let now = Instant::now();
                    if full_logged.is_none_or(|t| now - t >= AcceptBackoff::LOG_INTERVAL) {
                        full_logged = Some(now);
                        tracing::warn!(
                            max_connections = self.inner.config.max_connections,
                            "rpc server at max_connections: accepting again when one ends"
                        );
                    }
                    tokio::select! {
                        _ = self.inner.shutdown.cancelled() => return Ok(()),
                        slot = self.inner.slots.clone().acquire_owned() => {
                            slot.expect("the semaphore is never closed")
                        }
                    }
                }
            };
            tokio::select! {
                _ = self.inner.shutdown.cancelled() => return Ok(()),
                accepted = listener.accept() => match accepted {
                    Ok(conn) => {
                        backoff.succeeded();
                        let this = self.clone();
                        self.inner.connections.spawn(async move {
                            let _slot = slot;
                            let peer = conn.peer();
                            if let Err(e) = this.serve_connection(conn).await {
                                tracing::debug!(%peer, error = %e, "rpc connection ended with an error");
                            }
                        });
                    }
                    Err(e) => {
                        // Out of file descriptors and the like: wait, keep serving.
                        let (wait, log) = backoff.failed(Instant::now());
                        if let Some(failures) = log {
                            tracing::warn!(error = %e, failures, "accept failing; backing off");
                        }
                        tokio::select! {
                            _ = self.inner.shutdown.cancelled() => return Ok(()),
                            _ = tokio::time::sleep(wait) => {}
                        }
                    }
                },
            }
        }
    }

    /// Stops accepting, lets every call in flight finish and be answered, closes the
    /// connections, and returns when all of that is done.
    pub async fn shutdown(&self) {
        self.inner.stopping.store(true, Ordering::SeqCst);
        for waker in self.inner.wakers().values() {
            waker.wake();
        }
        self.inner.shutdown.cancel();
        self.inner.connections.close();
        self.inner.connections.wait().await;
    }

    /// True once [`RpcServer::shutdown`] was called.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.stopping.load(Ordering::SeqCst)
    }

    /// Connections being served now (by [`RpcServer::serve`] and
    /// [`RpcServer::serve_connection`]).
    pub fn connections(&self) -> usize {
        self.inner.served.load(Ordering::Acquire)
    }

    /// Serves one connection until the peer closes it, it fails, it is idle past
    /// [`ServerConfig::idle_timeout`], or the server shuts down.
    pub async fn serve_connection<C: Connection>(&self, conn: C) -> Result<(), RpcError> {
        self.inner.served.fetch_add(1, Ordering::AcqRel);
        let _served = Served(&self.inner.served);
        self.serve_counted(conn).await
    }

    async fn serve_counted<C: Connection>(&self, conn: C) -> Result<(), RpcError> {
        let (mut tx, mut rx) = conn.split();
        let pool = tx.buffer_pool();
        let inner = &*self.inner;
        let max_in_flight = inner.config.max_in_flight_per_connection.max(1);
        let max_held = inner.config.max_request_bytes_per_connection;
        let budget = &inner.config.memory_budget;
        // Request bytes held by this connection's running handlers.
        let mut held = 0usize;
        // The idle timer is armed once and moved only when it fires: each request notes the
        // time (`last_active`), and a timer that fires early is set again from there. Moving
        // a tokio timer per request cost more than the rest of a ping's work here.
        let mut idle = inner
            .config
            .idle_timeout
            .map(|t| (t, Box::pin(tokio::time::sleep(t))));
        let mut last_active = Instant::now();
        let mut running: FuturesUnordered<RunningCall> = FuturesUnordered::new();
        // The box a handler's future is made in, kept from one request to the next: most
        // handlers answer at their first poll, and their box is then reused rather than
        // allocated and freed per request. A handler that has to wait takes the box with it.
        let mut slot = None;
        let mut aborts: HashMap<u64, AbortHandle> = HashMap::new();
        let mut reading = true;
        let mut replies = Replies::new(tx.max_message_size(), rx.metrics().clone());
        // Shutdown is a flag checked every turn plus a waker that `shutdown` wakes: polling a
        // `CancellationToken` instead takes two locks per turn, more than the rest of a
        // ping's work in this loop.
        let registration = ShutdownWaker::register(inner);
        // Replies are being held back while the next request streams in (see `Replies`).
        let mut holding = false;
        let result = loop {
            if reading && inner.stopping.load(Ordering::SeqCst) {
                reading = false;
            }
            if !reading && running.is_empty() {
                break Ok(());
            }
            // Read while calls, this connection's request bytes and the server's budget allow
            // (a connection holding nothing may exceed its own limit with one request).
            let budget_spent = budget.is_spent();
            let may_read = reading
                && running.len() < max_in_flight
                && (held == 0 || held < max_held)
                && !budget_spent
                // Large replies are written before more requests are read, except those
                // already received (see `Replies::READ_AHEAD_REPLY_BYTES`).
                && (replies.largest < Replies::READ_AHEAD_REPLY_BYTES || rx.has_buffered_message());
            // With replies about to go out, a transport that can tell whether a request is
            // there is asked without starting a wait: when none is, the replies are written
            // at once (a wait begun now would only be dropped, and on verbs it spins and
            // wakes this task again for nothing).
            let flush_next = !replies.is_empty() && !holding;
            let mut early = None;
            let mut look = may_read;
            if may_read && flush_next {
                match rx.try_recv() {
                    TryRecv::Ready(r) => early = Some(r),
                    TryRecv::Empty => look = false,
                    TryRecv::Unknown => {}
                }
            }
            tokio::select! {
                biased;
                // A request taken above is handled first: nothing else may drop it.
                Some((id, oneway, bytes, outcome)) = running.next(), if !running.is_empty() && early.is_none() => {
                    holding = false;
                    held -= bytes;
                    if idle.is_some() {
                        last_active = Instant::now();
                    }
                    if !oneway {
                        aborts.remove(&id);
                    }
                    if let (Ok(result), false) = (outcome, oneway) {
                        replies.push_result(id, result);
                        if replies.full() {
                            if let Err(e) = replies.flush(&mut tx).await {
                                break Err(e);
                            }
                        }
                    }
                }
                received = async {
                    match early.take() {
                        Some(r) => r,
                        None => rx.recv().await,
                    }
                }, if look => {
                    holding = false;
                    if idle.is_some() {
                        last_active = Instant::now();
                    }
                    let msg = match received {
                        Ok(Some(msg)) => msg,
                        Ok(None) => {
                            reading = false;
                            if inner.config.cancel_on_close {
                                // The peer is done: its running calls are dropped (cancelled)
                                // and their requests freed.
                                running = FuturesUnordered::new();
                                aborts.clear();
                                held = 0;
                            }
                            continue;
                        }
                        Err(TransportError::MessageTooLarge { len, max, header }) => {
                            match RpcHeader::decode(header.as_slice()) {
                                Ok(h) if h.kind == Kind::Request => {
                                    let status = Status::request_too_large(len, max);
                                    replies.push(Kind::Error, h.request_id, status.encode());
                                }
                                Ok(_) => tracing::warn!(len, max, "oversized oneway message dropped"),
                                Err(e) => break Err(e.into()),
                            }
                            continue;
                        }
                        Err(e) => break Err(e.into()),
                    };
                    let h = match RpcHeader::decode(msg.header.as_slice()) {
                        Ok(h) => h,
                        Err(e) => break Err(e.into()),
                    };
                    if let Err(e) = h.check_payload(msg.payload.len()) {
                        break Err(e.into());
                    }
                    match h.kind {
                        Kind::Request | Kind::Oneway => {
                            let oneway = h.kind == Kind::Oneway;
                            if !oneway && aborts.contains_key(&h.request_id) {
                                // Answered with an error; the call already running under this
                                // id, and every other call, go on.
                                let status = Status::new(
                                    code::REQUEST_ID_IN_USE,
                                    format!("request id {} is already in flight", h.request_id),
                                );
                                replies.push(Kind::Error, h.request_id, status.encode());
                                continue;
                            }
                            let bytes = msg.payload.len();
                            let req = Request {
                                method: h.method,
                                request_id: h.request_id,
                                payload: msg.payload,
                                oneway,
                                pool: pool.clone(),
                            };
                            let id = h.request_id;
                            let work = with_timeout(
                                inner.handler.call(req),
                                inner.config.handler_timeout,
                            );
                            let mut work = match slot.take() {
                                Some(mut boxed) => {
                                    Pin::set(&mut boxed, Some(work));
                                    boxed
                                }
                                None => Box::pin(Some(work)),
                            };
                            // Most handlers answer without waiting: poll once here and skip
                            // the abort handle, the map entry and the trip through `running`.
                            let first = transport_core::poll_once(
                                work.as_mut().as_pin_mut().expect("set just above"),
                            )
                            .await;
                            if let Poll::Ready(result) = first {
                                // The finished future is dropped in place; the box stays.
                                Pin::set(&mut work, None);
                                slot = Some(work);
                                if !oneway {
                                    replies.push_result(id, result);
                                    if replies.full() {
                                        if let Err(e) = replies.flush(&mut tx).await {
                                            break Err(e);
                                        }
                                    }
                                }
                                continue;
                            }
                            let work = poll_fn(move |cx| {
                                work.as_mut().as_pin_mut().expect("set until it ends").poll(cx)
                            });
                            let (handle, registration) = AbortHandle::new_pair();
                            if !oneway {
                                aborts.insert(id, handle);
                            }
                            let work = Abortable::new(work, registration);
                            // The request's bytes count against the budgets while its handler
                            // runs; the charge is given back when the call ends or is dropped.
                            held += bytes;
                            let charge = if bytes > 0 { budget.charge_anyway(bytes) } else { Charge::none() };
                            running.push(Box::pin(async move {
                                let outcome = work.await;
                                drop(charge);
                                (id, oneway, bytes, outcome)
                            }));
                        }
                        Kind::Cancel => {
                            if let Some(handle) = aborts.remove(&h.request_id) {
                                handle.abort();
                            }
                        }
                        other => break Err(ProtocolError::UnexpectedKind { from: "client", kind: other }.into()),
                    }
                }
                // No request or call is ready: the replies gathered so far go out in one write,
                // unless a request is still arriving (then they wait for it, within bounds).
                // Before the branches below, which only wait: with replies to write, this turn
                // does not wait, and the shutdown flag's waker and the idle timer are not
                // registered for nothing (188 of a uds ping's 4 958 server instructions:
                // docs/notes/2026-12-07-server-turn-and-the-one-cpu-ping.md).
                _ = std::future::ready(()), if !replies.is_empty() && !holding => {
                    let still_reading = reading && running.len() < max_in_flight;
                    if still_reading && replies.hold(rx.remaining_in_message()) {
                        holding = true;
                        continue;
                    }
                    if let Err(e) = replies.flush(&mut tx).await {
                        break Err(e);
                    }
                }
                _ = poll_fn(|cx| registration.poll_stopping(cx)), if reading => {
                    holding = false;
                    reading = false;
                }
                // Blocked only by the server-wide budget: read again once bytes come back.
                _ = budget.wait_for_room(), if reading && budget_spent => {}
                _ = async { idle.as_mut().expect("armed").1.as_mut().await },
                    if idle.is_some() && running.is_empty() && reading => {
                    let now = Instant::now();
                    if let Some((t, sleep)) = idle.as_mut() {
                        if now < last_active + *t {
                            // Active since it was set: not idle yet.
                            sleep.as_mut().reset(last_active + *t);
                            continue;
                        }
                    }
                    if rx.remaining_in_message().is_some() {
                        // A request is arriving: not idle (a stalled one is the transport's
                        // frame timeout to end).
                        if let Some((t, sleep)) = idle.as_mut() {
                            sleep.as_mut().reset(Instant::now() + *t);
                        }
                        continue;
                    }
                    tracing::debug!("closing an idle connection");
                    break Ok(());
                }
            }
        };
        // Answers already made still go out (best effort: the peer may be gone); then tell the
        // peer we are done.
        let flushed = replies.flush(&mut tx).await;
        let _ = tx.close().await;
        result.and(flushed)
    }
}

impl<H> Inner<H> {
    fn wakers(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<AtomicWaker>>> {
        // A poisoned lock only means a panic elsewhere while holding it; the map stays valid.
        self.connection_wakers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }
}

/// A connection's entry in the server's shutdown wakers; removed on drop.
struct ShutdownWaker<'a, H> {
    inner: &'a Inner<H>,
    id: u64,
    waker: Arc<AtomicWaker>,
}

impl<'a, H> ShutdownWaker<'a, H> {
    fn register(inner: &'a Inner<H>) -> ShutdownWaker<'a, H> {
        let id = inner.next_connection.fetch_add(1, Ordering::Relaxed);
        let waker = Arc::new(AtomicWaker::new());
        inner.wakers().insert(id, waker.clone());
        ShutdownWaker { inner, id, waker }
    }

    /// Ready once the server is shutting down; otherwise wakes this task when it does.
    fn poll_stopping(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.waker.register(cx.waker());
        // Checked after registering: a `shutdown` in between either sees the waker or has
        // already set the flag.
        if self.inner.stopping.load(Ordering::SeqCst) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

impl<H> Drop for ShutdownWaker<'_, H> {
    fn drop(&mut self) {
        self.inner.wakers().remove(&self.id);
    }
}

/// Replies of one connection waiting to be written together.
///
/// A reply is not written the moment its handler finishes: the server first takes every
/// request that is already readable, and writes the replies gathered meanwhile with one
/// `send_batch` (one vectored write on the socket backends) when nothing else is ready, or
/// when the batch holds [`Replies::MAX_BYTES`] or [`Replies::MAX_COUNT`]. With many calls in
/// flight that turns one write and one wake-up of the client per call into one per batch;
/// with one call at a time it changes nothing (the batch is flushed as soon as the
/// connection is idle again).
///
/// "Nothing else is ready" is not yet "idle" while a request is arriving: a client streaming
/// requests larger than the socket buffer leaves the server in the middle of one most of the
/// time, and writing every reply then costs a write on the server and a wake-up and a read on
/// the client per call, which keeps such a stream a little below the raw one
/// (docs/notes/2026-12-01-bench-rpc-against-raw-first-rounds.md). So the batch is held while
/// the rest of the arriving request is at most
/// [`Replies::HOLD_BYTES`] and less than that has arrived since its oldest reply was made
/// ([`Replies::hold`]): the delay a reply can see is bounded by bytes the client is sending,
/// with no timer. Replies that carry [`Replies::HOLD_REPLY_BYTES`] or more are not held: the
/// hold saves a write and a wake-up per small reply, which a large one is worth on its own.
/// A larger request, a full batch, a connection that stopped reading
/// (shutdown, `max_in_flight_per_connection`) or a gap between requests flushes it.
struct Replies {
    batch: Vec<Message>,
    bytes: usize,
    /// The largest payload in the batch.
    largest: usize,
    max_message_size: usize,
    /// The connection's counters (for the bytes received).
    received: Arc<Metrics>,
    /// Bytes received on the connection when the oldest reply of the batch was made.
    oldest_at: u64,
}

impl Replies {
    /// Flush once the batch's payloads reach this many bytes. Payloads are not copied into
    /// the batch (a vectored write takes them as they are), so large replies gain from
    /// leaving together too: with a 64 KiB bound every 64 KiB reply is its own write and RPC
    /// `recv` of 64 KiB falls well behind the raw stream; 1 MiB catches up with it, and more
    /// gains nothing (docs/notes/2026-12-02-bench-large-replies-written-together.md). It
    /// bounds the reply bytes a connection holds back, and with them the delay of the first
    /// reply of a batch.
    const MAX_BYTES: usize = 1 << 20;
    /// Flush once the batch holds this many replies.
    const MAX_COUNT: usize = 32;
    /// Most request bytes a held batch waits for.
    const HOLD_BYTES: usize = 512 << 10;
    /// A batch whose replies carry this many payload bytes is not held: a write that large
    /// is worth its system call and the client's wake-up on its own, and holding it keeps the
    /// replies (and the requests they echo) in memory while more arrive, which slows `echo`
    /// of 64 KiB and more (docs/notes/2026-12-03-bench-large-replies-and-echo.md).
    const HOLD_REPLY_BYTES: usize = 64 << 10;
    /// While the batch holds a reply this large, the server takes only requests that have
    /// already arrived whole ([`MessageReceiver::has_buffered_message`]) and reads no more
    /// before the batch is written: reading the next large request (an echo's) while large
    /// replies wait keeps both in memory, and the copies in and out then run from memory
    /// instead of cache (docs/notes/2026-12-03-bench-large-replies-and-echo.md).
    /// Small requests already read (a `recv` call's) still join the batch.
    const READ_AHEAD_REPLY_BYTES: usize = 256 << 10;

    fn new(max_message_size: usize, received: Arc<Metrics>) -> Replies {
        Replies {
            batch: Vec::new(),
            bytes: 0,
            largest: 0,
            max_message_size,
            received,
            oldest_at: 0,
        }
    }

    /// Whether to keep the batch back although nothing else is ready: true while a request
    /// is arriving whose rest is at most [`Replies::HOLD_BYTES`], unless that much has
    /// arrived since the oldest reply of the batch was made or the batch already carries
    /// [`Replies::HOLD_REPLY_BYTES`]. `remaining` is
    /// [`MessageReceiver::remaining_in_message`].
    fn hold(&self, remaining: Option<usize>) -> bool {
        let Some(remaining) = remaining else {
            return false;
        };
        if self.bytes >= Self::HOLD_REPLY_BYTES {
            return false;
        }
        let since = self
            .received
            .bytes_received
            .get()
            .saturating_sub(self.oldest_at);
        remaining <= Self::HOLD_BYTES && since < Self::HOLD_BYTES as u64
    }

    /// Queues a reply; one larger than the connection allows becomes an error reply that
    /// says why (the handler produced more than the client can take).
    fn push(&mut self, kind: Kind, id: u64, payload: Bytes) {
        let len = RPC_HEADER_LEN + payload.len();
        let (kind, payload) = if len > self.max_message_size || payload.len() > u32::MAX as usize {
            let status = Status::new(
                code::MESSAGE_TOO_LARGE,
                format!(
                    "response of {len} bytes exceeds the message limit of {} bytes",
                    self.max_message_size
                ),
            );
            (Kind::Error, status.encode())
        } else {
            (kind, payload)
        };
        let header = RpcHeader::new(kind, 0, id, payload.len());
        if self.batch.is_empty() {
            self.oldest_at = self.received.bytes_received.get();
        }
        self.bytes += payload.len();
        self.largest = self.largest.max(payload.len());
        self.batch
            .push(Message::new(HeaderBytes::from(header.encode()), payload));
    }

    /// Queues a handler's answer: its payload, or its status as an error reply.
    fn push_result(&mut self, id: u64, result: Result<Bytes, Status>) {
        match result {
            Ok(payload) => self.push(Kind::Response, id, payload),
            Err(status) => self.push(Kind::Error, id, status.encode()),
        }
    }

    fn is_empty(&self) -> bool {
        self.batch.is_empty()
    }

    fn full(&self) -> bool {
        self.bytes >= Self::MAX_BYTES || self.batch.len() >= Self::MAX_COUNT
    }

    async fn flush<S: MessageSender>(&mut self, tx: &mut S) -> Result<(), RpcError> {
        if self.batch.is_empty() {
            return Ok(());
        }
        self.bytes = 0;
        self.largest = 0;
        let sent = tx.send_batch(&mut self.batch).await;
        self.batch.clear();
        sent.map_err(RpcError::from)
    }
}

/// A handler's future with the server's time limit (`ServerConfig::handler_timeout`), if any.
/// Without a limit it is the handler's own future, polled in place (no wrapping state machine
/// to enter and no move of the handler's future into it, per request).
fn with_timeout<F>(
    work: F,
    timeout: Option<Duration>,
) -> impl Future<Output = Result<Bytes, Status>>
where
    F: Future<Output = Result<Bytes, Status>>,
{
    match timeout {
        None => Either::Left(work),
        Some(t) => Either::Right(async move {
            tokio::time::timeout(t, work)
                .await
                .unwrap_or_else(|_| Err(Status::handler_timed_out(t)))
        }),
    }
}

/// A handler's future, tagged with its request id, whether it is oneway and the request bytes
/// it holds.
type RunningCall = Pin<
    Box<dyn Future<Output = (u64, bool, usize, Result<Result<Bytes, Status>, Aborted>)> + Send>,
>;

#[cfg(test)]
mod tests;
