//! TCP keepalive is on for connected and accepted sockets, with the configured idle time and
//! the documented interval and probe count, and off when configured off: a peer that dies
//! without a word is noticed.

use std::time::Duration;

use socket2::SockRef;
use tokio::time::timeout;
use transport_core::{Listener, Transport};
use transport_tcp::{
    TcpConfig, TcpConnection, TcpTransport, DEFAULT_KEEPALIVE, KEEPALIVE_INTERVAL,
    KEEPALIVE_RETRIES,
};

const WAIT: Duration = Duration::from_secs(10);

/// A connected and an accepted connection of a transport with these settings.
async fn pair(config: TcpConfig) -> [(&'static str, TcpConnection); 2] {
    let tcp = TcpTransport::new(config);
    let mut listener = tcp
        .listen(&"127.0.0.1:0".parse().unwrap())
        .await
        .expect("listen");
    let addr = listener.local_addr().expect("addr");
    let connected = timeout(WAIT, tcp.connect(&addr))
        .await
        .expect("connect in time")
        .expect("connect");
    let accepted = timeout(WAIT, listener.accept())
        .await
        .expect("accept in time")
        .expect("accept");
    [("connected", connected), ("accepted", accepted)]
}

#[test]
fn keepalive_is_on_by_default() {
    assert_eq!(TcpConfig::default().keepalive, Some(DEFAULT_KEEPALIVE));
    assert_eq!(DEFAULT_KEEPALIVE, Duration::from_secs(60));
}

#[tokio::test]
async fn keepalive_is_set_as_configured_on_both_sides() {
    let idle = Duration::from_secs(37);
    let mut config = TcpConfig::default();
    config.keepalive = Some(idle);
    for (side, conn) in pair(config).await {
        let sock = SockRef::from(conn.socket());
        assert!(
            sock.keepalive().expect("SO_KEEPALIVE"),
            "{side}: keepalive off"
        );
        assert_eq!(sock.keepalive_time().expect("TCP_KEEPIDLE"), idle, "{side}");
        assert_eq!(
            sock.keepalive_interval().expect("TCP_KEEPINTVL"),
            KEEPALIVE_INTERVAL,
            "{side}"
        );
        assert_eq!(
            sock.keepalive_retries().expect("TCP_KEEPCNT"),
            KEEPALIVE_RETRIES,
            "{side}"
        );
    }
}

#[tokio::test]
async fn keepalive_is_off_when_configured_off() {
    let mut config = TcpConfig::default();
    config.keepalive = None;
    for (side, conn) in pair(config).await {
        let sock = SockRef::from(conn.socket());
        assert!(
            !sock.keepalive().expect("SO_KEEPALIVE"),
            "{side}: keepalive on"
        );
    }
}
