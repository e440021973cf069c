//! Test helpers for the RPC client and server tests: an in-memory stream connection, and a
//! connection whose sender records its writes and waits for a switch.

use std::sync::{Arc, Mutex};
use tokio::io::{DuplexStream, ReadHalf, WriteHalf};
use transport_core::{
    Capabilities, Connection, Message, MessageReceiver, MessageSender, Metrics, TransportError,
};
use transport_framed::{StreamConfig, StreamReceiver, StreamSender};

/// One end of an in-memory stream connection.
pub(crate) struct Duplex {
    pub(crate) io: DuplexStream,
    pub(crate) config: StreamConfig,
    metrics: Arc<Metrics>,
}

impl Duplex {
    pub(crate) fn pair(max_message_size: usize) -> (Duplex, Duplex) {
        Duplex::pair_with_pipe(max_message_size, 1 << 20)
    }

    /// [`Duplex::pair`] whose two pipes hold at most `pipe` bytes each (a socket buffer).
    pub(crate) fn pair_with_pipe(max_message_size: usize, pipe: usize) -> (Duplex, Duplex) {
        let (a, b) = tokio::io::duplex(pipe);
        let mut config = StreamConfig::default();
        config.max_message_size = max_message_size;
        let end = |io| Duplex {
            io,
            config: config.clone(),
            metrics: Arc::default(),
        };
        (end(a), end(b))
    }
}

impl Connection for Duplex {
    type Sender = StreamSender<WriteHalf<DuplexStream>>;
    type Receiver = StreamReceiver<ReadHalf<DuplexStream>>;

    fn capabilities(&self) -> Capabilities {
        self.config.capabilities("duplex", false)
    }
    fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }
    fn peer(&self) -> String {
        "duplex".into()
    }
    fn split(self) -> (Self::Sender, Self::Receiver) {
        let (r, w) = tokio::io::split(self.io);
        (
            StreamSender::new(w, self.metrics.clone(), &self.config),
            StreamReceiver::new(r, self.metrics, &self.config),
        )
    }
}

/// Serves `end` with an echo handler that holds every call until the returned switch is set to
/// `true`; also returns the serving task.
pub(crate) fn gated_echo_server(
    end: Duplex,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<Result<(), crate::RpcError>>,
) {
    use crate::{Request, RpcServer, ServerConfig, Status};
    let (open, gate) = tokio::sync::watch::channel(false);
    let server = RpcServer::new(
        move |req: Request| {
            let mut gate = gate.clone();
            async move {
                let _ = gate.wait_for(|open| *open).await;
                Ok::<_, Status>(req.payload)
            }
        },
        ServerConfig::default(),
    );
    let serving = tokio::spawn(async move { server.serve_connection(end).await });
    (open, serving)
}

/// A connection whose sender takes nothing until its switch is set to `true`, then records
/// the size of every `send` / `send_batch` it completes (or fails them all, if told to). Its
/// receiver never delivers anything.
pub(crate) struct Gated {
    /// Messages per completed write, in order.
    pub(crate) writes: Arc<Mutex<Vec<usize>>>,
    gate: tokio::sync::watch::Receiver<bool>,
    fail: bool,
    metrics: Arc<Metrics>,
}

impl Gated {
    /// A connection, the switch that opens its sender, and its write log.
    pub(crate) fn new(fail: bool) -> (Gated, tokio::sync::watch::Sender<bool>) {
        let (open, gate) = tokio::sync::watch::channel(false);
        let conn = Gated {
            writes: Arc::default(),
            gate,
            fail,
            metrics: Arc::default(),
        };
        (conn, open)
    }
}

/// The sending half of [`Gated`].
pub(crate) struct GatedSender {
    writes: Arc<Mutex<Vec<usize>>>,
    gate: tokio::sync::watch::Receiver<bool>,
    fail: bool,
    metrics: Arc<Metrics>,
}

impl MessageSender for GatedSender {
    async fn send(&mut self, msg: Message) -> Result<(), TransportError> {
        self.send_batch(&mut vec![msg]).await
    }
    async fn send_batch(&mut self, msgs: &mut Vec<Message>) -> Result<(), TransportError> {
        let _ = self.gate.wait_for(|open| *open).await;
        if self.fail {
            return Err(TransportError::Io(std::io::Error::from(
                std::io::ErrorKind::BrokenPipe,
            )));
        }
        self.writes.lock().expect("log").push(msgs.len());
        msgs.clear();
        Ok(())
    }
    fn max_message_size(&self) -> usize {
        1 << 20
    }
    async fn close(&mut self) -> Result<(), TransportError> {
        Ok(())
    }
    fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

/// The receiving half of [`Gated`]: nothing ever arrives.
pub(crate) struct Silent(Arc<Metrics>);

impl MessageReceiver for Silent {
    async fn recv(&mut self) -> Result<Option<Message>, TransportError> {
        std::future::pending().await
    }
    fn metrics(&self) -> &Arc<Metrics> {
        &self.0
    }
}

impl Connection for Gated {
    type Sender = GatedSender;
    type Receiver = Silent;

    fn capabilities(&self) -> Capabilities {
        let mut config = StreamConfig::default();
        config.max_message_size = 1 << 20;
        config.capabilities("gated", false)
    }
    fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }
    fn peer(&self) -> String {
        "gated".into()
    }
    fn split(self) -> (GatedSender, Silent) {
        let sender = GatedSender {
            writes: self.writes,
            gate: self.gate,
            fail: self.fail,
            metrics: self.metrics.clone(),
        };
        (sender, Silent(self.metrics))
    }
}

/// A [`Duplex`] end whose receiver answers [`MessageReceiver::try_recv`] (one poll of `recv`
/// with a waker that does nothing), counting what it found.
pub(crate) struct Looking {
    inner: Duplex,
    pub(crate) found: Arc<LookCounts>,
}

/// What a [`Looking`] receiver's `try_recv` found, counted.
#[derive(Default)]
pub(crate) struct LookCounts {
    pub(crate) ready: std::sync::atomic::AtomicUsize,
    pub(crate) empty: std::sync::atomic::AtomicUsize,
}

impl Looking {
    pub(crate) fn new(inner: Duplex) -> Looking {
        Looking {
            inner,
            found: Arc::default(),
        }
    }
}

/// The receiving half of a [`Looking`] end.
pub(crate) struct LookingReceiver {
    inner: StreamReceiver<ReadHalf<DuplexStream>>,
    found: Arc<LookCounts>,
}

impl MessageReceiver for LookingReceiver {
    async fn recv(&mut self) -> Result<Option<Message>, TransportError> {
        self.inner.recv().await
    }

    fn try_recv(&mut self) -> transport_core::TryRecv {
        use std::future::Future;
        use std::sync::atomic::Ordering;
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let polled = std::pin::pin!(self.inner.recv()).poll(&mut cx);
        match polled {
            std::task::Poll::Ready(r) => {
                self.found.ready.fetch_add(1, Ordering::Relaxed);
                transport_core::TryRecv::Ready(r)
            }
            std::task::Poll::Pending => {
                self.found.empty.fetch_add(1, Ordering::Relaxed);
                transport_core::TryRecv::Empty
            }
        }
    }

    fn metrics(&self) -> &Arc<Metrics> {
        self.inner.metrics()
    }
}

impl Connection for Looking {
    type Sender = StreamSender<WriteHalf<DuplexStream>>;
    type Receiver = LookingReceiver;

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn metrics(&self) -> Arc<Metrics> {
        self.inner.metrics()
    }
    fn peer(&self) -> String {
        "looking duplex".into()
    }
    fn split(self) -> (Self::Sender, Self::Receiver) {
        let found = self.found;
        let (tx, rx) = self.inner.split();
        (tx, LookingReceiver { inner: rx, found })
    }
}
