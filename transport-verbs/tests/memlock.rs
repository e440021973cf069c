//! A registration that fails for lack of locked memory (RLIMIT_MEMLOCK) is a typed error whose
//! message names the limit, returned by the call that needed it; the connection stays usable.
//! Under the common default limit (8 MiB) the default settings still connect: the device's
//! shared receive queue is made to fit in half of the limit.

mod common;

use bytes::Bytes;
use transport_core::{
    Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport,
};
use transport_verbs::{VerbsConfig, VerbsError, VerbsTransport};

type Conn = <VerbsTransport as Transport>::Connection;
type Halves = (<Conn as Connection>::Sender, <Conn as Connection>::Receiver);

/// A connection from `verbs` to itself at `addr`, split: the client's halves, the server's.
async fn pair(verbs: &VerbsTransport, addr: std::net::SocketAddr) -> (Halves, Halves) {
    let mut listener = verbs.listen(&addr).await.expect("listen");
    let addr = listener.local_addr().expect("addr");
    let conn = verbs
        .connect(&addr)
        .await
        .expect("connect within the limit");
    let server = listener.accept().await.expect("accept");
    (conn.split(), server.split())
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn the_defaults_fit_under_8_mib_and_a_registration_beyond_16_mib_is_a_typed_error() {
    let addr = common::listen_addr();
    // Root bypasses RLIMIT_MEMLOCK through CAP_IPC_LOCK: drop it first (before the runtime's
    // threads exist, so they inherit it).
    transport_verbs::drop_ipc_lock_capability().expect("drop CAP_IPC_LOCK");
    // 8 MiB, a common default: the default settings connect and carry messages.
    transport_verbs::set_memlock_soft_limit(Some(8 << 20)).expect("setrlimit");
    common::run(async {
        let verbs = VerbsTransport::new(VerbsConfig::default()).expect("transport");
        let ((mut tx, _rx), (_stx, mut srx)) = pair(&verbs, addr).await;
        for i in 0..200u32 {
            let payload = Bytes::from(vec![i as u8; 1000 + (i as usize % 7) * 9000]);
            tx.send(Message::new(HeaderBytes::from([1u8]), payload.clone()))
                .await
                .expect("send");
            let m = srx.recv().await.expect("recv").expect("open");
            assert_eq!(m.payload, payload, "message {i}");
        }
        let used = verbs.memory_use();
        println!(
            "memlock 8 MiB: shared receive queue {} bytes, {} registered in all",
            used.shared_receive_bytes, used.registered_bytes
        );
        if common::paths(&verbs).srq_depth > 0 {
            assert!(used.shared_receive_bytes > 0, "{used:?}");
            assert!(
                used.shared_receive_bytes <= 4 << 20,
                "the queue fits in half of the limit: {used:?}"
            );
        } else {
            // Each connection posts its own buffers (registration exposure, iWARP): both
            // ends of the pair fit in the limit with room to spare.
            assert_eq!(used.shared_receive_bytes, 0, "{used:?}");
            assert!(used.registered_bytes <= 4 << 20, "{used:?}");
        }
    });

    // Then 16 MiB: a registration beyond it is a typed error.
    transport_verbs::set_memlock_soft_limit(Some(16 << 20)).expect("setrlimit");
    common::run(async move {
        let verbs = VerbsTransport::new(VerbsConfig::default()).expect("transport");
        // The device's shared receive queue (fitted into half of the limit) and two
        // endpoints' send slots fit in it.
        let ((mut tx, _rx), (_stx, mut srx)) = pair(&verbs, addr).await;

        // 32 MiB of user memory must be registered for a rendezvous send: over the limit.
        let big = Bytes::from(vec![7u8; 32 << 20]);
        let e = tx
            .send(Message::new(HeaderBytes::from([1u8]), big))
            .await
            .expect_err("registering 32 MiB under a 16 MiB memlock limit");
        match e.backend_error::<VerbsError>() {
            Some(VerbsError::Registration {
                len, memlock_limit, ..
            }) => {
                assert_eq!(*len, 32 << 20, "names what was being registered");
                assert_eq!(*memlock_limit, Some(16 << 20), "says what the limit is");
                let msg = e.to_string();
                assert!(msg.contains("RLIMIT_MEMLOCK"), "names the limit: {msg}");
                println!("memlock: {msg}");
            }
            _ => panic!("expected a typed registration error, got {e:?}"),
        }
        // Nothing was sent and the connection still works.
        tx.send(Message::new(
            HeaderBytes::from([2u8]),
            Bytes::from_static(b"ok"),
        ))
        .await
        .expect("small send after the failed registration");
        let m = srx.recv().await.expect("recv").expect("open");
        assert_eq!(m.header.as_slice(), [2u8]);
        assert_eq!(&m.payload[..], b"ok");
    });
}
