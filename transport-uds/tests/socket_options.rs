//! The socket options a connection gets from [`UdsConfig`].

use std::time::Duration;

use tokio::time::timeout;
use transport_core::{Listener, Transport};
use transport_uds::{UdsAddr, UdsConfig, UdsConnection, UdsTransport, DEFAULT_SEND_BUFFER};

/// The bound on every wait.
const WAIT: Duration = Duration::from_secs(10);

/// A `net.core` setting of this kernel.
fn net_core(name: &str) -> usize {
    let path = format!("/proc/sys/net/core/{name}");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    text.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn send_buffer(conn: &UdsConnection) -> usize {
    socket2::SockRef::from(conn.socket())
        .send_buffer_size()
        .expect("SO_SNDBUF readable")
}

/// Both ends of a connection, the connecting one and the accepted one, get the configured
/// `SO_SNDBUF` as the kernel books it (twice the value, which is capped at `wmem_max`): the
/// default settings [`DEFAULT_SEND_BUFFER`], another size that size; `None` leaves the
/// kernel's default (`wmem_default`).
#[tokio::test]
async fn both_ends_get_the_configured_send_buffer_and_none_keeps_the_kernels() {
    let (wmem_max, wmem_default) = (net_core("wmem_max"), net_core("wmem_default"));
    let cases = [
        (UdsConfig::default(), 2 * DEFAULT_SEND_BUFFER.min(wmem_max)),
        (
            UdsConfig::default().with_send_buffer_size(Some(300 << 10)),
            2 * (300usize << 10).min(wmem_max),
        ),
        (
            UdsConfig::default().with_send_buffer_size(None),
            wmem_default,
        ),
    ];
    for (config, booked) in cases {
        let size = config.send_buffer_size;
        let dir = tempfile::tempdir().unwrap();
        let addr = UdsAddr(dir.path().join("s.sock"));
        let uds = UdsTransport::new(config);
        let mut listener = uds.listen(&addr).await.unwrap();
        let (connected, accepted) = tokio::join!(uds.connect(&addr), async {
            timeout(WAIT, listener.accept())
                .await
                .expect("accepted in time")
        });
        let (connected, accepted) = (connected.unwrap(), accepted.unwrap());
        assert_eq!(send_buffer(&connected), booked, "connected end, {size:?}");
        assert_eq!(send_buffer(&accepted), booked, "accepted end, {size:?}");
    }
}
