//! # transport-uds
//!
//! The Unix-domain socket backend of `transport-core`: tokio `UnixStream`s carrying the
//! same framing as TCP ([`transport_core::frame`]), written with vectored writes straight
//! from the payload buffers.
//!
//! A listener whose path is taken by a stale socket (nobody accepting) replaces it; a path
//! with a live listener fails with `AddrInUse`. The socket file is removed when the listener
//! is dropped.
//!
//! ```no_run
//! # async fn demo() -> Result<(), transport_core::TransportError> {
//! use transport_core::{Listener, Transport};
//! use transport_uds::{UdsAddr, UdsTransport};
//!
//! let uds = UdsTransport::default();
//! let addr: UdsAddr = "/tmp/demo.sock".parse().unwrap();
//! let mut listener = uds.listen(&addr).await?;
//! let client_side = uds.connect(&addr).await?;
//! let server_side = listener.accept().await?;
//! # Ok(()) }
//! ```

#[cfg(feature = "conformance")]
pub mod conformance;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use transport_core::stream::{StreamConfig, StreamReceiver, StreamSender};
use transport_core::{Capabilities, Connection, Listener, Metrics, Transport, TransportError};

/// A Unix socket path.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UdsAddr(pub PathBuf);

impl UdsAddr {
    /// The path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl fmt::Display for UdsAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.display())
    }
}

impl FromStr for UdsAddr {
    type Err = TransportError;
    fn from_str(s: &str) -> Result<UdsAddr, TransportError> {
        if s.is_empty() {
            return Err(TransportError::InvalidAddress {
                addr: s.into(),
                reason: "empty socket path".into(),
            });
        }
        Ok(UdsAddr(PathBuf::from(s)))
    }
}

impl From<PathBuf> for UdsAddr {
    fn from(p: PathBuf) -> Self {
        UdsAddr(p)
    }
}

/// Unix socket settings.
#[derive(Debug, Clone, Default)]
pub struct UdsConfig {
    /// Framing settings (max message size, read buffer).
    pub stream: StreamConfig,
}

impl UdsConfig {
    /// The default settings with another max message size.
    pub fn with_max_message_size(max: usize) -> UdsConfig {
        let mut c = UdsConfig::default();
        c.stream.max_message_size = max;
        c
    }
}

/// The Unix-domain socket transport.
#[derive(Debug, Clone, Default)]
pub struct UdsTransport {
    config: UdsConfig,
}

impl UdsTransport {
    /// A transport with these settings.
    pub fn new(config: UdsConfig) -> UdsTransport {
        UdsTransport { config }
    }
}

fn capabilities(config: &UdsConfig) -> Capabilities {
    config.stream.capabilities("uds", true)
}

impl Transport for UdsTransport {
    type Addr = UdsAddr;
    type Connection = UdsConnection;
    type Listener = UdsListener;

    fn capabilities(&self) -> Capabilities {
        capabilities(&self.config)
    }

    async fn connect(&self, addr: &UdsAddr) -> Result<UdsConnection, TransportError> {
        let stream = UnixStream::connect(&addr.0).await?;
        Ok(UdsConnection::new(
            stream,
            self.config.clone(),
            addr.to_string(),
        ))
    }

    async fn listen(&self, addr: &UdsAddr) -> Result<UdsListener, TransportError> {
        let inner = match UnixListener::bind(&addr.0) {
            Ok(l) => l,
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
                // Replace a stale socket nobody listens on; never a live one or another file.
                let is_socket = std::fs::symlink_metadata(&addr.0)
                    .map(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
                    .unwrap_or(false);
                let live = UnixStream::connect(&addr.0).await.is_ok();
                if !is_socket || live {
                    return Err(e.into());
                }
                std::fs::remove_file(&addr.0)?;
                UnixListener::bind(&addr.0)?
            }
            Err(e) => return Err(e.into()),
        };
        Ok(UdsListener {
            inner,
            addr: addr.clone(),
            config: self.config.clone(),
        })
    }
}

/// A listening Unix socket; its file is removed on drop.
#[derive(Debug)]
pub struct UdsListener {
    inner: UnixListener,
    addr: UdsAddr,
    config: UdsConfig,
}

impl Drop for UdsListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.addr.0);
    }
}

impl Listener for UdsListener {
    type Addr = UdsAddr;
    type Connection = UdsConnection;

    fn local_addr(&self) -> Result<UdsAddr, TransportError> {
        Ok(self.addr.clone())
    }

    async fn accept(&mut self) -> Result<UdsConnection, TransportError> {
        let (stream, _) = self.inner.accept().await?;
        Ok(UdsConnection::new(
            stream,
            self.config.clone(),
            format!("{} (accepted)", self.addr),
        ))
    }
}

/// An established Unix socket connection.
#[derive(Debug)]
pub struct UdsConnection {
    stream: UnixStream,
    config: UdsConfig,
    metrics: Arc<Metrics>,
    peer: String,
}

impl UdsConnection {
    fn new(stream: UnixStream, config: UdsConfig, peer: String) -> UdsConnection {
        UdsConnection {
            stream,
            config,
            metrics: Arc::new(Metrics::default()),
            peer,
        }
    }
}

/// The sending half of a Unix socket connection.
pub type UdsSender = StreamSender<OwnedWriteHalf>;
/// The receiving half of a Unix socket connection.
pub type UdsReceiver = StreamReceiver<OwnedReadHalf>;

impl Connection for UdsConnection {
    type Sender = UdsSender;
    type Receiver = UdsReceiver;

    fn capabilities(&self) -> Capabilities {
        capabilities(&self.config)
    }

    fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    fn peer(&self) -> String {
        self.peer.clone()
    }

    fn split(self) -> (UdsSender, UdsReceiver) {
        let (r, w) = self.stream.into_split();
        (
            StreamSender::new(w, self.metrics.clone(), &self.config.stream),
            StreamReceiver::new(r, self.metrics, &self.config.stream),
        )
    }
}

/// The README's examples, compiled as doc tests so they cannot rot.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
