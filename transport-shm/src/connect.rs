//! Making a connection: [`ShmListener`] on a Unix socket path and [`connect`] to it, each
//! running the [`setup`](crate::setup) over the socket.
//!
//! ```no_run
//! # async fn demo() -> Result<(), transport_shm::connect::ShmError> {
//! use transport_shm::connect::{connect, ShmListener, UdsConfig};
//! use transport_shm::setup::{Hello, Limits};
//!
//! let mine = Hello::ring(256);
//! let mut listener = ShmListener::bind("/tmp/demo.shm", UdsConfig::default(), mine, Limits::default()).await?;
//! // In another process:
//! let client = connect("/tmp/demo.shm", mine, &Limits::default()).await?;
//! // Back in the listener's:
//! let server = listener.accept().await?;
//! assert_eq!(server.peer.map(|c| c.uid), client.peer.map(|c| c.uid));
//! # Ok(()) }
//! ```
//!
//! The socket is transport-uds's, with all its checks ([`transport_uds`]'s crate docs): the
//! listener holds a lock file next to the socket path, replaces a stale socket there only when
//! nobody listens on it, creates the socket file with [`UdsConfig::mode`] (default `0o600`,
//! owner only) before anyone can connect, removes it on drop if it is still its own, and
//! closes at once connections from uids not in [`UdsConfig::allowed_uids`], going on to the
//! next. The socket then stays open for the connection's life, in
//! [`Established::stream`]: its closing tells that the peer is gone.
//!
//! Every step is bounded in time: [`connect`] by [`Limits::timeout`] for reaching the socket,
//! then the set-up by the same limit again; the listener's set-ups, which run in the background
//! from the moment it is bound (at most [`MAX_CONCURRENT_SETUPS`] at once), each by
//! [`Limits::timeout`] (waiting in [`ShmListener::accept`] for a peer is not bounded: wrap it
//! in a timeout if needed).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;

use transport_core::{Transport as _, TransportError};
use transport_uds::{UdsAddr, UdsListener, UdsTransport};

use crate::setup::{handshake, Established, Hello, Limits, SetupError};

pub use transport_uds::{PeerCredentials, UdsConfig};

/// Why a connection could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// Binding, accepting or connecting the Unix socket failed (the path is in use, does not
    /// exist, nobody listens, permissions, ...).
    #[error("socket: {0}")]
    Socket(#[from] TransportError),
    /// Connecting to the socket took longer than [`Limits::timeout`].
    #[error("no connection to the socket within {0:?}")]
    ConnectTimedOut(Duration),
    /// (Client side.) The listener closed the connection before sending any of its hello, which
    /// it sends first: it refused this process's uid ([`UdsConfig::allowed_uids`]), or it failed
    /// or went away before its set-up. Holds the set-up's error as it came.
    #[error(
        "the listener closed the connection without a hello (refused this uid, or failed): {0}"
    )]
    Refused(#[source] SetupError),
    /// The set-up failed: the peer is not a transport-shm peer, announced what this side's
    /// [`Limits`] refuse, sent a bad region, stalled past [`Limits::timeout`], left, ...
    #[error("set-up: {0}")]
    Setup(#[from] SetupError),
}

/// A connection set up: both rings' regions mapped and the socket kept
/// ([`Established::stream`]), with who is at the other end.
#[derive(Debug)]
pub struct Connected {
    /// The regions and the socket.
    pub established: Established,
    /// The peer as the kernel recorded it (`SO_PEERCRED`): for the listener, the process that
    /// connected; for the client, the process that created the listening socket. `None` if the
    /// kernel could not tell (never on a listener with [`UdsConfig::allowed_uids`] set).
    pub peer: Option<PeerCredentials>,
}

/// A Unix socket listener that sets up a shared-memory connection with each allowed peer.
///
/// ```no_run
/// # async fn demo() -> Result<(), transport_shm::connect::ShmError> {
/// use transport_shm::connect::{ShmListener, UdsConfig};
/// use transport_shm::setup::{Hello, Limits};
///
/// let uds = UdsConfig::default().with_allowed_uids([1000]);
/// let mut listener = ShmListener::bind("/run/app/shm.sock", uds, Hello::ring(256), Limits::default()).await?;
/// loop {
///     match listener.accept().await {
///         Ok(connection) => { /* serve connection.established */ }
///         Err(e) => eprintln!("a peer failed its set-up: {e}"),
///     }
/// }
/// # }
/// ```
///
/// Dropping it stops its accept task, which removes the socket file and its lock file (each
/// if it is still its own) as it ends, at the runtime's next turn; connections already made
/// are not affected.
#[derive(Debug)]
pub struct ShmListener {
    addr: UdsAddr,
    /// Set-ups done (or failed) in the background, in the order they ended.
    done: mpsc::Receiver<Result<Connected, ShmError>>,
    /// Accepts sockets and runs their set-ups; owns the socket.
    task: JoinHandle<()>,
}

/// Set-ups that may run at once: a flood of peers that stall holds at most this many sockets
/// for up to [`Limits::timeout`] each, and the next ones wait in the kernel's backlog.
pub const MAX_CONCURRENT_SETUPS: usize = 64;

impl Drop for ShmListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Accepts allowed peers and runs each set-up on a task of its own (at most
/// [`MAX_CONCURRENT_SETUPS`] at once), sending each result to `done`; ends when the listener
/// is dropped (its receiver closes) or the socket fails.
async fn accept_loop(
    mut inner: UdsListener,
    mine: Hello,
    limits: Limits,
    done: mpsc::Sender<Result<Connected, ShmError>>,
) {
    let permits = Arc::new(Semaphore::new(MAX_CONCURRENT_SETUPS));
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let accepted = tokio::select! {
            a = inner.accept_stream() => a,
            () = done.closed() => return,
        };
        match accepted {
            Ok((stream, peer)) => {
                let done = done.clone();
                tokio::spawn(async move {
                    let r = handshake(stream, mine, &limits).await;
                    drop(permit);
                    let r = r
                        .map(|established| Connected { established, peer })
                        .map_err(ShmError::from);
                    let _ = done.send(r).await;
                });
            }
            Err(e) => {
                // The listening socket failed: report it and stop.
                let _ = done.send(Err(ShmError::Socket(e))).await;
                return;
            }
        }
    }
}

impl ShmListener {
    /// Listens on `path` with transport-uds's `uds` settings (socket file mode, allowed uids,
    /// backlog; its framing settings are not used), announcing `mine` to every peer and
    /// holding peers to `limits`.
    ///
    /// Fails with [`ShmError::Socket`] as transport-uds's `listen` does (`AddrInUse` for a path
    /// another listener holds or that is not a stale socket), and with [`ShmError::Setup`] if
    /// `mine` is not a valid ring size, before binding. Needs a tokio runtime.
    pub async fn bind(
        path: impl AsRef<Path>,
        uds: UdsConfig,
        mine: Hello,
        limits: Limits,
    ) -> Result<ShmListener, ShmError> {
        mine.layout()?;
        let addr = UdsAddr(path.as_ref().to_path_buf());
        let inner = UdsTransport::new(uds).listen(&addr).await?;
        let (tx, done) = mpsc::channel(MAX_CONCURRENT_SETUPS);
        let task = tokio::spawn(accept_loop(inner, mine, limits, tx));
        Ok(ShmListener { addr, done, task })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        self.addr.path()
    }

    /// The next peer whose set-up ended, in the order they ended. Set-ups run in the
    /// background from the moment the listener is bound (so a client's `connect` completes
    /// before this is called, as with a plain socket), several at once, each within
    /// [`Limits::timeout`]; peers whose uid is not allowed are closed and skipped.
    ///
    /// A peer that failed its set-up is an error ([`ShmError::Setup`]) and its socket is
    /// closed; the listener is still good for the next `accept`. Cancel safe: a set-up done
    /// waits for the next call.
    pub async fn accept(&mut self) -> Result<Connected, ShmError> {
        match self.done.recv().await {
            Some(r) => r,
            // The accept task ended after reporting why (a socket error), or was stopped.
            None => Err(ShmError::Socket(TransportError::Closed)),
        }
    }
}

/// Connects to the [`ShmListener`] at `path` and sets up the connection, announcing `mine` and
/// holding the listener to `limits`.
///
/// ```no_run
/// # async fn demo() -> Result<(), transport_shm::connect::ShmError> {
/// use transport_shm::connect::connect;
/// use transport_shm::setup::{Hello, Limits};
///
/// let connection = connect("/run/app/shm.sock", Hello::ring(256), &Limits::default()).await?;
/// let (mine, theirs) = (connection.established.mine, connection.established.theirs);
/// # Ok(()) }
/// ```
///
/// Reaching the socket takes at most [`Limits::timeout`] ([`ShmError::ConnectTimedOut`]), and
/// the set-up at most that again. A listener that does not allow this process's uid closes the
/// connection at once: [`ShmError::Refused`].
pub async fn connect(
    path: impl AsRef<Path>,
    mine: Hello,
    limits: &Limits,
) -> Result<Connected, ShmError> {
    let addr = UdsAddr(path.as_ref().to_path_buf());
    let stream = tokio::time::timeout(
        limits.timeout,
        UdsTransport::default().connect_stream(&addr),
    )
    .await
    .map_err(|_| ShmError::ConnectTimedOut(limits.timeout))??;
    let peer = PeerCredentials::of(&stream);
    match handshake(stream, mine, limits).await {
        Ok(established) => Ok(Connected { established, peer }),
        Err(e) if closed_before_hello(&e) => Err(ShmError::Refused(e)),
        Err(e) => Err(e.into()),
    }
}

/// Whether the set-up failed because the peer closed the socket before any byte of its hello:
/// the end of the stream at once, or the kernel's report that the peer closed with our hello
/// unread (a reset on receive, a broken pipe on send).
fn closed_before_hello(e: &SetupError) -> bool {
    match e {
        SetupError::Closed(0) => true,
        SetupError::Io(e) => matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        ),
        _ => false,
    }
}
