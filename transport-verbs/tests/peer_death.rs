//! A peer process killed (SIGKILL) during a rendezvous transfer: the receive fails promptly
//! with `Truncated` (how much of how much arrived) when the kill lands while the payload is
//! being read, never a hang and never a clean end. The READs may also finish before the kill
//! lands (the dying process's memory stays readable until the kernel tears down its queue
//! pair; on the soft-RoCE test bed this is the usual outcome): then the message is whole and
//! the next receive fails with the disconnect of a peer that never closed the connection,
//! `ConnectionReset`. Those two outcomes, exactly, are allowed.
//!
//! The peer is this test binary re-executed as a child (`peer_death_child` with
//! `VERBS_PEER_DEATH_ADDR` set): it connects and sends one 96 MiB message, then waits to be
//! killed while the parent is reading it.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use transport_core::{
    Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport,
    TransportError,
};
use transport_verbs::{VerbsConfig, VerbsTransport};

const CHILD_ENV: &str = "VERBS_PEER_DEATH_ADDR";
const SIZE: usize = 96 << 20;

/// The child's entry point; does nothing unless started by the parent test (which passes
/// `--include-ignored`).
#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn peer_death_child() {
    let Ok(addr) = std::env::var(CHILD_ENV) else {
        return;
    };
    common::run(async move {
        let verbs =
            VerbsTransport::new(VerbsConfig::with_max_message_size(128 << 20)).expect("transport");
        let conn = verbs
            .connect(&addr.parse().expect("address"))
            .await
            .expect("connect");
        let (mut tx, _rx) = conn.split();
        tx.send(Message::new(
            HeaderBytes::from([9u8]),
            Bytes::from(vec![5u8; SIZE]),
        ))
        .await
        .expect("send");
        // Wait to be killed (bounded, so an orphan cannot live on).
        tokio::time::sleep(Duration::from_secs(60)).await;
    });
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn peer_killed_mid_rendezvous_truncates_the_receive_or_resets_the_next() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let addr = common::listen_addr();
    common::run(async move {
        let verbs =
            VerbsTransport::new(VerbsConfig::with_max_message_size(128 << 20)).expect("transport");
        let mut listener = verbs.listen(&addr).await.expect("listen");
        let addr = listener.local_addr().expect("addr");
        let mut child = tokio::process::Command::new(std::env::current_exe().expect("exe"))
            .args([
                "peer_death_child",
                "--exact",
                "--nocapture",
                "--include-ignored",
            ])
            .env(CHILD_ENV, addr.to_string())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the peer");
        let conn = tokio::time::timeout(Duration::from_secs(60), listener.accept())
            .await
            .expect("the peer connected in time")
            .expect("accept");
        let metrics = conn.metrics();
        let (_tx, mut rx) = conn.split();
        // The first receive, and if it completed, the next (which must report the death).
        let recv = tokio::spawn(async move {
            let first = rx.recv().await;
            let next = match &first {
                Ok(Some(_)) => Some(rx.recv().await.map(|m| m.is_some())),
                _ => None,
            };
            (first.map(|m| m.map(|m| m.payload.len())), next)
        });

        // Kill the peer once a few READ chunks of its payload have arrived.
        let start = Instant::now();
        while metrics.snapshot().bytes_received < 1 << 20 {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the transfer never started"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let at_kill = metrics.snapshot().bytes_received;
        child.kill().await.expect("kill the peer");
        let killed = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(5), recv)
            .await
            .expect("the receive failed within 5 s of the kill, no hang")
            .expect("task");
        match r {
            // The kill landed while the payload was being read.
            (Err(TransportError::Truncated { received, expected }), None) => {
                assert_eq!(expected, SIZE as u64);
                assert!(received < expected, "{received} of {expected}");
                println!(
                    "peer_death: peer killed after {at_kill} bytes; receive failed after {:?} \
                     with Truncated ({received} of {expected} bytes)",
                    killed.elapsed()
                );
            }
            // The READs finished before the kill landed: the message is whole, and the next
            // receive reports the death of a peer that never closed the connection.
            (Ok(Some(len)), Some(Err(TransportError::Io(e))))
                if e.kind() == std::io::ErrorKind::ConnectionReset =>
            {
                assert_eq!(len, SIZE);
                println!(
                    "peer_death: the {len}-byte message completed before the kill landed; the \
                     next receive failed after {:?}: {e}",
                    killed.elapsed()
                );
            }
            other => panic!(
                "expected Truncated, or the whole message then ConnectionReset, after the kill; \
                 got {other:?}"
            ),
        }
    });
}
