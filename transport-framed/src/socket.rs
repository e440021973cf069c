//! One [`Connection`] for every byte-stream socket: the TCP and Unix-socket backends differ in
//! how they connect, listen and set socket options, not in how a connected socket carries
//! messages, so that part lives here once.
//!
//! ```no_run
//! # async fn demo() -> Result<(), transport_core::TransportError> {
//! use transport_framed::{StreamConfig, StreamConnection};
//! use transport_core::Connection;
//!
//! let socket = tokio::net::TcpStream::connect("127.0.0.1:7000").await?;
//! let conn = StreamConnection::new(socket, "tcp", StreamConfig::default(), "127.0.0.1:7000".into());
//! let (sender, receiver) = conn.split();
//! # Ok(()) }
//! ```

use super::{StreamConfig, StreamReceiver, StreamSender};
use std::fmt::Debug;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};
use transport_core::{Capabilities, Connection, Metrics};

/// A connected byte-stream socket that splits into owned halves: tokio's `TcpStream` and
/// `UnixStream`.
pub trait StreamSocket: AsRawFd + Debug + Send + Sync + 'static {
    /// The reading half.
    type ReadHalf: AsyncRead + Unpin + Send + 'static;
    /// The writing half.
    type WriteHalf: AsyncWrite + Unpin + Send + 'static;

    /// Splits into halves that can move to different tasks.
    fn into_split(self) -> (Self::ReadHalf, Self::WriteHalf);
}

impl StreamSocket for tokio::net::TcpStream {
    type ReadHalf = tokio::net::tcp::OwnedReadHalf;
    type WriteHalf = tokio::net::tcp::OwnedWriteHalf;

    fn into_split(self) -> (Self::ReadHalf, Self::WriteHalf) {
        tokio::net::TcpStream::into_split(self)
    }
}

/// Unix sockets split into halves of this crate ([`UnixReadHalf`](super::UnixReadHalf),
/// [`UnixWriteHalf`](super::UnixWriteHalf)): tokio's would register
/// the socket for write space too, and a Unix socket reports write space on every read by its
/// peer, waking the writer's runtime for nothing once per message. Like tokio's, the halves
/// can be made outside a runtime: each registers with the runtime that first polls it.
impl StreamSocket for tokio::net::UnixStream {
    type ReadHalf = super::unix::UnixReadHalf;
    type WriteHalf = super::unix::UnixWriteHalf;

    fn into_split(self) -> (Self::ReadHalf, Self::WriteHalf) {
        super::unix::split(self)
    }
}

/// An established connection over a byte-stream socket, carrying messages in the
/// [`crate::frame`] format. `transport_tcp::TcpConnection` and `transport_uds::UdsConnection`
/// are this type.
#[derive(Debug)]
pub struct StreamConnection<S> {
    socket: S,
    name: &'static str,
    config: StreamConfig,
    metrics: Arc<Metrics>,
    peer: String,
}

impl<S: StreamSocket> StreamConnection<S> {
    /// A connection over a connected (or accepted) socket whose per-connection options are
    /// already set. `name` is the backend's name in [`Capabilities::name`]; `peer` names the
    /// other end in logs.
    pub fn new(socket: S, name: &'static str, config: StreamConfig, peer: String) -> Self {
        StreamConnection {
            socket,
            name,
            config,
            metrics: Arc::new(Metrics::default()),
            peer,
        }
    }

    /// The underlying socket, for options and queries this crate does not wrap (peer
    /// credentials, buffer sizes). Use it before [`Connection::split`], which consumes the
    /// connection.
    pub fn socket(&self) -> &S {
        &self.socket
    }

    /// The framing settings.
    pub fn config(&self) -> &StreamConfig {
        &self.config
    }
}

/// The sending half of a [`StreamConnection`].
pub type SocketSender<S> = StreamSender<<S as StreamSocket>::WriteHalf>;
/// The receiving half of a [`StreamConnection`].
pub type SocketReceiver<S> = StreamReceiver<<S as StreamSocket>::ReadHalf>;

impl<S: StreamSocket> Connection for StreamConnection<S> {
    type Sender = SocketSender<S>;
    type Receiver = SocketReceiver<S>;

    fn capabilities(&self) -> Capabilities {
        self.config.capabilities(self.name, true)
    }

    fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    fn peer(&self) -> String {
        self.peer.clone()
    }

    fn split(self) -> (Self::Sender, Self::Receiver) {
        let fd = self.socket.as_raw_fd();
        let (r, w) = self.socket.into_split();
        let mut rx = StreamReceiver::new(r, self.metrics.clone(), &self.config);
        // The receiver owns the read half, so the socket outlives its registration.
        rx.set_spin_fd(fd);
        (StreamSender::new(w, self.metrics, &self.config), rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use transport_core::{HeaderBytes, Message, MessageReceiver, MessageSender};

    /// Both socket types carry a message through the one connection type, and the halves
    /// share the connection's counters.
    #[tokio::test]
    async fn tcp_and_unix_sockets_carry_messages_through_one_connection_type() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (a, b) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        roundtrip(a.unwrap(), b.unwrap().0, "tcp").await;

        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        roundtrip(a, b, "uds").await;
    }

    async fn roundtrip<S: StreamSocket>(a: S, b: S, name: &'static str) {
        let a = StreamConnection::new(a, name, StreamConfig::default(), "a".into());
        let b = StreamConnection::new(b, name, StreamConfig::default(), "b".into());
        assert_eq!(a.capabilities().name, name);
        let metrics = a.metrics();
        let (mut tx, _rx) = a.split();
        let (_tx, mut rx) = b.split();
        let msg = Message::new(HeaderBytes::from([7u8]), Bytes::from_static(b"payload"));
        tx.send(msg).await.unwrap();
        let got = rx.recv().await.unwrap().expect("a message");
        assert_eq!(got.header.as_slice(), &[7]);
        assert_eq!(got.payload, "payload");
        assert_eq!(metrics.snapshot().messages_sent, 1);
    }
}
