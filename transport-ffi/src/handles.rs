//! The objects behind the C handles, in safe Rust: each backend's connection, listener, RPC
//! client and server behind one object-safe trait, driven by blocking on the handle's runtime.

use crate::ready::{self, Feed, Feeder, Item};
use crate::status::{tp_status, Failure};
use crate::uri::Endpoint;
use bytes::{BufMut, Bytes};
use std::ffi::CString;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::runtime::Runtime;
use transport_core::{
    BufferPool, Connection, Listener, Message, MessageReceiver, MessageSender, SendBuffer,
    Transport, TransportError,
};
use transport_rpc::{CallOptions, ClientConfig, Handler, RpcClient, RpcServer};
use transport_rpc::{ServerConfig, Status};
use transport_tcp::{TcpConfig, TcpTransport};
use transport_uds::{UdsConfig, UdsTransport};
use transport_verbs::{VerbsConfig, VerbsTransport};

/// Settings for opening a transport (`tp_settings`); fields the caller's header does not know
/// (its `size` is smaller) keep their defaults.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Settings {
    /// Largest message, header + payload; `None`: the transport's default.
    pub(crate) max_message_size: Option<usize>,
}

/// Refuses a blocking call from a runtime's thread (inside a handler, it would stall the
/// runtime that must make progress for it).
pub(crate) fn not_in_runtime() -> Result<(), Failure> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(Failure::new(
            tp_status::TP_ERR_UNSUPPORTED,
            "a blocking call from a runtime thread (inside a tp_rpc_handler?)",
        ));
    }
    Ok(())
}

/// Runs `fut` to its end on `rt`, from a thread that is not one of a runtime's: a blocking
/// call from inside a handler (a runtime thread) is refused instead of panicking. Inlined:
/// the future is moved once, into the runtime's `block_on`, not through this frame too.
#[inline(always)]
pub(crate) fn block_on<F: Future>(rt: &Runtime, fut: F) -> Result<F::Output, Failure> {
    not_in_runtime()?;
    Ok(rt.block_on(fut))
}

/// `fut` within `timeout` (`None`: no limit).
async fn within<F: Future>(timeout: Option<Duration>, fut: F) -> Result<F::Output, Failure> {
    match timeout {
        None => Ok(fut.await),
        Some(d) => tokio::time::timeout(d, fut).await.map_err(|_| {
            Failure::new(
                tp_status::TP_ERR_TIMED_OUT,
                format!("no result within {} ms", d.as_millis()),
            )
        }),
    }
}

/// A connection of any backend.
pub(crate) trait AnyConn: Send + Sync {
    fn send(&self, rt: &Runtime, msg: Message, timeout: Option<Duration>) -> Result<(), Failure>;
    fn recv(&self, rt: &Runtime, timeout: Option<Duration>) -> Result<Option<Message>, Failure>;
    fn close(&self, rt: &Runtime) -> Result<(), Failure>;
    fn pool(&self) -> &Arc<dyn BufferPool>;
    fn max_message_size(&self) -> usize;
    /// Receives in the background from now on, into a feed (the receiving half stays with
    /// the task until it is aborted).
    fn feed(self: Arc<Self>, rt: &Runtime) -> Result<Fed<Received>, Failure>;
}

/// What a connection's feed holds: a message, or (last) the end or the error.
pub(crate) type Received = Result<Message, Failure>;

/// A feed and the background task filling it (aborted when dropped).
pub(crate) struct Fed<T> {
    pub(crate) feed: Feed<T>,
    task: tokio::task::AbortHandle,
}

impl<T: Send + 'static> Fed<T> {
    /// A new feed, filled by the task `fill` makes of its feeder, spawned on `rt`.
    fn spawn<F, Fut>(rt: &Runtime, fill: F) -> Result<Fed<T>, Failure>
    where
        F: FnOnce(Feeder<T>) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (feeder, feed) = ready::feed().map_err(|e| io_failure("eventfd", e))?;
        let task = rt.spawn(fill(feeder));
        Ok(Fed {
            feed,
            task: task.abort_handle(),
        })
    }
}

impl<T> Drop for Fed<T> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn io_failure(what: &str, e: std::io::Error) -> Failure {
    Failure::new(tp_status::TP_ERR_IO, format!("{what}: {e}"))
}

/// A connection's halves, each behind its own lock: one thread may send while another
/// receives.
struct Halves<C: Connection> {
    tx: tokio::sync::Mutex<C::Sender>,
    rx: tokio::sync::Mutex<C::Receiver>,
    pool: Arc<dyn BufferPool>,
    max: usize,
}

impl<C: Connection> Halves<C> {
    fn new(conn: C) -> Halves<C> {
        let (tx, rx) = conn.split();
        Halves {
            pool: tx.buffer_pool(),
            max: tx.max_message_size(),
            tx: tokio::sync::Mutex::new(tx),
            rx: tokio::sync::Mutex::new(rx),
        }
    }
}

impl<C: Connection> AnyConn for Halves<C>
where
    C::Sender: Sync,
    C::Receiver: Sync,
{
    fn send(&self, rt: &Runtime, msg: Message, timeout: Option<Duration>) -> Result<(), Failure> {
        // Over the limit: the transport refuses it before writing (`TP_ERR_TOO_LARGE`).
        block_on(rt, async {
            let mut tx = self.tx.lock().await;
            within(timeout, tx.send(msg)).await?.map_err(Failure::from)
        })?
    }

    fn recv(&self, rt: &Runtime, timeout: Option<Duration>) -> Result<Option<Message>, Failure> {
        block_on(rt, async {
            let mut rx = self.rx.lock().await;
            within(timeout, rx.recv()).await?.map_err(Failure::from)
        })?
    }

    fn close(&self, rt: &Runtime) -> Result<(), Failure> {
        block_on(rt, async { self.tx.lock().await.close().await })?.map_err(Failure::from)
    }

    fn pool(&self) -> &Arc<dyn BufferPool> {
        &self.pool
    }

    fn max_message_size(&self) -> usize {
        self.max
    }

    fn feed(self: Arc<Self>, rt: &Runtime) -> Result<Fed<Received>, Failure> {
        Fed::spawn(rt, |feeder| async move {
            let mut rx = self.rx.lock().await;
            loop {
                let item = match rx.recv().await {
                    Ok(Some(m)) => Item::More(Ok(m)),
                    Ok(None) => Item::Last(Err(Failure::new(
                        tp_status::TP_ERR_CLOSED,
                        "the peer closed the connection",
                    ))),
                    Err(e) => Item::Last(Err(Failure::from(e))),
                };
                if !feeder.offer(item).await {
                    break;
                }
            }
        })
    }
}

/// A listener of any backend.
pub(crate) trait AnyListener: Send + Sync {
    fn accept(&self, rt: &Runtime, timeout: Option<Duration>) -> Result<Arc<dyn AnyConn>, Failure>;
    /// Accepts in the background from now on, into a feed.
    fn feed(self: Arc<Self>, rt: &Runtime) -> Result<Fed<Accepted>, Failure>;
}

/// What a listener's feed holds: a connection, or an error of one accept.
pub(crate) type Accepted = Result<Arc<dyn AnyConn>, Failure>;

struct Lst<L: Listener>(tokio::sync::Mutex<L>);

impl<L: Listener> AnyListener for Lst<L>
where
    <L::Connection as Connection>::Sender: Sync,
    <L::Connection as Connection>::Receiver: Sync,
{
    fn accept(&self, rt: &Runtime, timeout: Option<Duration>) -> Result<Arc<dyn AnyConn>, Failure> {
        let conn = block_on(rt, async {
            let mut l = self.0.lock().await;
            within(timeout, l.accept()).await
        })??;
        Ok(Arc::new(Halves::new(conn?)))
    }

    fn feed(self: Arc<Self>, rt: &Runtime) -> Result<Fed<Accepted>, Failure> {
        Fed::spawn(rt, |feeder| async move {
            let mut l = self.0.lock().await;
            loop {
                let item = match l.accept().await {
                    Ok(c) => Item::More(Ok(Arc::new(Halves::new(c)) as Arc<dyn AnyConn>)),
                    Err(e) => {
                        let closed = matches!(e.original(), TransportError::Closed);
                        let f = Failure::from(e);
                        if closed {
                            Item::Last(Err(f))
                        } else {
                            // One connection's failure; the listener goes on, after a pause
                            // so that a persistent error (no descriptors left) does not spin.
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            Item::More(Err(f))
                        }
                    }
                };
                if !feeder.offer(item).await {
                    break;
                }
            }
        })
    }
}

/// An RPC client of any backend.
pub(crate) trait AnyRpcClient: Send + Sync {
    fn call(
        &self,
        rt: &Runtime,
        method: u32,
        payload: Bytes,
        timeout: Option<Duration>,
    ) -> Result<Bytes, Failure>;
    fn oneway(&self, rt: &Runtime, method: u32, payload: Bytes) -> Result<(), Failure>;
    fn close(&self, rt: &Runtime) -> Result<(), Failure>;
    /// A buffer of the connection's pool.
    fn alloc(&self, capacity: usize) -> SendBuffer;
    /// The largest request payload the server takes.
    fn max_payload(&self) -> usize;
}

impl<S: MessageSender + Sync> AnyRpcClient for RpcClient<S> {
    fn call(
        &self,
        rt: &Runtime,
        method: u32,
        payload: Bytes,
        timeout: Option<Duration>,
    ) -> Result<Bytes, Failure> {
        let opts = CallOptions { deadline: timeout };
        block_on(rt, self.call_with(method, payload, opts))?.map_err(Failure::from)
    }

    fn oneway(&self, rt: &Runtime, method: u32, payload: Bytes) -> Result<(), Failure> {
        block_on(rt, RpcClient::oneway(self, method, payload))?.map_err(Failure::from)
    }

    fn close(&self, rt: &Runtime) -> Result<(), Failure> {
        block_on(rt, RpcClient::close(self))?.map_err(Failure::from)
    }

    fn alloc(&self, capacity: usize) -> SendBuffer {
        RpcClient::alloc(self, capacity)
    }

    fn max_payload(&self) -> usize {
        RpcClient::max_payload(self)
    }
}

/// `data` copied into `buf`, frozen.
pub(crate) fn copy_in(mut buf: SendBuffer, data: &[u8]) -> Bytes {
    buf.put_slice(data);
    buf.freeze()
}

/// A serving RPC server of any backend: stops gracefully.
pub(crate) trait AnyRpcServer: Send + Sync {
    fn shutdown(&self, rt: &Runtime) -> Result<(), Failure>;
}

struct Serving<H: Handler> {
    server: RpcServer<H>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl<H: Handler> AnyRpcServer for Serving<H> {
    fn shutdown(&self, rt: &Runtime) -> Result<(), Failure> {
        let task = self.task.lock().unwrap_or_else(|p| p.into_inner()).take();
        block_on(rt, async {
            self.server.shutdown().await;
            if let Some(t) = task {
                let _ = t.await;
            }
        })
    }
}

/// The transport an endpoint names, with `settings`, handed to `f` with its address.
macro_rules! with_transport {
    ($ep:expr, $settings:expr, |$t:ident, $addr:ident| $body:expr) => {{
        let settings: Settings = $settings;
        match $ep {
            Endpoint::Tcp(a) => {
                let mut cfg = TcpConfig::default();
                if let Some(m) = settings.max_message_size {
                    cfg.stream.max_message_size = m;
                }
                let $t = TcpTransport::new(cfg);
                let $addr = a;
                $body
            }
            Endpoint::Unix(p) => {
                let mut cfg = UdsConfig::default();
                if let Some(m) = settings.max_message_size {
                    cfg.stream.max_message_size = m;
                }
                let $t = UdsTransport::new(cfg);
                let $addr = transport_uds::UdsAddr(p);
                $body
            }
            Endpoint::Verbs(a) => {
                let mut cfg = VerbsConfig::default();
                if let Some(m) = settings.max_message_size {
                    cfg.max_message_size = m;
                }
                let $t = VerbsTransport::new(cfg).map_err(|e| {
                    let status = if e.is_no_device() {
                        tp_status::TP_ERR_NO_DEVICE
                    } else {
                        tp_status::TP_ERR_IO
                    };
                    Failure::new(status, e.to_string())
                })?;
                let $addr = a;
                $body
            }
        }
    }};
}

/// Connects to `ep`.
pub(crate) fn connect(
    rt: &Runtime,
    ep: Endpoint,
    settings: Settings,
    timeout: Option<Duration>,
) -> Result<Arc<dyn AnyConn>, Failure> {
    with_transport!(ep, settings, |t, addr| {
        let conn = block_on(rt, within(timeout, t.connect(&addr)))???;
        Ok(Arc::new(Halves::new(conn)) as Arc<dyn AnyConn>)
    })
}

/// Connects to `ep` in the background: the feed's one item is the connection or the error.
pub(crate) fn connect_in_background(
    rt: &Runtime,
    ep: Endpoint,
    settings: Settings,
) -> Result<Fed<Accepted>, Failure> {
    Fed::spawn(rt, |feeder| async move {
        let connected = async {
            with_transport!(ep, settings, |t, addr| {
                let conn = t.connect(&addr).await?;
                Ok(Arc::new(Halves::new(conn)) as Arc<dyn AnyConn>)
            })
        };
        feeder.offer(Item::Last(connected.await)).await;
    })
}

/// A listener at `ep`, and its URI (the bound port, for port 0).
pub(crate) fn listen(
    rt: &Runtime,
    ep: Endpoint,
    settings: Settings,
) -> Result<(Arc<dyn AnyListener>, CString), Failure> {
    let kind = ep.clone();
    with_transport!(ep, settings, |t, addr| {
        let l = block_on(rt, t.listen(&addr))??;
        let uri = bound_uri(&kind, &l.local_addr()?.to_string());
        Ok((
            Arc::new(Lst(tokio::sync::Mutex::new(l))) as Arc<dyn AnyListener>,
            uri,
        ))
    })
}

/// A connected RPC client.
pub(crate) fn rpc_connect(
    rt: &Runtime,
    ep: Endpoint,
    settings: Settings,
    timeout: Option<Duration>,
) -> Result<Box<dyn AnyRpcClient>, Failure> {
    with_transport!(ep, settings, |t, addr| {
        let conn = block_on(rt, within(timeout, t.connect(&addr)))???;
        let _in_rt = rt.enter();
        Ok(Box::new(RpcClient::new(conn, ClientConfig::default())) as Box<dyn AnyRpcClient>)
    })
}

/// An RPC server serving `handler` at `ep`, and its URI.
pub(crate) fn rpc_serve<H: Handler + Clone>(
    rt: &Runtime,
    ep: Endpoint,
    settings: Settings,
    handler: H,
) -> Result<(Box<dyn AnyRpcServer>, CString), Failure> {
    let kind = ep.clone();
    with_transport!(ep, settings, |t, addr| {
        let l = block_on(rt, t.listen(&addr))??;
        let uri = bound_uri(&kind, &l.local_addr()?.to_string());
        let server = RpcServer::new(handler, ServerConfig::default());
        let task = rt.spawn({
            let server = server.clone();
            async move {
                if let Err(e) = server.serve(l).await {
                    eprintln!("transport-ffi: the RPC server stopped: {e}");
                }
            }
        });
        let serving = Serving {
            server,
            task: std::sync::Mutex::new(Some(task)),
        };
        Ok((Box::new(serving) as Box<dyn AnyRpcServer>, uri))
    })
}

/// The URI of a bound listener: the scheme of what was asked, the address the backend reports.
fn bound_uri(asked: &Endpoint, local: &str) -> CString {
    let uri = match asked {
        Endpoint::Tcp(_) => format!("tcp://{local}"),
        Endpoint::Verbs(_) => format!("verbs://{local}"),
        Endpoint::Unix(p) => Endpoint::Unix(p.clone()).uri(),
    };
    CString::new(uri).unwrap_or_default()
}

/// The reply a handler's response is built in (`tp_reply`).
pub(crate) struct ReplySlot {
    pub(crate) alloc: Box<dyn Fn(usize) -> SendBuffer + Send>,
    pub(crate) payload: Option<Bytes>,
}

/// A handler's status for a non-zero return code.
pub(crate) fn handler_status(code: i32) -> Status {
    Status::new(code as u32, format!("the handler returned {code}"))
}
