//! A registration that fails for lack of locked memory (RLIMIT_MEMLOCK) is a typed error whose
//! message names the limit, returned by the call that needed it; the connection stays usable.

mod common;

use bytes::Bytes;
use transport_core::{
    Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport,
};
use transport_verbs::{VerbsConfig, VerbsError, VerbsTransport};

#[test]
fn registration_beyond_memlock_is_a_typed_error_naming_memlock() {
    let Some(addr) = common::listen_addr_or_skip("memlock") else {
        return;
    };
    // Root bypasses RLIMIT_MEMLOCK through CAP_IPC_LOCK: drop it first (before the runtime's
    // threads exist, so they inherit it), then allow 16 MiB of locked memory.
    transport_verbs::drop_ipc_lock_capability().expect("drop CAP_IPC_LOCK");
    transport_verbs::set_memlock_soft_limit(Some(16 << 20)).expect("setrlimit");
    common::run(async move {
        let verbs = VerbsTransport::new(VerbsConfig::default()).expect("transport");
        let mut listener = verbs.listen(&addr).await.expect("listen");
        let addr = listener.local_addr().expect("addr");
        // The device's shared receive queue (128 buffers of 64 KiB, ~8 MiB) and two
        // endpoints' send slots fit in the limit.
        let conn = verbs
            .connect(&addr)
            .await
            .expect("connect within the limit");
        let server = listener.accept().await.expect("accept");
        let (mut tx, _rx) = conn.split();
        let (_stx, mut srx) = server.split();

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
