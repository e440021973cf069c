//! transport-core's [`Transport`] over shared memory: connections addressed by a Unix socket
//! path ([`UdsAddr`]), set up over that socket ([`crate::connect`]) and carried in shared
//! memory ([`crate::conn`]).
//!
//! ```no_run
//! # async fn demo() -> Result<(), transport_core::TransportError> {
//! use bytes::Bytes;
//! use transport_core::{Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport};
//! use transport_shm::ShmTransport;
//!
//! let shm = ShmTransport::default();
//! let addr = "/tmp/demo.shm".parse()?;
//! let mut listener = shm.listen(&addr).await?;
//! let client = shm.connect(&addr).await?;
//! let server = listener.accept().await?;
//! let (mut tx, _) = client.split();
//! let (_, mut rx) = server.split();
//! tx.send(Message::new(HeaderBytes::EMPTY, Bytes::from_static(b"hi"))).await?;
//! assert_eq!(&rx.recv().await?.expect("a message").payload[..], b"hi");
//! # Ok(()) }
//! ```

use transport_core::{Capabilities, Listener, Transport, TransportError};
use transport_uds::{UdsAddr, UdsConfig};

use crate::conn::{ShmConfig, ShmConnection};
use crate::connect::{connect, Connected, ShmError, ShmListener};

/// Shared-memory connections between processes of one host (see the [crate docs](crate)).
#[derive(Debug, Clone, Default)]
pub struct ShmTransport {
    /// The connections' sizes and limits.
    pub config: ShmConfig,
    /// The listening socket's settings (file mode, allowed uids, backlog); its framing
    /// settings are not used.
    pub uds: UdsConfig,
}

impl ShmTransport {
    /// A transport with these connection settings and transport-uds's default socket settings
    /// (an owner-only socket file, any uid that can open it).
    pub fn new(config: ShmConfig) -> ShmTransport {
        ShmTransport {
            config,
            uds: UdsConfig::default(),
        }
    }
}

fn io(e: ShmError) -> TransportError {
    match e {
        ShmError::Socket(e) => e,
        other => TransportError::Backend(transport_core::BackendError::new(other)),
    }
}

fn connection(
    c: Connected,
    config: &ShmConfig,
    peer: String,
) -> Result<ShmConnection, TransportError> {
    let peer = match c.peer {
        Some(p) => format!("{peer} (pid {}, uid {})", p.pid.unwrap_or(0), p.uid),
        None => peer,
    };
    ShmConnection::new(c.established, config, peer)
}

impl Transport for ShmTransport {
    type Addr = UdsAddr;
    type Connection = ShmConnection;
    type Listener = ShmTransportListener;

    fn capabilities(&self) -> Capabilities {
        self.config.capabilities()
    }

    async fn connect(&self, addr: &UdsAddr) -> Result<ShmConnection, TransportError> {
        let c = connect(addr.path(), self.config.hello(), &self.config.limits)
            .await
            .map_err(io)?;
        connection(c, &self.config, addr.to_string())
    }

    async fn listen(&self, addr: &UdsAddr) -> Result<ShmTransportListener, TransportError> {
        let inner = ShmListener::bind(
            addr.path(),
            self.uds.clone(),
            self.config.hello(),
            self.config.limits,
        )
        .await
        .map_err(io)?;
        Ok(ShmTransportListener {
            inner,
            addr: addr.clone(),
            config: self.config.clone(),
        })
    }
}

/// A [`ShmTransport`]'s listener.
#[derive(Debug)]
pub struct ShmTransportListener {
    inner: ShmListener,
    addr: UdsAddr,
    config: ShmConfig,
}

impl Listener for ShmTransportListener {
    type Addr = UdsAddr;
    type Connection = ShmConnection;

    fn local_addr(&self) -> Result<UdsAddr, TransportError> {
        Ok(self.addr.clone())
    }

    /// The next peer whose set-up succeeds: a peer that fails it (not transport-shm, limits
    /// refused, a stall past the time limit) is an error for this call only, and the listener
    /// goes on with the next `accept`. Cancel safe while it waits for a peer.
    async fn accept(&mut self) -> Result<ShmConnection, TransportError> {
        let c = self.inner.accept().await.map_err(io)?;
        connection(c, &self.config, format!("{} (accepted)", self.addr))
    }
}
