//! # transport-uds
//!
//! The Unix-domain socket backend of `transport-core`: tokio `UnixStream`s carrying the
//! same framing as TCP ([`transport_framed::frame`]), written with vectored writes straight
//! from the payload buffers.
//!
//! ## Listening safely
//!
//! A socket path is shared state on the file system, so [`UdsTransport::listen`] treats it as
//! such:
//!
//! - **Lock file.** A listener holds an exclusive `flock` on `<path>.lock` (created with mode
//!   `0600`, see [`UdsAddr::lock_path`]) for its whole life. `listen` takes it first, without
//!   waiting; if another listener holds it, `listen` fails with
//!   [`std::io::ErrorKind::AddrInUse`] and removes nothing. The lock is on the file now at that
//!   path (its inode is checked after locking, and the lock file reopened if it was replaced
//!   in between). The kernel releases the lock when its holder exits, even when it crashes.
//! - **No takeover of a live socket.** Holding the lock, `listen` replaces a socket left at
//!   the path only when connecting to it is refused: a listener that does not use the lock
//!   file, even one whose backlog is full, is never replaced. A path that is not a socket is
//!   never removed. Either is `AddrInUse`.
//! - **Removal by identity.** Dropping a [`UdsListener`] removes the socket file and the lock
//!   file only if they are still the files it created (same device and inode), so it never
//!   removes a successor's socket.
//! - **Permissions.** The socket file gets [`UdsConfig::mode`] (default `0o600`, owner only)
//!   after `bind` and before `listen`, whatever the umask: nobody connects while the
//!   permissions are looser. Connecting needs write permission on the socket file.
//! - **Peer credentials.** [`PeerCredentialsExt::peer_credentials`] gives the uid, gid and pid the
//!   kernel recorded for the other end (`SO_PEERCRED`), on accepted and connected
//!   connections.
//! - **Allowed uids.** With [`UdsConfig::allowed_uids`] set (default `None`: whoever may open
//!   the socket file), [`UdsListener::accept`](Listener::accept) closes connections from other
//!   uids at once, logs a warning, and keeps accepting: a rejected peer sees its connection
//!   closed.
//! - **Bare sockets.** [`UdsListener::accept_stream`] and [`UdsTransport::connect_stream`] give
//!   the `UnixStream` itself, after the same checks, for a protocol other than this crate's
//!   framing (transport-shm's set-up runs over them).
//!
//! As for any Unix socket, the directory holding it should not be writable by users the
//! server does not trust: they could rename or replace the files in it.
//!
//! ```no_run
//! # async fn demo() -> Result<(), transport_core::TransportError> {
//! use transport_core::{Listener, Transport};
//! use transport_uds::{PeerCredentialsExt, UdsAddr, UdsConfig, UdsTransport};
//!
//! let uds = UdsTransport::new(UdsConfig::default().with_mode(0o660));
//! let addr: UdsAddr = "/tmp/demo.sock".parse().unwrap();
//! let mut listener = uds.listen(&addr).await?;
//! let client_side = uds.connect(&addr).await?;
//! let server_side = listener.accept().await?;
//! assert_eq!(server_side.peer_credentials(), client_side.peer_credentials());
//! # Ok(()) }
//! ```

#[cfg(feature = "conformance")]
pub mod conformance;
mod socket_file;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use tokio::net::{UnixListener, UnixStream};
use transport_core::{Capabilities, Listener, Transport, TransportError};
use transport_framed::{SocketReceiver, SocketSender, StreamConfig, StreamConnection};

/// A Unix socket path.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UdsAddr(pub PathBuf);

impl UdsAddr {
    /// The path.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// The lock file a listener on this path holds: the path with `.lock` appended.
    pub fn lock_path(&self) -> PathBuf {
        socket_file::lock_path(&self.0)
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
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct UdsConfig {
    /// Framing settings (max message size, read buffer).
    pub stream: StreamConfig,
    /// Permission bits of the socket file a listener creates (at most `0o777`), set before
    /// it listens, whatever the umask. Default `0o600`: only the owner may connect.
    pub mode: u32,
    /// The uids a listener serves; connections from other uids, or whose uid the kernel does
    /// not report, are closed at accept time. Default `None`: anyone allowed to open the
    /// socket file (see [`UdsConfig::mode`]).
    pub allowed_uids: Option<Vec<u32>>,
    /// Listen backlog: connections the kernel queues before `accept` (capped by the kernel's
    /// `somaxconn`). Default 1024.
    pub backlog: i32,
    /// `SO_SNDBUF` of every connection's socket, connected or accepted: how many bytes a
    /// sender may have queued in the kernel for its peer before a write waits (on a Unix
    /// stream socket the sender's buffer is the whole limit). Default
    /// [`DEFAULT_SEND_BUFFER`]; `None` keeps the kernel's default (`net.core.wmem_default`,
    /// usually 208 KiB). The kernel caps it at `net.core.wmem_max` and books twice the value.
    ///
    /// Larger messages need fewer turns of the runtime: with the kernel's default, a 1 MiB
    /// message is about five partial writes, each followed by an `epoll_wait`, and the
    /// reader wakes as often (docs/notes/2026-12-06-sockets-one-read-per-large-frame.md). The
    /// cost is kernel memory while a peer is slow to read: up to this much (twice, as booked)
    /// per connection whose peer has stopped reading.
    pub send_buffer_size: Option<usize>,
}

/// Default [`UdsConfig::send_buffer_size`]: 1 MiB.
pub const DEFAULT_SEND_BUFFER: usize = 1 << 20;

impl Default for UdsConfig {
    fn default() -> Self {
        UdsConfig {
            stream: StreamConfig::default(),
            mode: 0o600,
            allowed_uids: None,
            backlog: 1024,
            send_buffer_size: Some(DEFAULT_SEND_BUFFER),
        }
    }
}

impl UdsConfig {
    /// The default settings with another max message size.
    pub fn with_max_message_size(max: usize) -> UdsConfig {
        let mut c = UdsConfig::default();
        c.stream.max_message_size = max;
        c
    }

    /// These settings with another socket file mode (see [`UdsConfig::mode`]).
    pub fn with_mode(mut self, mode: u32) -> UdsConfig {
        self.mode = mode;
        self
    }

    /// These settings serving only these uids (see [`UdsConfig::allowed_uids`]).
    pub fn with_allowed_uids(mut self, uids: impl IntoIterator<Item = u32>) -> UdsConfig {
        self.allowed_uids = Some(uids.into_iter().collect());
        self
    }

    /// These settings with another listen backlog (see [`UdsConfig::backlog`]).
    pub fn with_backlog(mut self, backlog: i32) -> UdsConfig {
        self.backlog = backlog;
        self
    }

    /// These settings with another socket send buffer, or the kernel's default for `None`
    /// (see [`UdsConfig::send_buffer_size`]).
    pub fn with_send_buffer_size(mut self, size: Option<usize>) -> UdsConfig {
        self.send_buffer_size = size;
        self
    }

    fn allows(&self, credentials: Option<&PeerCredentials>) -> bool {
        match (&self.allowed_uids, credentials) {
            (None, _) => true,
            (Some(uids), Some(c)) => uids.contains(&c.uid),
            (Some(_), None) => false,
        }
    }
}

/// Who is at the other end of a Unix socket connection, as the kernel recorded it when the
/// connection was made (`SO_PEERCRED` on Linux), not as the peer claims.
///
/// On an accepted connection: the process that connected. On a connected one: the process
/// that created the listening socket, as of its `listen` call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerCredentials {
    /// The peer's effective user id.
    pub uid: u32,
    /// The peer's effective group id.
    pub gid: u32,
    /// The peer's process id, when the platform reports it (Linux always does; 0 when the
    /// peer is in a pid namespace this process cannot see).
    pub pid: Option<u32>,
}

impl PeerCredentials {
    /// Who is at the other end of `stream`, accepted or connected; `None` if the kernel could
    /// not tell. For a stream from [`UdsListener::accept_stream`] or
    /// [`UdsTransport::connect_stream`] (on a [`UdsConnection`], use
    /// [`PeerCredentialsExt::peer_credentials`]).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), transport_core::TransportError> {
    /// use transport_uds::{PeerCredentials, UdsTransport};
    ///
    /// let stream = UdsTransport::default().connect_stream(&"/tmp/demo.sock".parse()?).await?;
    /// let listener_owner = PeerCredentials::of(&stream).map(|c| c.uid);
    /// # Ok(()) }
    /// ```
    pub fn of(stream: &UnixStream) -> Option<PeerCredentials> {
        let c = stream.peer_cred().ok()?;
        Some(PeerCredentials {
            uid: c.uid(),
            gid: c.gid(),
            pid: c.pid().and_then(|p| u32::try_from(p).ok()),
        })
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

    /// Connects to `addr` and returns the bare socket, for a protocol of its own (such as
    /// transport-shm's set-up) instead of this crate's framing.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), transport_core::TransportError> {
    /// use tokio::io::AsyncWriteExt;
    /// use transport_uds::UdsTransport;
    ///
    /// let mut stream = UdsTransport::default().connect_stream(&"/tmp/demo.sock".parse()?).await?;
    /// stream.write_all(b"hello").await?;
    /// # Ok(()) }
    /// ```
    ///
    /// This is what [`Transport::connect`] connects with, before it sets the socket's send
    /// buffer ([`UdsConfig::send_buffer_size`], not applied here) and wraps the socket in a
    /// [`UdsConnection`]. Connecting is not bounded in time here; wrap it in a timeout if
    /// needed. Who listens: [`PeerCredentials::of`].
    pub async fn connect_stream(&self, addr: &UdsAddr) -> Result<UnixStream, TransportError> {
        Ok(UnixStream::connect(&addr.0).await?)
    }
}

/// The backend's name in [`Capabilities::name`].
const NAME: &str = "uds";

impl Transport for UdsTransport {
    type Addr = UdsAddr;
    type Connection = UdsConnection;
    type Listener = UdsListener;

    fn capabilities(&self) -> Capabilities {
        self.config.stream.capabilities(NAME, true)
    }

    async fn connect(&self, addr: &UdsAddr) -> Result<UdsConnection, TransportError> {
        let stream = self.connect_stream(addr).await?;
        Ok(connection(stream, &self.config, addr.to_string()))
    }

    /// Listens on `addr`'s path, holding its lock file; see the crate docs for when a file
    /// already there is replaced (a stale socket) or not (`AddrInUse`).
    async fn listen(&self, addr: &UdsAddr) -> Result<UdsListener, TransportError> {
        let bound = socket_file::bind(&addr.0, self.config.mode, self.config.backlog)?;
        let socket_id = bound.id;
        let inner = match UnixListener::from_std(bound.listener) {
            Ok(l) => l,
            Err(e) => {
                socket_file::remove_if_same(&addr.0, socket_id);
                return Err(e.into());
            }
        };
        Ok(UdsListener {
            inner,
            addr: addr.clone(),
            config: self.config.clone(),
            socket_id,
            _lock: bound.lock,
        })
    }
}

/// A listening Unix socket. It holds the lock file of its path while it lives; on drop it
/// removes its socket file and lock file, each only if it is still the file it created.
#[derive(Debug)]
pub struct UdsListener {
    inner: UnixListener,
    addr: UdsAddr,
    config: UdsConfig,
    socket_id: socket_file::FileId,
    /// Dropped last (fields drop in order), after the socket file is gone.
    _lock: socket_file::PathLock,
}

impl Drop for UdsListener {
    fn drop(&mut self) {
        socket_file::remove_if_same(&self.addr.0, self.socket_id);
    }
}

impl UdsListener {
    /// The next connection from an allowed peer as a bare socket, with who is at the other
    /// end, for a protocol of its own (such as transport-shm's set-up) instead of this
    /// crate's framing.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), transport_core::TransportError> {
    /// use transport_core::Transport;
    /// use transport_uds::{UdsConfig, UdsTransport};
    ///
    /// let uds = UdsTransport::new(UdsConfig::default().with_allowed_uids([1000]));
    /// let mut listener = uds.listen(&"/tmp/demo.sock".parse()?).await?;
    /// let (stream, credentials) = listener.accept_stream().await?;
    /// assert_eq!(credentials.map(|c| c.uid), Some(1000));
    /// # drop(stream);
    /// # Ok(()) }
    /// ```
    ///
    /// The same checks as [`accept`](Listener::accept), which calls this: connections from
    /// uids not in [`UdsConfig::allowed_uids`] are closed, logged and skipped. With
    /// `allowed_uids` set the credentials are always `Some`. The socket's send buffer
    /// ([`UdsConfig::send_buffer_size`]) is left as the kernel made it. Cancel safe.
    pub async fn accept_stream(
        &mut self,
    ) -> Result<(UnixStream, Option<PeerCredentials>), TransportError> {
        loop {
            let (stream, _) = self.inner.accept().await?;
            let credentials = PeerCredentials::of(&stream);
            if !self.config.allows(credentials.as_ref()) {
                tracing::warn!(
                    path = %self.addr,
                    uid = ?credentials.map(|c| c.uid),
                    pid = ?credentials.and_then(|c| c.pid),
                    "uds: closed a connection from a uid not in allowed_uids"
                );
                continue;
            }
            return Ok((stream, credentials));
        }
    }
}

impl Listener for UdsListener {
    type Addr = UdsAddr;
    type Connection = UdsConnection;

    fn local_addr(&self) -> Result<UdsAddr, TransportError> {
        Ok(self.addr.clone())
    }

    /// The next connection from an allowed peer (see [`UdsConfig::allowed_uids`]); others
    /// are closed and skipped. Cancel safe.
    async fn accept(&mut self) -> Result<UdsConnection, TransportError> {
        let (stream, _) = self.accept_stream().await?;
        Ok(connection(
            stream,
            &self.config,
            format!("{} (accepted)", self.addr),
        ))
    }
}

/// An established Unix socket connection: the shared [`StreamConnection`] over a tokio
/// `UnixStream` ([`StreamConnection::socket`] gives the socket). Who is at the other end:
/// [`PeerCredentialsExt::peer_credentials`].
pub type UdsConnection = StreamConnection<UnixStream>;

/// The peer credentials of a [`UdsConnection`].
pub trait PeerCredentialsExt {
    /// Who is at the other end, as the kernel recorded it when the connection was set up;
    /// `None` if the kernel could not tell (the peer was already gone, an unsupported
    /// platform). Read it before [`Connection::split`](transport_core::Connection::split),
    /// which consumes the connection.
    fn peer_credentials(&self) -> Option<PeerCredentials>;
}

impl PeerCredentialsExt for UdsConnection {
    fn peer_credentials(&self) -> Option<PeerCredentials> {
        PeerCredentials::of(self.socket())
    }
}

fn connection(stream: UnixStream, config: &UdsConfig, peer: String) -> UdsConnection {
    if let Some(size) = config.send_buffer_size {
        // A hint for speed: a socket that refuses it still carries messages.
        if let Err(e) = socket2::SockRef::from(&stream).set_send_buffer_size(size) {
            tracing::warn!(peer = %peer, size, error = %e, "uds: SO_SNDBUF not set");
        }
    }
    StreamConnection::new(stream, NAME, config.stream.clone(), peer)
}

/// The sending half of a Unix socket connection.
pub type UdsSender = SocketSender<UnixStream>;
/// The receiving half of a Unix socket connection.
pub type UdsReceiver = SocketReceiver<UnixStream>;

/// The README's examples, compiled as doc tests so they cannot rot.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// docs/rpc.md's examples, compiled and run as doc tests.
#[doc = include_str!("../../docs/rpc.md")]
#[cfg(doctest)]
pub struct RpcDocDoctests;
