//! What the integration tests share: the bound on every wait, a connected pair, payloads.
#![allow(dead_code)] // each test file uses a part

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use transport_core::{HeaderBytes, Listener, Transport};
use transport_shm::conn::{ShmConfig, ShmConnection};
use transport_shm::ShmTransport;

/// The bound on every wait: generous, since only a broken test waits that long.
pub const WAIT: Duration = Duration::from_secs(20);

/// `f`, failing the test if it is not done within [`WAIT`].
pub async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: not done within {WAIT:?}"))
}

/// A connected pair (client, server) on a fresh socket path, with each side's settings.
pub async fn pair(
    client: ShmConfig,
    server: ShmConfig,
) -> (ShmConnection, ShmConnection, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let addr = dir
        .path()
        .join("shm.sock")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let mut listener = ShmTransport::new(server)
        .listen(&addr)
        .await
        .expect("listen");
    let client = ShmTransport::new(client);
    let (c, s) = bounded("connect and accept", async {
        tokio::join!(client.connect(&addr), listener.accept())
    })
    .await;
    (c.expect("connect"), s.expect("accept"), dir)
}

/// A header of these bytes.
pub fn header(b: &[u8]) -> HeaderBytes {
    HeaderBytes::new(b).unwrap()
}

/// `n` bytes of a pattern that differs with `seed`.
pub fn pattern(n: usize, seed: u8) -> Bytes {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Settings that never spin: every wait is a sleep on the doorbell.
pub fn sleepy(max: usize) -> ShmConfig {
    ShmConfig {
        spin: Duration::ZERO,
        ..ShmConfig::with_max_message_size(max)
    }
}
