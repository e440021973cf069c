//! A raw peer that writes what it likes into the memory it shares: every case ends in a
//! typed error (or the message it should), within a bounded time, never a panic or a hang.

mod common;

use std::io::Write;
use std::time::Duration;

use bytes::Bytes;
use common::bounded;
use transport_core::{
    Connection, HeaderBytes, Listener, MessageReceiver, Transport, TransportError,
};
use transport_shm::conn::{ShmConfig, ShmFailure, ShmReceiver};
use transport_shm::connect::connect;
use transport_shm::msg::{Encoder, MsgLimits};
use transport_shm::pool::PoolError;
use transport_shm::region::Region;
use transport_shm::region::Words;
use transport_shm::ring::{Producer, ENTRY_BYTES};
use transport_shm::setup::{Established, Hello};
use transport_shm::side::SideLayout;
use transport_shm::ShmTransport;

/// The raw peer: its set-up, the data ring it writes, and its socket for doorbells.
struct Raw {
    mine: Region,
    layout: SideLayout,
    hello: Hello,
    ring: Producer<Words>,
    sock: std::os::unix::net::UnixStream,
}

impl Raw {
    fn push(&mut self, entry: &[u8; ENTRY_BYTES]) {
        assert!(self.ring.try_push(entry).unwrap(), "room in the ring");
    }

    fn ring_doorbell(&mut self) {
        self.sock.write_all(b"D").unwrap();
    }

    /// The entries an honest sender would write for a message with `payload` inline.
    fn encode(&self, payload: &[u8]) -> Vec<[u8; ENTRY_BYTES]> {
        let limits = MsgLimits::new(self.hello.inline_limit as usize, 1 << 20).unwrap();
        let mut out = vec![[0u8; ENTRY_BYTES]; limits.max_entries()];
        let n = Encoder::new(limits)
            .encode_inline(&HeaderBytes::EMPTY, payload, &mut out)
            .unwrap();
        out.truncate(n);
        out
    }
}

/// A server-side receiver with `config`, and the raw peer connected to it.
async fn raw_peer(config: ShmConfig) -> (Raw, ShmReceiver, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shm.sock");
    let addr = path.to_str().unwrap().parse().unwrap();
    let mut listener = ShmTransport::new(config.clone())
        .listen(&addr)
        .await
        .unwrap();
    let (raw, server) = bounded("set-up", async {
        tokio::join!(
            connect(&path, config.hello(), &config.limits),
            listener.accept()
        )
    })
    .await;
    let (_tx, rx) = server.unwrap().split();
    let Established {
        mine,
        my_layout: layout,
        my_hello: hello,
        stream,
        ..
    } = raw.unwrap().established;
    let parts = layout.parts(&mine).unwrap();
    let ring = Producer::new(parts.data, layout.data()).unwrap();
    let sock = stream.into_std().unwrap();
    sock.set_nonblocking(false).unwrap();
    (
        Raw {
            mine,
            layout,
            hello,
            ring,
            sock,
        },
        rx,
        dir,
    )
}

fn shm_failure(e: &TransportError) -> Option<&ShmFailure> {
    e.backend_error::<ShmFailure>()
}

#[tokio::test]
async fn a_peer_gone_without_a_close_is_peer_gone() {
    let (raw, mut rx, _dir) = raw_peer(ShmConfig::default()).await;
    drop(raw); // as a killed process: its socket closes, no close entry
    let e = bounded("recv", rx.recv()).await.unwrap_err();
    assert!(matches!(shm_failure(&e), Some(ShmFailure::PeerGone)), "{e}");
}

#[tokio::test]
async fn an_entry_of_an_unknown_kind_is_a_typed_failure_that_sticks() {
    let (mut raw, mut rx, _dir) = raw_peer(ShmConfig::default()).await;
    raw.push(&[0xff; ENTRY_BYTES]);
    raw.ring_doorbell();
    let e = bounded("recv", rx.recv()).await.unwrap_err();
    assert!(matches!(shm_failure(&e), Some(ShmFailure::Msg(_))), "{e}");
    let again = rx.recv().await.unwrap_err();
    assert_eq!(again.to_string(), e.to_string());
}

#[tokio::test]
async fn a_tail_pushed_past_the_ring_is_a_typed_ring_failure() {
    let (mut raw, mut rx, _dir) = raw_peer(ShmConfig::default()).await;
    let parts = raw.layout.parts(&raw.mine).unwrap();
    // Word 0 of the data ring is its tail: far beyond what the ring holds.
    parts.data[0].store(1 << 40, std::sync::atomic::Ordering::Release);
    raw.ring_doorbell();
    let e = bounded("recv", rx.recv()).await.unwrap_err();
    assert!(matches!(shm_failure(&e), Some(ShmFailure::Ring(_))), "{e}");
}

#[tokio::test]
async fn a_slot_outside_the_peers_pool_is_a_typed_failure() {
    let (mut raw, mut rx, _dir) = raw_peer(ShmConfig::default()).await;
    // An in-slot message (kind 2) naming slot 1000 of an 8-slot pool.
    let mut e = [0u8; ENTRY_BYTES];
    e[0] = 2;
    e[4..8].copy_from_slice(&100u32.to_le_bytes());
    e[8..12].copy_from_slice(&1000u32.to_le_bytes());
    raw.push(&e);
    raw.ring_doorbell();
    let err = bounded("recv", rx.recv()).await.unwrap_err();
    assert!(
        matches!(shm_failure(&err), Some(ShmFailure::Msg(_))),
        "{err}"
    );
    // The failure sticks.
    assert!(rx.recv().await.is_err());
}

/// A kind-2 entry: `len` bytes at `offset` in `slot` of the raw peer's pool, no header.
fn in_slot(slot: u32, offset: u32, len: u32) -> [u8; ENTRY_BYTES] {
    let mut e = [0u8; ENTRY_BYTES];
    e[0] = 2;
    e[4..8].copy_from_slice(&len.to_le_bytes());
    e[8..12].copy_from_slice(&slot.to_le_bytes());
    e[12..16].copy_from_slice(&offset.to_le_bytes());
    e
}

#[tokio::test]
async fn a_payload_past_the_end_of_its_slot_is_a_typed_failure() {
    let config = ShmConfig::with_max_message_size(64 << 10);
    let slot_bytes = config.slot_bytes;
    let (mut raw, mut rx, _dir) = raw_peer(config).await;
    // In range alone, but not together: 100 bytes starting 50 before the slot's end.
    raw.push(&in_slot(0, slot_bytes - 50, 100));
    raw.ring_doorbell();
    let err = bounded("recv", rx.recv()).await.unwrap_err();
    assert!(
        matches!(shm_failure(&err), Some(ShmFailure::Msg(_))),
        "{err}"
    );
    assert!(rx.recv().await.is_err(), "sticks");
}

#[tokio::test]
async fn a_peer_naming_more_payloads_than_its_slots_is_a_typed_failure() {
    let config = ShmConfig::with_max_message_size(64 << 10);
    let slots = config.pool_slots;
    let (mut raw, mut rx, _dir) = raw_peer(config).await;
    // An honest sender has at most a pool's worth of sends outstanding; this one names the
    // same slot once more while the application here holds every payload.
    for _ in 0..=slots {
        raw.push(&in_slot(0, 0, 2000));
    }
    raw.ring_doorbell();
    let mut held = Vec::new();
    for _ in 0..slots {
        held.push(bounded("recv", rx.recv()).await.unwrap().unwrap());
    }
    let err = bounded("recv", rx.recv()).await.unwrap_err();
    assert!(
        matches!(
            shm_failure(&err),
            Some(ShmFailure::Pool(PoolError::TooManyHeld(_)))
        ),
        "{err}"
    );
    assert!(held.iter().all(|m| m.payload.len() == 2000));
}

#[tokio::test]
async fn a_peer_that_dies_with_a_message_half_written_truncates_it() {
    let (mut raw, mut rx, _dir) = raw_peer(ShmConfig::default()).await;
    let entries = raw.encode(&[7u8; 500]);
    assert!(entries.len() > 2, "a message of several entries");
    raw.push(&entries[0]);
    raw.ring_doorbell();
    drop(raw); // the process "dies": its socket closes
    let e = bounded("recv", rx.recv()).await.unwrap_err();
    assert!(
        matches!(e.original(), TransportError::Truncated { .. }),
        "{e}"
    );
}

#[tokio::test]
async fn a_peer_that_stalls_mid_message_is_stalled_after_the_frame_timeout() {
    let config = ShmConfig {
        frame_timeout: Some(Duration::from_millis(300)),
        ..ShmConfig::default()
    };
    let (mut raw, mut rx, _dir) = raw_peer(config).await;
    let entries = raw.encode(&[7u8; 500]);
    raw.push(&entries[0]);
    raw.ring_doorbell();
    let started = std::time::Instant::now();
    let e = bounded("recv", rx.recv()).await.unwrap_err();
    assert!(
        matches!(e.original(), TransportError::Stalled { after, .. } if *after == Duration::from_millis(300)),
        "{e}"
    );
    assert!(started.elapsed() >= Duration::from_millis(300));
    drop(raw);
}

#[tokio::test]
async fn doorbell_floods_and_unknown_bytes_only_cost_wake_ups() {
    let (mut raw, mut rx, _dir) = raw_peer(ShmConfig::default()).await;
    // 64 KiB of bytes that are not doorbells, then a real message.
    raw.sock.write_all(&[0xa5; 64 << 10]).unwrap();
    for e in raw.encode(b"after the flood") {
        raw.push(&e);
    }
    raw.ring_doorbell();
    let m = bounded("recv", rx.recv())
        .await
        .unwrap()
        .expect("the message");
    assert_eq!(m.payload, Bytes::from_static(b"after the flood"));
}
