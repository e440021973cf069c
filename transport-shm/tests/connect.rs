//! A listener and clients in one runtime: set-ups over transport-uds's socket, its socket file,
//! refused uids, and peers that send no hello.

mod common;

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{bounded, WAIT};
use tokio::io::AsyncWriteExt;
use transport_shm::connect::{connect, Connected, ShmError, ShmListener, UdsConfig};
use transport_shm::ring::{Consumer, Producer, ENTRY_BYTES};
use transport_shm::setup::{Hello, Limits, SetupError};

fn limits(timeout: Duration) -> Limits {
    Limits {
        timeout,
        ..Limits::default()
    }
}

fn socket_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("shm.sock")
}

/// This process's uid: the owner of the temporary directory it just created.
fn our_uid(dir: &tempfile::TempDir) -> u32 {
    std::fs::metadata(dir.path()).unwrap().uid()
}

async fn listener(path: &Path, uds: UdsConfig, limits: Limits) -> ShmListener {
    ShmListener::bind(path, uds, Hello::ring(8), limits)
        .await
        .expect("bind")
}

/// An entry pushed on each side's ring is popped by the other side, across the two regions.
fn carry_entries_both_ways(server: Connected, client: Connected) {
    let (s, c) = (server.established, client.established);
    let mut s_tx = Producer::new(s.mine, s.my_layout.data()).unwrap();
    let mut s_rx = Consumer::new(s.theirs, s.their_layout.data()).unwrap();
    let mut c_tx = Producer::new(c.mine, c.my_layout.data()).unwrap();
    let mut c_rx = Consumer::new(c.theirs, c.their_layout.data()).unwrap();
    assert!(s_tx.try_push(&[0x5a; ENTRY_BYTES]).unwrap());
    assert!(c_tx.try_push(&[0xc3; ENTRY_BYTES]).unwrap());
    assert_eq!(c_rx.try_pop().unwrap(), Some([0x5a; ENTRY_BYTES]));
    assert_eq!(s_rx.try_pop().unwrap(), Some([0xc3; ENTRY_BYTES]));
    assert_eq!(c_rx.try_pop().unwrap(), None);
    assert_eq!(s_rx.try_pop().unwrap(), None);
}

/// One good client against `listener`: both set-ups succeed and carry entries.
async fn good_client_is_served(listener: &mut ShmListener) {
    let path = listener.path().to_path_buf();
    let client_limits = limits(WAIT);
    let (server, client) = bounded("set-up", async {
        tokio::join!(
            listener.accept(),
            connect(&path, Hello::ring(64), &client_limits)
        )
    })
    .await;
    carry_entries_both_ways(server.expect("accept"), client.expect("connect"));
}

#[tokio::test]
async fn a_listener_and_a_client_set_up_and_carry_entries_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    let uid = our_uid(&dir);
    let mut l = listener(
        &socket_path(&dir),
        UdsConfig::default().with_allowed_uids([uid]),
        limits(WAIT),
    )
    .await;
    let client_limits = limits(WAIT);
    let (server, client) = bounded("set-up", async {
        tokio::join!(
            l.accept(),
            connect(socket_path(&dir), Hello::ring(64), &client_limits)
        )
    })
    .await;
    let (server, client) = (server.expect("accept"), client.expect("connect"));
    let s = &server.established;
    let c = &client.established;
    assert_eq!(
        (
            s.my_layout.data().entries(),
            s.their_layout.data().entries()
        ),
        (8, 64)
    );
    assert_eq!(
        (
            c.my_layout.data().entries(),
            c.their_layout.data().entries()
        ),
        (64, 8)
    );
    assert_eq!(server.peer.map(|p| p.uid), Some(uid));
    assert_eq!(client.peer.map(|p| p.uid), Some(uid));
    carry_entries_both_ways(server, client);
}

#[tokio::test]
async fn the_socket_file_is_owner_only_and_removed_when_the_listener_drops() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_path(&dir);
    let l = listener(&path, UdsConfig::default(), limits(WAIT)).await;
    assert_eq!(l.path(), path);
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let lock = dir.path().join("shm.sock.lock");
    assert!(lock.exists(), "the listener holds its lock file");
    drop(l);
    // The accept task removes them as it ends, at the runtime's next turns.
    for _ in 0..10_000 {
        if !path.exists() && !lock.exists() {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(!path.exists(), "socket file left after drop");
    assert!(!lock.exists(), "lock file left after drop");
}

#[tokio::test]
async fn a_listener_whose_allowed_uids_exclude_ours_refuses_the_client_and_keeps_accepting() {
    let dir = tempfile::tempdir().unwrap();
    let uid = our_uid(&dir);
    let other = uid.wrapping_add(1);
    let mut refusing = listener(
        &socket_path(&dir),
        UdsConfig::default().with_allowed_uids([other]),
        limits(WAIT),
    )
    .await;
    // The listener runs on its own; a client it does not close would wait out its 2 s set-up
    // timeout and fail with `TimedOut`, not `Refused`.
    let path = refusing.path().to_path_buf();
    let accepting = tokio::spawn(async move { refusing.accept().await.map(|_| ()) });
    for i in 0..2 {
        let r = bounded(
            "refused client",
            connect(&path, Hello::ring(8), &limits(Duration::from_secs(2))),
        )
        .await;
        // The second client is refused too: the listener went on accepting after the first.
        assert!(
            matches!(r, Err(ShmError::Refused(_))),
            "client {i}: {:?}",
            r.map(|_| ())
        );
    }
    assert!(
        !accepting.is_finished(),
        "accept returned for a refused peer"
    );
    accepting.abort();
    assert!(accepting.await.unwrap_err().is_cancelled());

    // A listener that allows our uid, at another path, serves the same kind of client.
    let mut allowing = listener(
        &dir.path().join("allowing.sock"),
        UdsConfig::default().with_allowed_uids([uid]),
        limits(WAIT),
    )
    .await;
    good_client_is_served(&mut allowing).await;
}

#[tokio::test]
async fn garbage_or_silence_instead_of_a_hello_is_a_typed_error_and_the_listener_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_path(&dir);
    let mut l = listener(
        &path,
        UdsConfig::default(),
        limits(Duration::from_millis(300)),
    )
    .await;

    // Sixteen bytes that are not a hello; the socket stays open until the listener is done.
    let mut garbage = bounded("connect", tokio::net::UnixStream::connect(&path))
        .await
        .unwrap();
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n")
        .await
        .unwrap();
    let r = bounded("accept garbage", l.accept()).await;
    assert!(
        matches!(r, Err(ShmError::Setup(SetupError::BadMagic(m))) if m == *b"GET "),
        "{:?}",
        r.map(|_| ())
    );
    drop(garbage);

    // Nothing at all: the listener's 300 ms set-up limit ends it.
    let silent = bounded("connect", tokio::net::UnixStream::connect(&path))
        .await
        .unwrap();
    let r = bounded("accept silence", l.accept()).await;
    assert!(
        matches!(r, Err(ShmError::Setup(SetupError::TimedOut(t))) if t == Duration::from_millis(300)),
        "{:?}",
        r.map(|_| ())
    );
    drop(silent);

    good_client_is_served(&mut l).await;
}

#[tokio::test]
async fn connecting_where_nobody_listens_is_a_socket_error() {
    let dir = tempfile::tempdir().unwrap();
    let r = bounded(
        "connect",
        connect(socket_path(&dir), Hello::ring(8), &limits(WAIT)),
    )
    .await;
    assert!(matches!(r, Err(ShmError::Socket(_))), "{:?}", r.map(|_| ()));
}
