//! # transport-tcp
//!
//! The TCP backend of `transport-core`: tokio sockets configured through socket2
//! (`TCP_NODELAY`, optional `SO_SNDBUF`/`SO_RCVBUF`, listen backlog), with messages framed by
//! [`transport_framed::frame`] and written with vectored writes straight from the payload
//! buffers (no user-space payload copy on send; received payloads are slices of the read
//! buffer).
//!
//! ## Dead peers: keepalive
//!
//! A peer whose machine dies or whose network goes away sends nothing, not even a reset: a
//! connection to it would stay open forever, holding its calls and memory. Every connection
//! (connected and accepted) therefore turns on TCP keepalive ([`TcpConfig::keepalive`],
//! default 60 s): after that long without traffic the kernel sends a probe every
//! [`KEEPALIVE_INTERVAL`] (10 s), and after [`KEEPALIVE_RETRIES`] (5) unanswered probes it
//! resets the connection, which fails its pending receives and calls. A dead peer is thus
//! noticed within about 60 + 5 x 10 = 110 s. `None` leaves keepalive off. Keepalive says
//! nothing about a live peer that merely stays silent: the RPC server's `idle_timeout` and
//! the stream framing's `frame_timeout` are for those.
//!
//! ```no_run
//! # async fn demo() -> Result<(), transport_core::TransportError> {
//! use bytes::Bytes;
//! use transport_rpc::{ClientConfig, RpcClient};
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

use socket2::{Domain, Protocol, SockRef, Socket, TcpKeepalive, Type};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::{TcpListener as TokioListener, TcpStream};
use transport_core::{Capabilities, Listener, Transport, TransportError};
use transport_framed::{SocketReceiver, SocketSender, StreamConfig, StreamConnection};

/// TCP settings.
#[derive(Debug, Clone)]
#[non_exhaustive]
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
    /// TCP keepalive on every connection: the time without traffic before the first probe
    /// (`TCP_KEEPIDLE`), then probes every [`KEEPALIVE_INTERVAL`], and the connection is
    /// reset after [`KEEPALIVE_RETRIES`] unanswered ones. Default `Some(60 s)`
    /// ([`DEFAULT_KEEPALIVE`]); `None` turns keepalive off. See the
    /// [crate docs](crate#dead-peers-keepalive).
    pub keepalive: Option<Duration>,
}

/// Default [`TcpConfig::keepalive`]: the first probe after 60 s without traffic.
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(60);
/// Time between keepalive probes once they started (`TCP_KEEPINTVL`): 10 s.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// Unanswered keepalive probes after which the kernel resets the connection
/// (`TCP_KEEPCNT`): 5.
pub const KEEPALIVE_RETRIES: u32 = 5;

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            stream: StreamConfig::default(),
            nodelay: true,
            send_buffer_size: None,
            recv_buffer_size: None,
            backlog: 1024,
            keepalive: Some(DEFAULT_KEEPALIVE),
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

    /// Sets keepalive on a connection as configured.
    fn apply_keepalive(&self, sock: SockRef<'_>) -> std::io::Result<()> {
        match self.keepalive {
            Some(time) => sock.set_tcp_keepalive(
                &TcpKeepalive::new()
                    .with_time(time)
                    .with_interval(KEEPALIVE_INTERVAL)
                    .with_retries(KEEPALIVE_RETRIES),
            ),
            None => sock.set_keepalive(false),
        }
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

/// The backend's name in [`Capabilities::name`].
const NAME: &str = "tcp";

impl Transport for TcpTransport {
    type Addr = SocketAddr;
    type Connection = TcpConnection;
    type Listener = TcpListener;

    fn capabilities(&self) -> Capabilities {
        self.config.stream.capabilities(NAME, true)
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
        connection(stream, &self.config)
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
        connection(stream, &self.config)
    }
}

/// An established TCP connection: the shared [`StreamConnection`] over a tokio `TcpStream`
/// ([`StreamConnection::socket`] gives the socket).
pub type TcpConnection = StreamConnection<TcpStream>;

/// A connection on a connected or accepted stream: options that are per connection are set
/// here, for both.
fn connection(stream: TcpStream, config: &TcpConfig) -> Result<TcpConnection, TransportError> {
    stream.set_nodelay(config.nodelay)?;
    config.apply_keepalive(SockRef::from(&stream))?;
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    Ok(StreamConnection::new(
        stream,
        NAME,
        config.stream.clone(),
        peer,
    ))
}

/// The sending half of a TCP connection.
pub type TcpSender = SocketSender<TcpStream>;
/// The receiving half of a TCP connection.
pub type TcpReceiver = SocketReceiver<TcpStream>;
