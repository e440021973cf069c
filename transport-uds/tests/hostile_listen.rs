//! Listening on a Unix socket path that others may also use, and peers that should not be
//! served: each test fails if the defence it names is taken away.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener as StdUnixListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use socket2::{Domain, SockAddr, Socket, Type};
use tokio::time::timeout;
use transport_core::{
    Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport,
    TransportError,
};
use transport_uds::{PeerCredentialsExt, UdsAddr, UdsConfig, UdsListener, UdsTransport};

/// The bound on every wait: generous, since only a broken defence makes a test wait at all.
const WAIT: Duration = Duration::from_secs(10);

fn socket_path(dir: &tempfile::TempDir) -> UdsAddr {
    UdsAddr(dir.path().join("s.sock"))
}

fn inode(path: &Path) -> u64 {
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .ino()
}

fn io_kind(e: TransportError) -> io::ErrorKind {
    match e {
        TransportError::Io(e) => e.kind(),
        other => panic!("expected an I/O error, got {other:?}"),
    }
}

fn our_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

fn our_gid() -> u32 {
    // SAFETY: getgid has no preconditions and cannot fail.
    unsafe { libc::getgid() }
}

/// A listening socket at `path` that knows nothing of the lock file, with this backlog.
fn foreign_listener(path: &Path, backlog: i32) -> Socket {
    let s = Socket::new(Domain::UNIX, Type::STREAM, None).expect("socket");
    s.bind(&SockAddr::unix(path).expect("address"))
        .expect("bind");
    s.listen(backlog).expect("listen");
    s.set_nonblocking(true).expect("nonblocking");
    s
}

/// Connects non-blocking until the kernel refuses with `WouldBlock` (the listener's backlog is
/// full); returns the queued connections, which must stay open to keep it full.
fn fill_backlog(path: &Path) -> Vec<Socket> {
    let addr = SockAddr::unix(path).expect("address");
    let mut queued = Vec::new();
    for _ in 0..256 {
        let s = Socket::new(Domain::UNIX, Type::STREAM, None).expect("socket");
        s.set_nonblocking(true).expect("nonblocking");
        match s.connect(&addr) {
            Ok(()) => queued.push(s),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return queued,
            Err(e) => panic!("connect while filling the backlog: {e}"),
        }
    }
    panic!(
        "the backlog never filled after {} connections",
        queued.len()
    );
}

/// Holds an exclusive flock on `path` (created if missing), like a listener would.
fn hold_lock(path: &Path) -> File {
    let f = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .expect("open the lock file");
    // SAFETY: flock touches no memory of ours; `f` keeps the descriptor open for the call.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(r, 0, "flock: {}", io::Error::last_os_error());
    f
}

fn ping() -> Message {
    Message::new(HeaderBytes::new(b"ping").unwrap(), Bytes::from_static(b"x"))
}

/// One message from a fresh client is answered by the next connection `listener` accepts.
async fn serves(uds: &UdsTransport, addr: &UdsAddr, listener: &mut UdsListener) {
    let client = timeout(WAIT, uds.connect(addr))
        .await
        .expect("connect in time")
        .expect("connect");
    let server = timeout(WAIT, listener.accept())
        .await
        .expect("accept in time")
        .expect("accept");
    let (mut ctx, mut crx) = client.split();
    let (mut stx, mut srx) = server.split();
    ctx.send(ping()).await.expect("send");
    let m = timeout(WAIT, srx.recv())
        .await
        .expect("recv in time")
        .expect("recv")
        .expect("a message");
    stx.send(m).await.expect("echo");
    let echoed = timeout(WAIT, crx.recv())
        .await
        .expect("echo in time")
        .expect("recv echo")
        .expect("an echo");
    assert_eq!(&echoed.payload[..], b"x");
}

#[tokio::test]
async fn live_listener_with_full_backlog_is_never_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let addr = socket_path(&dir);
    let uds = UdsTransport::new(UdsConfig::default().with_backlog(2));
    let mut first = uds.listen(&addr).await.expect("first listen");
    let before = inode(&addr.0);
    let queued = fill_backlog(&addr.0);

    let second = uds.listen(&addr).await;
    let err = second.expect_err("a second listener must not take over");
    assert_eq!(io_kind(err), io::ErrorKind::AddrInUse);
    assert_eq!(inode(&addr.0), before, "the live socket file was replaced");

    // The first listener still owns the path: it accepts what is queued, then new clients.
    for _ in 0..queued.len() {
        timeout(WAIT, first.accept())
            .await
            .expect("accept in time")
            .expect("accept a queued connection");
    }
    drop(queued);
    serves(&uds, &addr, &mut first).await;
}

#[tokio::test]
async fn held_lock_protects_even_a_stale_socket() {
    let dir = tempfile::tempdir().unwrap();
    let addr = socket_path(&dir);
    drop(StdUnixListener::bind(&addr.0).expect("bind a socket to leave behind"));
    let before = inode(&addr.0);
    let lock = hold_lock(&addr.lock_path());

    let uds = UdsTransport::default();
    let err = uds.listen(&addr).await.expect_err("the lock is held");
    assert_eq!(io_kind(err), io::ErrorKind::AddrInUse);
    assert_eq!(
        inode(&addr.0),
        before,
        "a socket was removed under a held lock"
    );

    drop(lock);
    let mut listener = uds
        .listen(&addr)
        .await
        .expect("listen once the lock is free");
    serves(&uds, &addr, &mut listener).await;
}

#[tokio::test]
async fn foreign_live_listener_is_never_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let addr = socket_path(&dir);
    let foreign = foreign_listener(&addr.0, 2);
    let before = inode(&addr.0);
    let uds = UdsTransport::default();

    // Room in its backlog: the probe connects, so it is live.
    let err = uds.listen(&addr).await.expect_err("a live listener");
    assert_eq!(io_kind(err), io::ErrorKind::AddrInUse);
    assert_eq!(inode(&addr.0), before);

    // Backlog full: connecting would block, which is not stale either.
    let queued = fill_backlog(&addr.0);
    let err = uds
        .listen(&addr)
        .await
        .expect_err("a live listener, backlog full");
    assert_eq!(io_kind(err), io::ErrorKind::AddrInUse);
    assert_eq!(inode(&addr.0), before, "a live socket file was replaced");
    foreign
        .accept()
        .expect("the foreign listener still has its connections");
    drop(queued);
}

#[tokio::test]
async fn stale_socket_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let addr = socket_path(&dir);
    // std does not remove the file when the listener goes: a crashed server's leftover.
    drop(StdUnixListener::bind(&addr.0).expect("bind a socket to leave behind"));
    assert!(std::fs::symlink_metadata(&addr.0).is_ok());

    let uds = UdsTransport::default();
    let mut listener = uds.listen(&addr).await.expect("replace the stale socket");
    serves(&uds, &addr, &mut listener).await;
}

#[tokio::test]
async fn non_socket_at_the_path_is_never_removed() {
    let dir = tempfile::tempdir().unwrap();
    let uds = UdsTransport::default();

    let file = UdsAddr(dir.path().join("file"));
    std::fs::write(&file.0, b"precious").unwrap();
    let err = uds
        .listen(&file)
        .await
        .expect_err("a regular file is not a socket");
    assert_eq!(io_kind(err), io::ErrorKind::AddrInUse);
    assert_eq!(std::fs::read(&file.0).unwrap(), b"precious");

    // A symlink, even to a stale socket, is not a socket: neither it nor its target goes.
    let target = dir.path().join("stale.sock");
    drop(StdUnixListener::bind(&target).unwrap());
    let link = UdsAddr(dir.path().join("link"));
    std::os::unix::fs::symlink(&target, &link.0).unwrap();
    let err = uds
        .listen(&link)
        .await
        .expect_err("a symlink is not a socket");
    assert_eq!(io_kind(err), io::ErrorKind::AddrInUse);
    assert!(std::fs::symlink_metadata(&link.0).unwrap().is_symlink());
    assert!(std::fs::symlink_metadata(&target).is_ok());
}

#[tokio::test]
async fn drop_removes_only_its_own_socket_file() {
    let dir = tempfile::tempdir().unwrap();
    let addr = socket_path(&dir);
    let uds = UdsTransport::default();
    let a = uds.listen(&addr).await.expect("listen");

    // Someone else now serves this path with their own socket.
    std::fs::remove_file(&addr.0).unwrap();
    let other = StdUnixListener::bind(&addr.0).expect("bind the replacement");
    let theirs = inode(&addr.0);
    drop(a);

    assert_eq!(
        inode(&addr.0),
        theirs,
        "the listener removed a file it did not create"
    );
    std::os::unix::net::UnixStream::connect(&addr.0).expect("the replacement still serves");
    drop(other);
}

#[tokio::test]
async fn drop_leaves_a_successors_socket_and_lock() {
    let dir = tempfile::tempdir().unwrap();
    let addr = socket_path(&dir);
    let lock = addr.lock_path();
    let uds = UdsTransport::default();
    let a = uds.listen(&addr).await.expect("listen A");

    // Both files removed behind A's back: B starts with new ones.
    std::fs::remove_file(&addr.0).unwrap();
    std::fs::remove_file(&lock).unwrap();
    let mut b = uds.listen(&addr).await.expect("listen B");
    let (b_socket, b_lock) = (inode(&addr.0), inode(&lock));
    drop(a);

    assert_eq!(inode(&addr.0), b_socket, "A removed B's socket file");
    assert_eq!(inode(&lock), b_lock, "A removed B's lock file");
    let err = uds.listen(&addr).await.expect_err("B still holds the lock");
    assert_eq!(io_kind(err), io::ErrorKind::AddrInUse);
    serves(&uds, &addr, &mut b).await;

    drop(b);
    assert!(!addr.0.exists(), "B left its socket file");
    assert!(!lock.exists(), "B left its lock file");
}

#[tokio::test]
async fn socket_file_mode_is_the_configured_one() {
    let dir = tempfile::tempdir().unwrap();
    let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777;

    let addr = socket_path(&dir);
    let default = UdsTransport::default().listen(&addr).await.expect("listen");
    assert_eq!(mode(&addr.0), 0o600, "default socket mode");
    assert_eq!(
        mode(&addr.lock_path()) & 0o077,
        0,
        "the lock file is owner-only"
    );
    drop(default);

    let addr = UdsAddr(dir.path().join("group.sock"));
    let uds = UdsTransport::new(UdsConfig::default().with_mode(0o660));
    let _group = uds.listen(&addr).await.expect("listen 0o660");
    assert_eq!(mode(&addr.0), 0o660, "configured socket mode");

    let addr = UdsAddr(dir.path().join("bad.sock"));
    let uds = UdsTransport::new(UdsConfig::default().with_mode(0o4777));
    let err = uds.listen(&addr).await.expect_err("bits outside 0o777");
    assert_eq!(io_kind(err), io::ErrorKind::InvalidInput);
    assert!(!addr.0.exists());
}

#[tokio::test]
async fn peer_credentials_on_both_sides() {
    let dir = tempfile::tempdir().unwrap();
    let addr = socket_path(&dir);
    let uds = UdsTransport::default();
    let mut listener = uds.listen(&addr).await.expect("listen");
    let client = timeout(WAIT, uds.connect(&addr))
        .await
        .unwrap()
        .expect("connect");
    let server = timeout(WAIT, listener.accept())
        .await
        .unwrap()
        .expect("accept");

    for (side, conn) in [("accepted", &server), ("connected", &client)] {
        let c = conn
            .peer_credentials()
            .unwrap_or_else(|| panic!("{side}: no credentials"));
        assert_eq!(c.uid, our_uid(), "{side}: uid");
        assert_eq!(c.gid, our_gid(), "{side}: gid");
        assert_eq!(c.pid, Some(std::process::id()), "{side}: pid");
    }
}

#[tokio::test]
async fn peers_outside_allowed_uids_are_closed_and_accept_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let addr = socket_path(&dir);
    let not_us = our_uid().wrapping_add(1);
    let uds = UdsTransport::new(UdsConfig::default().with_allowed_uids([not_us]));
    let mut listener = uds.listen(&addr).await.expect("listen");

    // Two clients in a row: each is closed without an answer, and accept neither returns the
    // connection nor fails, so one rejection does not stop the listener.
    for _ in 0..2 {
        let client = timeout(WAIT, uds.connect(&addr))
            .await
            .unwrap()
            .expect("connect");
        let (mut tx, mut rx) = client.split();
        let _ = tx.send(ping()).await;
        tokio::select! {
            r = listener.accept() => panic!("accept returned a peer outside allowed_uids: {:?}", r.map(|c| c.peer())),
            r = timeout(WAIT, rx.recv()) => {
                let r = r.expect("the rejected client must see its connection closed in time");
                assert!(matches!(r, Ok(None) | Err(_)), "a rejected client got {r:?}");
            }
        }
    }
    drop(listener);

    let addr = UdsAddr(dir.path().join("us.sock"));
    let uds = UdsTransport::new(UdsConfig::default().with_allowed_uids([not_us, our_uid()]));
    let mut listener = uds.listen(&addr).await.expect("listen");
    serves(&uds, &addr, &mut listener).await;
}

/// `PathBuf`s are how callers build addresses too.
#[test]
fn lock_path_is_beside_the_socket() {
    let addr = UdsAddr::from(PathBuf::from("/run/app/s.sock"));
    assert_eq!(addr.lock_path(), PathBuf::from("/run/app/s.sock.lock"));
}
