//! The RPC server: runs a [`Handler`] for every request, many at once per connection.

use super::error::{code, RpcError, Status};
use super::header::{Kind, RpcHeader};
use crate::{
    BufferPool, Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender,
    SendBuffer, TransportError,
};
use bytes::Bytes;
use futures_util::future::{AbortHandle, Abortable, Aborted};
use futures_util::stream::{FuturesUnordered, StreamExt};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

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
    pool: Arc<dyn BufferPool>,
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

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Most calls run at once per connection; the server stops reading that connection until
    /// one finishes (back-pressure instead of unbounded memory).
    pub max_in_flight_per_connection: usize,
    /// Time limit for a handler; past it the call gets [`code::DEADLINE_EXCEEDED`].
    pub handler_timeout: Option<Duration>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_in_flight_per_connection: 4096,
            handler_timeout: None,
        }
    }
}

struct Inner<H> {
    handler: H,
    config: ServerConfig,
    shutdown: CancellationToken,
    connections: TaskTracker,
}

/// An RPC server. Cheap to clone; clones share the handler and the shutdown switch.
///
/// ```no_run
/// # async fn demo<L: transport_core::Listener>(listener: L) -> Result<(), transport_core::TransportError> {
/// use bytes::Bytes;
/// use transport_core::rpc::{Request, RpcServer, ServerConfig, Status};
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
        RpcServer {
            inner: Arc::new(Inner {
                handler,
                config,
                shutdown: CancellationToken::new(),
                connections: TaskTracker::new(),
            }),
        }
    }

    /// Accepts connections and serves each in its own task, until [`RpcServer::shutdown`].
    pub async fn serve<L: Listener>(&self, mut listener: L) -> Result<(), TransportError> {
        loop {
            tokio::select! {
                _ = self.inner.shutdown.cancelled() => return Ok(()),
                accepted = listener.accept() => match accepted {
                    Ok(conn) => {
                        let this = self.clone();
                        self.inner.connections.spawn(async move {
                            let peer = conn.peer();
                            if let Err(e) = this.serve_connection(conn).await {
                                tracing::debug!(%peer, error = %e, "rpc connection ended with an error");
                            }
                        });
                    }
                    Err(e) => {
                        // Out of file descriptors and the like: wait a little, keep serving.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                },
            }
        }
    }

    /// Stops accepting, lets every call in flight finish and be answered, closes the
    /// connections, and returns when all of that is done.
    pub async fn shutdown(&self) {
        self.inner.shutdown.cancel();
        self.inner.connections.close();
        self.inner.connections.wait().await;
    }

    /// True once [`RpcServer::shutdown`] was called.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.shutdown.is_cancelled()
    }

    /// Serves one connection until the peer closes it, it fails, or the server shuts down.
    pub async fn serve_connection<C: Connection>(&self, conn: C) -> Result<(), RpcError> {
        let (mut tx, mut rx) = conn.split();
        let pool = tx.buffer_pool();
        let inner = &*self.inner;
        let max_in_flight = inner.config.max_in_flight_per_connection.max(1);
        let mut running: FuturesUnordered<RunningCall> = FuturesUnordered::new();
        let mut aborts: HashMap<u64, AbortHandle> = HashMap::new();
        let mut reading = true;
        let result = loop {
            if !reading && running.is_empty() {
                break Ok(());
            }
            tokio::select! {
                biased;
                Some((id, oneway, outcome)) = running.next(), if !running.is_empty() => {
                    if !oneway {
                        aborts.remove(&id);
                    }
                    let reply = match outcome {
                        Ok(Ok(payload)) => Some((Kind::Response, payload)),
                        Ok(Err(status)) => Some((Kind::Error, Status::encode(&status))),
                        Err(_aborted) => None,
                    };
                    if let (Some((kind, payload)), false) = (reply, oneway) {
                        if let Err(e) = send_reply(&mut tx, kind, id, payload).await {
                            break Err(e);
                        }
                    }
                }
                _ = inner.shutdown.cancelled(), if reading => {
                    reading = false;
                }
                received = rx.recv(), if reading && running.len() < max_in_flight => {
                    let msg = match received {
                        Ok(Some(msg)) => msg,
                        Ok(None) => {
                            reading = false;
                            continue;
                        }
                        Err(TransportError::MessageTooLarge { len, max, header }) => {
                            match RpcHeader::decode(header.as_slice()) {
                                Ok(h) if h.kind == Kind::Request => {
                                    let status = Status::new(
                                        code::MESSAGE_TOO_LARGE,
                                        format!("request of {len} bytes exceeds the server limit of {max} bytes"),
                                    );
                                    if let Err(e) = send_reply(&mut tx, Kind::Error, h.request_id, status.encode()).await {
                                        break Err(e);
                                    }
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
                                break Err(RpcError::Protocol(format!(
                                    "request id {} reused while in flight", h.request_id
                                )));
                            }
                            let req = Request {
                                method: h.method,
                                request_id: h.request_id,
                                payload: msg.payload,
                                oneway,
                                pool: pool.clone(),
                            };
                            let (handle, registration) = AbortHandle::new_pair();
                            if !oneway {
                                aborts.insert(h.request_id, handle);
                            }
                            let work = inner.handler.call(req);
                            let timeout = inner.config.handler_timeout;
                            let id = h.request_id;
                            let work = Abortable::new(async move {
                                match timeout {
                                    None => work.await,
                                    Some(t) => tokio::time::timeout(t, work).await.unwrap_or_else(|_| {
                                        Err(Status::new(code::DEADLINE_EXCEEDED, format!("handler exceeded the server's limit of {t:?}")))
                                    }),
                                }
                            }, registration);
                            running.push(Box::pin(async move { (id, oneway, work.await) }));
                        }
                        Kind::Cancel => {
                            if let Some(handle) = aborts.remove(&h.request_id) {
                                handle.abort();
                            }
                        }
                        other => break Err(RpcError::Protocol(format!("a client sent a {other:?} message"))),
                    }
                }
            }
        };
        // Answer nothing more; tell the peer we are done (best effort: it may be gone).
        let _ = tx.close().await;
        result
    }
}

async fn send_reply<S: MessageSender>(
    tx: &mut S,
    kind: Kind,
    id: u64,
    payload: Bytes,
) -> Result<(), RpcError> {
    let header = RpcHeader::new(kind, 0, id, payload.len());
    match tx
        .send(Message::new(HeaderBytes::from(header.encode()), payload))
        .await
    {
        Ok(()) => Ok(()),
        Err(TransportError::MessageTooLarge { len, max, .. }) => {
            // The handler produced more than the connection allows: tell the client why.
            let status = Status::new(
                code::MESSAGE_TOO_LARGE,
                format!("response of {len} bytes exceeds the message limit of {max} bytes"),
            )
            .encode();
            let header = RpcHeader::new(Kind::Error, 0, id, status.len());
            tx.send(Message::new(HeaderBytes::from(header.encode()), status))
                .await
                .map_err(RpcError::from)
        }
        Err(e) => Err(e.into()),
    }
}

/// A handler's future, tagged with its request id and whether it is oneway.
type RunningCall =
    Pin<Box<dyn Future<Output = (u64, bool, Result<Result<Bytes, Status>, Aborted>)> + Send>>;
