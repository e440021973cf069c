//! The fault proxy of `bench soak --kill link`: a byte relay between each client connection
//! and its own connection to the server, which breaks a live connection on request.
//!
//! The proxy listens on a Unix socket or a TCP address and, for every connection it accepts,
//! opens one to the server and forwards bytes both ways as they come (full duplex, 64 KiB
//! buffered per direction, end of stream passed on as a shutdown of the write side). A
//! [`Fault`] sent with [`Proxy::inject`] goes to one live connection, in turn:
//!
//! - [`Fault::Rst`]: both sockets closed at once. On TCP `SO_LINGER` is set to zero first, so
//!   both peers get a RST (reads fail with `ConnectionReset`). A Unix socket has no RST: the
//!   same abrupt close shows as end of stream, or as `ConnectionReset` when the proxy's socket
//!   still held unread bytes (Linux).
//! - [`Fault::HalfClose`]: the write side toward one peer is shut down (it reads end of
//!   stream) and what the other peer sends it from then on is dropped; the other direction
//!   keeps flowing. Once that direction ends too (the peer that read end of stream closes), the
//!   proxy closes both sockets.
//! - [`Fault::Cut`]: the next chunk longer than 16 bytes read for one peer is forwarded in
//!   part (half of it), then both sockets are closed: that peer sees its stream end inside a
//!   frame (the soak's requests and replies of 64 KiB and 1 MiB arrive in many chunks).
//!
//! Faults are counted when applied ([`FaultCounts`]): one sent to a connection that ends
//! first, or a cut that never sees a long enough chunk, is not.

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};

/// Bytes buffered per direction of a proxied connection.
const BUF: usize = 64 << 10;
/// A cut waits for a chunk longer than this: the part forwarded then ends inside a frame.
const CUT_ABOVE: usize = 16;
/// How long the proxy waits for the server to accept its connection.
const CONNECT_BOUND: Duration = Duration::from_secs(5);

/// Where the proxy listens, or the server it forwards to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// A Unix socket's path.
    Unix(PathBuf),
    /// A TCP address.
    Tcp(SocketAddr),
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "{}", p.display()),
            Endpoint::Tcp(a) => write!(f, "{a}"),
        }
    }
}

/// The peer a fault is aimed at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Toward {
    /// The server the proxy connected to.
    Server,
    /// The client that connected to the proxy.
    Client,
}

/// A fault the proxy injects into one live connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Both sockets closed abruptly (a RST on TCP).
    Rst,
    /// The write side toward this peer shut down; the other direction keeps flowing.
    HalfClose(Toward),
    /// Part of the next chunk (longer than 16 bytes) toward this peer, then both sockets closed.
    Cut(Toward),
}

/// The faults a proxy applied, by kind.
#[derive(Debug, Default)]
pub struct FaultCounts {
    rst: AtomicU64,
    half_close: AtomicU64,
    cut: AtomicU64,
    /// Every fault applied: shared with whoever wants to know whether a connection was made
    /// after a fault (the soak's clients).
    applied: Arc<AtomicU64>,
}

impl FaultCounts {
    /// RSTs (abrupt closes of both sockets) applied.
    pub fn rst(&self) -> u64 {
        self.rst.load(Ordering::SeqCst)
    }

    /// Half-closes applied (either direction).
    pub fn half_close(&self) -> u64 {
        self.half_close.load(Ordering::SeqCst)
    }

    /// Cuts applied (a part of a chunk forwarded, then both sockets closed).
    pub fn cut(&self) -> u64 {
        self.cut.load(Ordering::SeqCst)
    }

    /// The count of every fault applied, as a shared counter that grows with each.
    pub fn applied(&self) -> Arc<AtomicU64> {
        self.applied.clone()
    }

    fn count(&self, fault: Fault) {
        let kind = match fault {
            Fault::Rst => &self.rst,
            Fault::HalfClose(_) => &self.half_close,
            Fault::Cut(_) => &self.cut,
        };
        kind.fetch_add(1, Ordering::SeqCst);
        self.applied.fetch_add(1, Ordering::SeqCst);
    }
}

/// What the accept task and the connection tasks share.
struct Shared {
    upstream: Endpoint,
    /// The live connections' fault inboxes, by connection number.
    conns: Mutex<BTreeMap<u64, mpsc::UnboundedSender<Fault>>>,
    /// Live connections (a watch, so that [`Proxy::idle`] waits without polling).
    live: watch::Sender<usize>,
    counts: FaultCounts,
    next_id: AtomicU64,
    /// Which connection the next fault goes to (round robin).
    turn: AtomicU64,
}

impl Shared {
    fn conns(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, mpsc::UnboundedSender<Fault>>> {
        // A poisoned lock only means a panic elsewhere while holding it; the map stays valid.
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A live connection's entry in the proxy; removed (and the live count lowered) on drop,
/// however the connection's task ends.
struct Registered {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.shared.conns().remove(&self.id);
        self.shared.live.send_modify(|n| *n -= 1);
    }
}

/// A running fault proxy. Dropping it stops accepting; connections being relayed go on
/// until they end ([`Proxy::idle`] waits for that).
pub struct Proxy {
    local: Endpoint,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens at `listen` (a TCP port 0 is chosen by the system: see [`Proxy::local`]) and
    /// relays every connection to `upstream`.
    pub async fn start(listen: &Endpoint, upstream: Endpoint) -> io::Result<Proxy> {
        let (listener, local) = match listen {
            Endpoint::Unix(p) => (Listening::Unix(UnixListener::bind(p)?), listen.clone()),
            Endpoint::Tcp(a) => {
                let l = TcpListener::bind(a).await?;
                let at = l.local_addr()?;
                (Listening::Tcp(l), Endpoint::Tcp(at))
            }
        };
        let shared = Arc::new(Shared {
            upstream,
            conns: Mutex::default(),
            live: watch::Sender::new(0),
            counts: FaultCounts::default(),
            next_id: AtomicU64::new(0),
            turn: AtomicU64::new(0),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Proxy {
            local,
            shared,
            accept,
        })
    }

    /// Where clients connect.
    pub fn local(&self) -> &Endpoint {
        &self.local
    }

    /// Sends `fault` to one live connection (in turn); false if there is none. The fault is
    /// applied by the connection's task (and counted in [`Proxy::counts`] then).
    pub fn inject(&self, fault: Fault) -> bool {
        let conns = self.shared.conns();
        if conns.is_empty() {
            return false;
        }
        let start = self.shared.turn.fetch_add(1, Ordering::Relaxed) as usize;
        // A connection whose task just ended may still be listed: try the next.
        (0..conns.len()).any(|k| {
            let inbox = conns.values().nth((start + k) % conns.len());
            inbox.is_some_and(|i| i.send(fault).is_ok())
        })
    }

    /// The faults applied so far.
    pub fn counts(&self) -> &FaultCounts {
        &self.shared.counts
    }

    /// Connections being relayed now.
    pub fn live(&self) -> usize {
        *self.shared.live.borrow()
    }

    /// Waits until no connection is being relayed.
    pub async fn idle(&self) {
        let mut live = self.shared.live.subscribe();
        // The sender lives in `self.shared`: the wait cannot fail while `self` is borrowed.
        let _ = live.wait_for(|n| *n == 0).await;
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

enum Listening {
    Unix(UnixListener),
    Tcp(TcpListener),
}

async fn accept_loop(listener: Listening, shared: Arc<Shared>) {
    loop {
        let accepted = match &listener {
            Listening::Unix(l) => l.accept().await.map(|(s, _)| Sock::Unix(s)),
            Listening::Tcp(l) => l.accept().await.map(|(s, _)| {
                let _ = s.set_nodelay(true);
                Sock::Tcp(s)
            }),
        };
        let client = match accepted {
            Ok(c) => c,
            Err(_) => {
                // Out of descriptors, or a connection reset before it was accepted: go on.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        // Registered before the server is connected: a fault sent from now on is applied
        // before the first byte is relayed.
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (inbox, faults) = mpsc::unbounded_channel();
        shared.conns().insert(id, inbox);
        shared.live.send_modify(|n| *n += 1);
        let registered = Registered {
            shared: shared.clone(),
            id,
        };
        tokio::spawn(relay(client, faults, registered));
    }
}

/// One end of a proxied connection.
enum Sock {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Sock {
    async fn connect(to: &Endpoint) -> io::Result<Sock> {
        match to {
            Endpoint::Unix(p) => Ok(Sock::Unix(UnixStream::connect(p).await?)),
            Endpoint::Tcp(a) => {
                let s = TcpStream::connect(a).await?;
                let _ = s.set_nodelay(true);
                Ok(Sock::Tcp(s))
            }
        }
    }

    async fn readable(&self) -> io::Result<()> {
        match self {
            Sock::Unix(s) => s.readable().await,
            Sock::Tcp(s) => s.readable().await,
        }
    }

    async fn writable(&self) -> io::Result<()> {
        match self {
            Sock::Unix(s) => s.writable().await,
            Sock::Tcp(s) => s.writable().await,
        }
    }

    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Sock::Unix(s) => s.try_read(buf),
            Sock::Tcp(s) => s.try_read(buf),
        }
    }

    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Sock::Unix(s) => s.try_write(buf),
            Sock::Tcp(s) => s.try_write(buf),
        }
    }

    /// Shuts the write side down: the peer reads end of stream.
    async fn shutdown_write(&mut self) {
        // The peer may be gone already: nothing more to tell it then.
        let _ = match self {
            Sock::Unix(s) => s.shutdown().await,
            Sock::Tcp(s) => s.shutdown().await,
        };
    }

    /// Closes the socket so that a TCP peer gets a RST (a Unix socket is just closed).
    fn reset(self) {
        if let Sock::Tcp(s) = &self {
            let _ = s.set_zero_linger();
        }
    }
}

/// One direction of a proxied connection: bytes read from one socket, not yet written to
/// the other.
struct Pipe {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// The source sent end of stream (or was given up after a half-close).
    eof: bool,
    /// The destination's write side is shut down.
    shut: bool,
    /// After a half-close toward the destination: what the source sends is dropped.
    discard: bool,
    /// A cut is armed: the next chunk longer than [`CUT_ABOVE`] is forwarded in part.
    cut_armed: bool,
    /// A cut was applied: both sockets close once its part is written.
    close_when_flushed: bool,
}

impl Pipe {
    fn new() -> Pipe {
        Pipe {
            buf: vec![0; BUF].into_boxed_slice(),
            start: 0,
            end: 0,
            eof: false,
            shut: false,
            discard: false,
            cut_armed: false,
            close_when_flushed: false,
        }
    }

    fn wants_read(&self) -> bool {
        !self.eof && self.start == self.end && !self.close_when_flushed
    }

    fn has_data(&self) -> bool {
        self.start < self.end
    }
}

/// What happened in one turn of a relay.
enum Event {
    Fault(Fault),
    /// Readable (`true`: the client, toward the server) or writable (`true`: the server).
    Readable(bool, io::Result<()>),
    Writable(bool, io::Result<()>),
}

/// How a relay goes on after a turn.
enum Next {
    Go,
    /// Both sockets closed gracefully (end of stream, or end of stream inside a frame).
    Close,
    /// Both sockets closed abruptly.
    Reset,
}

/// Relays one client connection to its own server connection until both directions end or a
/// fault ends it.
async fn relay(
    mut client: Sock,
    mut faults: mpsc::UnboundedReceiver<Fault>,
    registered: Registered,
) {
    let shared = registered.shared.clone();
    let mut server =
        match tokio::time::timeout(CONNECT_BOUND, Sock::connect(&shared.upstream)).await {
            Ok(Ok(s)) => s,
            // No server: the client's connection ends (it reads end of stream).
            _ => return,
        };
    let counts = &shared.counts;
    // `up`: client to server; `down`: server to client.
    let (mut up, mut down) = (Pipe::new(), Pipe::new());
    let next = loop {
        if up.shut && down.shut {
            break Next::Close;
        }
        let event = tokio::select! {
            biased;
            Some(f) = faults.recv() => Event::Fault(f),
            r = client.readable(), if up.wants_read() => Event::Readable(true, r),
            r = server.writable(), if up.has_data() => Event::Writable(true, r),
            r = server.readable(), if down.wants_read() => Event::Readable(false, r),
            r = client.writable(), if down.has_data() => Event::Writable(false, r),
            else => break Next::Close,
        };
        let step = match event {
            Event::Fault(Fault::Rst) => {
                counts.count(Fault::Rst);
                Next::Reset
            }
            Event::Fault(f @ Fault::HalfClose(toward)) => {
                let (pipe, to) = match toward {
                    Toward::Server => (&mut up, &mut server),
                    Toward::Client => (&mut down, &mut client),
                };
                if !pipe.shut {
                    counts.count(f);
                    pipe.discard = true;
                    (pipe.start, pipe.end) = (0, 0);
                    pipe.shut = true;
                    to.shutdown_write().await;
                }
                Next::Go
            }
            Event::Fault(Fault::Cut(toward)) => {
                match toward {
                    Toward::Server => up.cut_armed = true,
                    Toward::Client => down.cut_armed = true,
                }
                Next::Go
            }
            Event::Readable(from_client, r) => {
                let (pipe, from, toward) = if from_client {
                    (&mut up, &client, Toward::Server)
                } else {
                    (&mut down, &server, Toward::Client)
                };
                read_into(pipe, from, r, counts, toward)
            }
            Event::Writable(to_server, r) => {
                let (pipe, to) = if to_server {
                    (&mut up, &server)
                } else {
                    (&mut down, &client)
                };
                write_from(pipe, to, r)
            }
        };
        match step {
            Next::Go => {}
            other => break other,
        }
        // End of stream passes on once what came before it is written.
        for (pipe, to) in [(&mut up, &mut server), (&mut down, &mut client)] {
            if pipe.eof && !pipe.has_data() && !pipe.shut {
                pipe.shut = true;
                to.shutdown_write().await;
            }
        }
    };
    if let Next::Reset = next {
        client.reset();
        server.reset();
    }
    // Both sockets close here (dropped), then `registered` takes the connection off the list.
}

/// Reads what `from` has into `pipe`, bound `toward` the other peer (after `readable` said
/// `r`).
fn read_into(
    pipe: &mut Pipe,
    from: &Sock,
    r: io::Result<()>,
    counts: &FaultCounts,
    toward: Toward,
) -> Next {
    if r.is_err() {
        return Next::Close;
    }
    match from.try_read(&mut pipe.buf) {
        Ok(0) => {
            pipe.eof = true;
            Next::Go
        }
        Ok(_) if pipe.discard => Next::Go,
        Ok(n) => {
            let n = if pipe.cut_armed && n > CUT_ABOVE {
                pipe.cut_armed = false;
                pipe.close_when_flushed = true;
                counts.count(Fault::Cut(toward));
                (n / 2).max(1)
            } else {
                n
            };
            (pipe.start, pipe.end) = (0, n);
            Next::Go
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Next::Go,
        // Reset or broken: the relay ends, both sockets close.
        Err(_) => Next::Close,
    }
}

/// Writes what `pipe` holds to `to` (after `writable` said `r`).
fn write_from(pipe: &mut Pipe, to: &Sock, r: io::Result<()>) -> Next {
    if r.is_err() {
        return Next::Close;
    }
    match to.try_write(&pipe.buf[pipe.start..pipe.end]) {
        Ok(n) => {
            pipe.start += n;
            if pipe.start == pipe.end {
                (pipe.start, pipe.end) = (0, 0);
                if pipe.close_when_flushed {
                    return Next::Close;
                }
            }
            Next::Go
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Next::Go,
        Err(_) => Next::Close,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};

    /// Every wait in these tests ends by then.
    const BOUND: Duration = Duration::from_secs(10);

    async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
        match tokio::time::timeout(BOUND, f).await {
            Ok(v) => v,
            Err(_) => panic!("{what}: not within {BOUND:?}"),
        }
    }

    trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
    impl<S: AsyncRead + AsyncWrite + Unpin + Send> Stream for S {}

    /// A proxy in front of a plain listener, one client connected through it, and the
    /// server's end of that connection.
    struct Setup {
        proxy: Proxy,
        client: Box<dyn Stream>,
        server: Box<dyn Stream>,
        _dir: tempfile::TempDir,
    }

    async fn setup(tcp: bool) -> Setup {
        let dir = tempfile::tempdir().expect("a temporary directory");
        if tcp {
            let upstream = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let at = Endpoint::Tcp(upstream.local_addr().expect("an address"));
            let any = Endpoint::Tcp("127.0.0.1:0".parse().expect("an address"));
            let proxy = Proxy::start(&any, at).await.expect("proxy");
            let Endpoint::Tcp(local) = proxy.local().clone() else {
                panic!("a TCP proxy listens on TCP")
            };
            let client = within("connect", TcpStream::connect(local))
                .await
                .expect("connect");
            let (server, _) = within("accept", upstream.accept()).await.expect("accept");
            Setup {
                proxy,
                client: Box::new(client),
                server: Box::new(server),
                _dir: dir,
            }
        } else {
            let (up, at) = (
                dir.path().join("server.sock"),
                dir.path().join("proxy.sock"),
            );
            let upstream = UnixListener::bind(&up).expect("bind");
            let proxy = Proxy::start(&Endpoint::Unix(at.clone()), Endpoint::Unix(up))
                .await
                .expect("proxy");
            let client = within("connect", UnixStream::connect(&at))
                .await
                .expect("connect");
            let (server, _) = within("accept", upstream.accept()).await.expect("accept");
            Setup {
                proxy,
                client: Box::new(client),
                server: Box::new(server),
                _dir: dir,
            }
        }
    }

    /// Everything `s` sends until its end of stream (or the error that ends it).
    async fn read_to_end(s: &mut (impl AsyncRead + Unpin)) -> (Vec<u8>, io::Result<()>) {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match within("read", s.read(&mut buf)).await {
                Ok(0) => return (got, Ok(())),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => return (got, Err(e)),
            }
        }
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    /// Without a fault the proxy is transparent: a megabyte each way, and an end of stream
    /// passed on in each direction; then the connection is no longer live.
    #[tokio::test]
    async fn relays_both_ways_and_passes_ends_of_stream_on() {
        for tcp in [false, true] {
            let Setup {
                proxy,
                mut client,
                mut server,
                _dir,
            } = setup(tcp).await;
            let sent = pattern(1 << 20);
            let (c, s) = tokio::join!(
                async {
                    client.write_all(&sent).await.expect("write");
                    client.shutdown().await.expect("shutdown");
                    client
                },
                read_to_end(&mut server),
            );
            client = c;
            assert!(s.1.is_ok(), "tcp {tcp}: {:?}", s.1);
            assert!(s.0 == sent, "tcp {tcp}: the server got other bytes");
            let ((), c) = tokio::join!(
                async {
                    server.write_all(&sent).await.expect("write");
                    server.shutdown().await.expect("shutdown");
                },
                read_to_end(&mut client),
            );
            assert!(
                c.1.is_ok() && c.0 == sent,
                "tcp {tcp}: the client got other bytes"
            );
            within("idle", proxy.idle()).await;
            assert_eq!(proxy.counts().applied().load(Ordering::SeqCst), 0);
        }
    }

    /// A cut forwards strictly fewer bytes than were sent, a prefix of them, then ends the
    /// stream; the other peer's connection ends too. Both directions, both socket kinds.
    #[tokio::test]
    async fn a_cut_delivers_a_strict_prefix_then_end_of_stream() {
        for tcp in [false, true] {
            for toward in [Toward::Server, Toward::Client] {
                let Setup {
                    proxy,
                    client,
                    server,
                    _dir,
                } = setup(tcp).await;
                let (mut sender, mut receiver) = match toward {
                    Toward::Server => (client, server),
                    Toward::Client => (server, client),
                };
                assert!(proxy.inject(Fault::Cut(toward)));
                let sent = pattern(1000);
                sender.write_all(&sent).await.expect("write");
                let (got, end) = read_to_end(&mut receiver).await;
                let what = format!("tcp {tcp}, toward {toward:?}");
                assert!(end.is_ok(), "{what}: {end:?}, not end of stream");
                assert!(
                    !got.is_empty() && got.len() < sent.len(),
                    "{what}: {}",
                    got.len()
                );
                assert_eq!(got[..], sent[..got.len()], "{what}");
                // The sender's side closes as well (end of stream or a reset).
                let _ = read_to_end(&mut sender).await;
                within("idle", proxy.idle()).await;
                assert_eq!(
                    (proxy.counts().cut(), proxy.counts().rst()),
                    (1, 0),
                    "{what}"
                );
            }
        }
    }

    /// An RST on TCP: both peers' reads fail with `ConnectionReset`.
    #[tokio::test]
    async fn an_rst_on_tcp_resets_both_peers() {
        let Setup {
            proxy,
            mut client,
            mut server,
            _dir,
        } = setup(true).await;
        assert!(proxy.inject(Fault::Rst));
        for (who, s) in [("server", &mut server), ("client", &mut client)] {
            let (got, end) = read_to_end(s).await;
            assert!(got.is_empty(), "{who}");
            let kind = end.map_err(|e| e.kind());
            assert_eq!(kind, Err(io::ErrorKind::ConnectionReset), "{who}");
        }
        within("idle", proxy.idle()).await;
        assert_eq!(proxy.counts().rst(), 1);
    }

    /// An RST on a Unix socket is an abrupt close: both peers' connections end.
    #[tokio::test]
    async fn an_rst_on_uds_closes_both_peers() {
        let Setup {
            proxy,
            mut client,
            mut server,
            _dir,
        } = setup(false).await;
        assert!(proxy.inject(Fault::Rst));
        for s in [&mut server, &mut client] {
            let (got, _) = read_to_end(s).await;
            assert!(got.is_empty());
        }
        within("idle", proxy.idle()).await;
        assert_eq!(proxy.counts().rst(), 1);
    }

    /// A half-close toward the server: the server reads end of stream while its replies still
    /// reach the client; when the server closes, the client's connection ends.
    #[tokio::test]
    async fn a_half_close_toward_the_server_keeps_replies_flowing() {
        for tcp in [false, true] {
            let Setup {
                proxy,
                mut client,
                mut server,
                _dir,
            } = setup(tcp).await;
            assert!(proxy.inject(Fault::HalfClose(Toward::Server)));
            let (got, end) = read_to_end(&mut server).await;
            assert!(got.is_empty() && end.is_ok(), "tcp {tcp}: {end:?}");
            let reply = pattern(100_000);
            server.write_all(&reply).await.expect("write");
            let mut back = vec![0; reply.len()];
            within("reply", client.read_exact(&mut back))
                .await
                .expect("the reply");
            assert!(back == reply, "tcp {tcp}");
            // What the client sends from now on goes nowhere, without blocking it.
            within("write", client.write_all(&pattern(1 << 20)))
                .await
                .expect("write");
            drop(server);
            let (got, _) = read_to_end(&mut client).await;
            assert!(got.is_empty(), "tcp {tcp}");
            within("idle", proxy.idle()).await;
            assert_eq!(proxy.counts().half_close(), 1);
        }
    }

    /// The mirror: the client reads end of stream while its requests still reach the server.
    #[tokio::test]
    async fn a_half_close_toward_the_client_keeps_requests_flowing() {
        for tcp in [false, true] {
            let Setup {
                proxy,
                mut client,
                mut server,
                _dir,
            } = setup(tcp).await;
            assert!(proxy.inject(Fault::HalfClose(Toward::Client)));
            let (got, end) = read_to_end(&mut client).await;
            assert!(got.is_empty() && end.is_ok(), "tcp {tcp}: {end:?}");
            let request = pattern(100_000);
            client.write_all(&request).await.expect("write");
            let mut there = vec![0; request.len()];
            within("request", server.read_exact(&mut there))
                .await
                .expect("the request");
            assert!(there == request, "tcp {tcp}");
            drop(client);
            let (got, end) = read_to_end(&mut server).await;
            assert!(got.is_empty() && end.is_ok(), "tcp {tcp}: {end:?}");
            drop(server);
            within("idle", proxy.idle()).await;
            assert_eq!(proxy.counts().half_close(), 1);
        }
    }

    /// A fault needs a live connection; none is counted unless applied.
    #[tokio::test]
    async fn a_fault_needs_a_live_connection() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let upstream = Endpoint::Unix(dir.path().join("nobody.sock"));
        let proxy = Proxy::start(&Endpoint::Unix(dir.path().join("p.sock")), upstream)
            .await
            .expect("proxy");
        assert!(!proxy.inject(Fault::Rst));
        assert_eq!(proxy.live(), 0);
        // With no server behind it, a client's connection just ends.
        let mut c = within("connect", UnixStream::connect(dir.path().join("p.sock")))
            .await
            .expect("connect");
        let (got, _) = read_to_end(&mut c).await;
        assert!(got.is_empty());
        within("idle", proxy.idle()).await;
        assert_eq!(proxy.counts().applied().load(Ordering::SeqCst), 0);
    }
}
