//! The RDMA device removed while connections run (`rdma link delete`): every connection on
//! it and the listener fail with a typed error, the process keeps serving its other
//! transports (a Unix socket pair here), and the transport gives the device back: on drivers
//! that cannot disassociate open contexts (rxe, siw) the kernel's removal waits for every
//! process to close them, and must complete once the application has dropped the failed
//! connections. Then the device is added again and the same transport connects on it.
//!
//! Destructive, so it runs only when told which device it may remove:
//! `TRANSPORT_VERBS_REMOVE_DEVICE=<device>` and `TRANSPORT_VERBS_REMOVE_NETDEV=<netdev>` (the
//! test bed's last step on each device). The device is added back with `rdma link add
//! <device> type <rxe|siw> netdev <netdev>`, its kind read from its name.

mod common;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use transport_core::{
    HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport, TransportError,
};
use transport_verbs::{VerbsConfig, VerbsError, VerbsTransport};

const DEVICE_ENV: &str = "TRANSPORT_VERBS_REMOVE_DEVICE";
const NETDEV_ENV: &str = "TRANSPORT_VERBS_REMOVE_NETDEV";
/// How long each end has to fail once the removal started, and the removal to complete once
/// the application let go.
const BOUND: Duration = Duration::from_secs(30);

/// What a half's failure was: the device's removal, or the peer's disconnect (the kernel
/// disconnects a connection whose device goes; the peer may hear that first).
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    Removed,
    PeerGone,
}

fn classify(e: &TransportError, device: &str) -> Ended {
    match e.original().backend_error::<VerbsError>() {
        Some(VerbsError::DeviceRemoved { device: d }) => {
            assert_eq!(d, device, "the error names the removed device");
            Ended::Removed
        }
        _ => match e.original() {
            TransportError::Io(io) if io.kind() == std::io::ErrorKind::ConnectionReset => {
                Ended::PeerGone
            }
            other => panic!("expected the device's removal or a reset, got {other:?}"),
        },
    }
}

/// One round trip over the Unix socket pair: the process's other transport still serves.
async fn uds_round_trip(a: &mut tokio::net::UnixStream, b: &mut tokio::net::UnixStream) {
    let io = async {
        a.write_all(b"ping").await?;
        let mut buf = [0u8; 4];
        b.read_exact(&mut buf).await?;
        b.write_all(&buf).await?;
        a.read_exact(&mut buf).await?;
        assert_eq!(&buf, b"ping");
        Ok::<_, std::io::Error>(())
    };
    tokio::time::timeout(Duration::from_secs(5), io)
        .await
        .expect("the Unix socket answered in time")
        .expect("the Unix socket works");
}

/// Waits (bounded) for `child` to exit; its status.
async fn wait_child(child: &mut Child, what: &str) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().expect("wait for the child") {
            return s;
        }
        assert!(
            start.elapsed() < BOUND,
            "{what}: still running after {BOUND:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn removing_the_device_fails_its_connections_and_gives_the_device_back() {
    let (Ok(device), Ok(netdev)) = (std::env::var(DEVICE_ENV), std::env::var(NETDEV_ENV)) else {
        eprintln!(
            "device_removal: not run: it deletes an RDMA link; set {DEVICE_ENV} and {NETDEV_ENV} \
             to a device it may remove (the test bed does)"
        );
        return;
    };
    let kind = if device.starts_with("siw") {
        "siw"
    } else {
        "rxe"
    };
    let addr = common::listen_addr();
    common::run(async move {
        let verbs = VerbsTransport::new(VerbsConfig::default()).expect("transport");
        let mut listener = verbs.listen(&addr).await.expect("listen");
        let at = listener.local_addr().expect("addr");
        let mut pairs = Vec::new();
        for _ in 0..3 {
            pairs.push(common::open_pair(&verbs, &mut listener, at).await);
        }
        let (mut ua, mut ub) = tokio::net::UnixStream::pair().expect("socket pair");
        uds_round_trip(&mut ua, &mut ub).await;
        // The listener waits in accept while the device goes.
        let accepting = tokio::spawn(async move {
            let r = listener.accept().await;
            (listener, r)
        });

        let started = Instant::now();
        let mut delete = Command::new("rdma")
            .args(["link", "delete", &device])
            .spawn()
            .expect("run rdma link delete");

        // Every half of every connection fails, with a typed error.
        let mut ended = Vec::new();
        for p in &mut pairs {
            for rx in [&mut p.client.1, &mut p.server.1] {
                let r = tokio::time::timeout(BOUND, rx.recv())
                    .await
                    .expect("the receive ended after the device's removal, no hang");
                let e = r.expect_err("a receive on a removed device fails");
                ended.push(classify(&e, &device));
            }
            for tx in [&mut p.client.0, &mut p.server.0] {
                let e = tx
                    .send(Message::new(HeaderBytes::EMPTY, Bytes::from_static(b"x")))
                    .await
                    .expect_err("a send on a removed device fails");
                assert!(e.is_fatal(), "{e:?}");
            }
        }
        let removed = ended.iter().filter(|e| **e == Ended::Removed).count();
        println!(
            "device_removal: {} halves failed within {:?}: {removed} with DeviceRemoved, {} \
             with the peer's disconnect",
            ended.len(),
            started.elapsed(),
            ended.len() - removed
        );
        // On RoCE the removal event reaches each connection first (the peer's disconnect at
        // most for the peer of one torn down before); on iWARP the kernel resets the TCP
        // connections under the queue pairs first: every half then reports the reset.
        if kind == "rxe" {
            assert!(
                removed > 0,
                "no half reported the device's removal: {ended:?}"
            );
        }
        let (listener, r) = tokio::time::timeout(BOUND, accepting)
            .await
            .expect("accept ended after the removal, no hang")
            .expect("the accepting task");
        let e = r.expect_err("accept on a removed device fails");
        assert_eq!(classify(&e, &device), Ended::Removed, "{e}");

        // The process's other transport goes on.
        uds_round_trip(&mut ua, &mut ub).await;

        // The application lets go of what failed; the kernel then finishes the removal.
        drop(pairs);
        drop(listener);
        let status = wait_child(
            &mut delete,
            "rdma link delete (the device was not given back)",
        )
        .await;
        assert!(status.success(), "rdma link delete: {status}");
        println!(
            "device_removal: rdma link delete {device} finished {:?} after it started",
            started.elapsed()
        );
        assert!(
            !std::path::Path::new(&format!("/sys/class/infiniband/{device}")).exists(),
            "{device} is still registered"
        );
        assert_eq!(verbs.memory_use().connections, 0, "no connection is left");
        uds_round_trip(&mut ua, &mut ub).await;

        // The device comes back; the same transport connects on it again.
        let mut add = Command::new("rdma")
            .args(["link", "add", &device, "type", kind, "netdev", &netdev])
            .spawn()
            .expect("run rdma link add");
        let status = wait_child(&mut add, "rdma link add").await;
        assert!(status.success(), "rdma link add: {status}");
        let start = Instant::now();
        let mut listener = loop {
            match verbs.listen(&addr).await {
                Ok(l) => break l,
                Err(e) => {
                    assert!(
                        start.elapsed() < BOUND,
                        "cannot listen on the re-added device: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        let at = listener.local_addr().expect("addr");
        let mut p = common::open_pair(&verbs, &mut listener, at).await;
        p.client
            .0
            .send(Message::new(
                HeaderBytes::EMPTY,
                Bytes::from_static(b"again"),
            ))
            .await
            .expect("send on the re-added device");
        let m = p.server.1.recv().await.expect("recv").expect("open");
        assert_eq!(&m.payload[..], b"again");
        println!("device_removal: {device} added back; a new connection works");
    });
}
