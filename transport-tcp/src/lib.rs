//! # transport-tcp
//!
//! The TCP backend of `transport-core`: tokio sockets configured through socket2
//! (`TCP_NODELAY`, optional `SO_SNDBUF`/`SO_RCVBUF`, listen backlog), with messages framed by
//! [`transport_core::frame`] and written with vectored writes straight from the payload
//! buffers (no user-space payload copy on send; received payloads are slices of the read
//! buffer).
//!
//! ```no_run
//! # async fn demo() -> Result<(), transport_core::TransportError> {
//! use bytes::Bytes;
//! use transport_core::rpc::{ClientConfig, RpcClient};
//! use transport_core::Transport;
//! use transport_tcp::{TcpConfig, TcpTransport};
//!
//! let tcp = TcpTransport::new(TcpConfig::default());
//! let conn = tcp.connect(&"127.0.0.1:7000".parse().unwrap()).await?;
//! let client = RpcClient::new(conn, ClientConfig::default());
//! # Ok(()) }
//! ```

#[cfg(feature = "conformance")]
pub mod conformance;

use socket2::{Domain, Protocol, SockRef, Socket, Type};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener as TokioListener, TcpStream};
use transport_core::stream::{StreamConfig, StreamReceiver, StreamSender};
use transport_core::{Capabilities, Connection, Listener, Metrics, Transport, TransportError};

/// TCP settings.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Framing settings (max message size, read buffer).
    pub stream: StreamConfig,
    /// Disable Nagle's algorithm (default: true; RPC wants every message out at once).
    pub nodelay: bool,
    /// `SO_SNDBUF`; `None` keeps the kernel's autotuning.
    pub send_buffer_size: Option<usize>,
    /// `SO_RCVBUF`; `None` keeps the kernel's autotuning.
    pub recv_buffer_size: Option<usize>,
    /// Listen backlog.
    pub backlog: i32,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            stream: StreamConfig::default(),
            nodelay: true,
            send_buffer_size: None,
            recv_buffer_size: None,
            backlog: 1024,
        }
    }
}

impl TcpConfig {
    /// The default settings with another max message size.
    pub fn with_max_message_size(max: usize) -> TcpConfig {
        let mut c = TcpConfig::default();
        c.stream.max_message_size = max;
        c
    }

    fn apply(&self, sock: SockRef<'_>) -> std::io::Result<()> {
        if let Some(n) = self.send_buffer_size {
            sock.set_send_buffer_size(n)?;
        }
        if let Some(n) = self.recv_buffer_size {
            sock.set_recv_buffer_size(n)?;
        }
        sock.set_nodelay(self.nodelay)?;
        Ok(())
    }
}

/// The TCP transport.
#[derive(Debug, Clone, Default)]
pub struct TcpTransport {
    config: TcpConfig,
}

impl TcpTransport {
    /// A transport with these settings.
    pub fn new(config: TcpConfig) -> TcpTransport {
        TcpTransport { config }
    }

    /// Its settings.
    pub fn config(&self) -> &TcpConfig {
        &self.config
    }
}

fn capabilities(config: &TcpConfig) -> Capabilities {
    config.stream.capabilities("tcp", true)
}

impl Transport for TcpTransport {
    type Addr = SocketAddr;
    type Connection = TcpConnection;
    type Listener = TcpListener;

    fn capabilities(&self) -> Capabilities {
        capabilities(&self.config)
    }

    async fn connect(&self, addr: &SocketAddr) -> Result<TcpConnection, TransportError> {
        let socket = Socket::new(
            Domain::for_address(*addr),
            Type::STREAM,
            Some(Protocol::TCP),
        )?;
        self.config.apply(SockRef::from(&socket))?;
        socket.set_nonblocking(true)?;
        let socket = tokio::net::TcpSocket::from_std_stream(socket.into());
        let stream = socket.connect(*addr).await?;
        TcpConnection::new(stream, self.config.clone())
    }

    async fn listen(&self, addr: &SocketAddr) -> Result<TcpListener, TransportError> {
        let socket = Socket::new(
            Domain::for_address(*addr),
            Type::STREAM,
            Some(Protocol::TCP),
        )?;
        socket.set_reuse_address(true)?;
        // Buffer sizes set on the listener are inherited by accepted sockets, before the
        // handshake fixes the window scale.
        self.config.apply(SockRef::from(&socket))?;
        socket.bind(&(*addr).into())?;
        socket.listen(self.config.backlog)?;
        socket.set_nonblocking(true)?;
        let inner = TokioListener::from_std(socket.into())?;
        Ok(TcpListener {
            inner,
            config: self.config.clone(),
        })
    }
}

/// A listening TCP socket.
#[derive(Debug)]
pub struct TcpListener {
    inner: TokioListener,
    config: TcpConfig,
}

impl Listener for TcpListener {
    type Addr = SocketAddr;
    type Connection = TcpConnection;

    fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        Ok(self.inner.local_addr()?)
    }

    async fn accept(&mut self) -> Result<TcpConnection, TransportError> {
        let (stream, _) = self.inner.accept().await?;
        TcpConnection::new(stream, self.config.clone())
    }
}

/// An established TCP connection.
#[derive(Debug)]
pub struct TcpConnection {
    stream: TcpStream,
    config: TcpConfig,
    metrics: Arc<Metrics>,
    peer: String,
}

impl TcpConnection {
    fn new(stream: TcpStream, config: TcpConfig) -> Result<TcpConnection, TransportError> {
        stream.set_nodelay(config.nodelay)?;
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        Ok(TcpConnection {
            stream,
            config,
            metrics: Arc::new(Metrics::default()),
            peer,
        })
    }

    /// The underlying socket (for options this crate does not wrap).
    pub fn socket(&self) -> &TcpStream {
        &self.stream
    }
}

/// The sending half of a TCP connection.
pub type TcpSender = StreamSender<OwnedWriteHalf>;
/// The receiving half of a TCP connection.
pub type TcpReceiver = StreamReceiver<OwnedReadHalf>;

impl Connection for TcpConnection {
    type Sender = TcpSender;
    type Receiver = TcpReceiver;

    fn capabilities(&self) -> Capabilities {
        capabilities(&self.config)
    }

    fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    fn peer(&self) -> String {
        self.peer.clone()
    }

    fn split(self) -> (TcpSender, TcpReceiver) {
        let (r, w) = self.stream.into_split();
        (
            StreamSender::new(w, self.metrics.clone(), &self.config.stream),
            StreamReceiver::new(r, self.metrics, &self.config.stream),
        )
    }
}
