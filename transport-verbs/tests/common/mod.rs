//! Shared by the verbs integration tests: find the device or check the typed no-device error.

use std::net::SocketAddr;
use std::time::Duration;
use transport_test::conformance::Backend;
use transport_verbs::conformance::VerbsBackend;

/// The address to listen on: `$TB_IP_ADDR` or the first RoCE v2 IPv4 GID's address, port
/// 0. Panics without a device ([`VerbsBackend::for_this_machine`]): the tests that call it
/// are ignored by default and run with `--include-ignored` where there is one.
pub fn listen_addr() -> SocketAddr {
    VerbsBackend::for_this_machine().listen_addr()
}

/// Runs `f` on a two-worker runtime with a hard time limit.
#[allow(dead_code)] // not every test binary runs async code
pub fn run<F: std::future::Future<Output = ()>>(f: F) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(120), f)
            .await
            .expect("test hung");
    });
    rt.shutdown_timeout(Duration::from_secs(2));
}

/// Both ends of a verbs connection, kept open.
#[allow(dead_code)] // not every test binary opens pairs
pub struct Pair {
    /// The connecting side's halves.
    pub client: (transport_verbs::VerbsSender, transport_verbs::VerbsReceiver),
    /// The accepting side's halves.
    pub server: (transport_verbs::VerbsSender, transport_verbs::VerbsReceiver),
}

/// Opens a connection pair and makes one exchange on it (so both drivers are set up and have
/// had activity).
#[allow(dead_code)] // not every test binary opens pairs
pub async fn open_pair(
    verbs: &transport_verbs::VerbsTransport,
    listener: &mut transport_verbs::VerbsListener,
    addr: SocketAddr,
) -> Pair {
    use transport_core::Listener as _;
    use transport_core::{
        Connection, HeaderBytes, Message, MessageReceiver, MessageSender, Transport,
    };
    let conn = verbs.connect(&addr).await.expect("connect");
    let server = listener.accept().await.expect("accept");
    let (mut tx, mut rx) = conn.split();
    let (mut stx, mut srx) = server.split();
    tx.send(Message::new(
        HeaderBytes::EMPTY,
        bytes::Bytes::from_static(b"x"),
    ))
    .await
    .expect("send");
    let m = srx.recv().await.expect("recv").expect("open");
    stx.send(m).await.expect("reply");
    rx.recv().await.expect("recv").expect("open");
    Pair {
        client: (tx, rx),
        server: (stx, srx),
    }
}

/// Resident memory of this process, in bytes (0 if /proc does not say).
#[allow(dead_code)] // not every test binary measures memory
pub fn rss() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<usize>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Waits (at most 30 s) until the transport's shared receive queues hold every buffer of their
/// depth again (`buf_size` bytes each): a driver refills the slot a completion took right
/// after handing the message over, so a reading taken just after a call may be one buffer
/// short. A queue may have grown meanwhile, never beyond the paths' `srq_max_depth`.
#[allow(dead_code)] // not every test binary checks memory
pub async fn srq_refilled(
    verbs: &transport_verbs::VerbsTransport,
    buf_size: usize,
) -> transport_verbs::MemoryUse {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let cap = paths(verbs).srq_max_depth;
    loop {
        let m = verbs.memory_use();
        assert!(
            m.shared_receive_buffers <= cap,
            "a shared receive queue grew beyond its cap {cap}: {m:?}"
        );
        if m.shared_receive_bytes == m.shared_receive_buffers * buf_size {
            return m;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "shared receive queues not refilled: {m:?}, {buf_size} bytes a buffer"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The paths the transport's connections take on its device (after its first connection):
/// where a test's expectations depend on them (a shared receive queue or not, the exposure).
#[allow(dead_code)] // not every test binary needs them
pub fn paths(verbs: &transport_verbs::VerbsTransport) -> transport_verbs::Paths {
    let caps = verbs.device_caps();
    let caps = caps.first().expect("the transport has made a connection");
    caps.paths(verbs.config())
}

/// The paths a transport with `cfg` will take on the device that carries `ip`, known before any
/// connection (the device is probed here).
#[allow(dead_code)] // not every test binary needs them
pub fn device_paths(
    cfg: &transport_verbs::VerbsConfig,
    ip: std::net::IpAddr,
) -> transport_verbs::Paths {
    device_caps(ip).paths(cfg)
}

/// The probed capabilities of the device that carries `ip`.
#[allow(dead_code)]
pub fn device_caps(ip: std::net::IpAddr) -> transport_verbs::DeviceCaps {
    let name = transport_verbs::rdma_addresses()
        .expect("RDMA addresses")
        .into_iter()
        .find(|(_, a)| *a == ip)
        .map(|(d, _)| d)
        .unwrap_or_else(|| panic!("no RDMA device carries {ip}"));
    transport_verbs::probe_devices()
        .expect("probe")
        .into_iter()
        .find(|c| c.device == name)
        .unwrap_or_else(|| panic!("{name} was not probed"))
}

/// Whether a READ the device refused completed as the device's transport reports it: with a
/// remote access error on InfiniBand and RoCE; on iWARP the responder answers an invalid key
/// with a TERMINATE that ends the reader's queue pair, and the READ may complete as flushed
/// (siw) or as a remote access error. Either way no byte was read.
#[allow(dead_code)]
pub fn is_refused_read(
    ip: std::net::IpAddr,
    got: &Result<Vec<u8>, transport_verbs::WcStatus>,
) -> bool {
    use transport_verbs::WcStatus;
    match got {
        Err(WcStatus::RemoteAccess) => true,
        Err(WcStatus::Flushed) => device_caps(ip).transport.is_iwarp(),
        _ => false,
    }
}
