//! Unix-domain sockets as a backend of transport-test's conformance and hostile-peer suites
//! (feature `conformance`).

use std::sync::atomic::{AtomicU64, Ordering};
use tokio::net::UnixStream;
use transport_framed::StreamConfig;
use transport_test::conformance::Backend;
use transport_test::hostile::StreamBackend;

use crate::{UdsAddr, UdsConfig, UdsTransport};

/// Unix sockets in one temporary folder, a fresh path per listener (named by process and
/// count; a listener removes its socket file when dropped, so the folder does not fill up).
#[derive(Debug, Clone, Copy, Default)]
pub struct UdsBackend;

impl Backend for UdsBackend {
    type T = UdsTransport;
    fn transport(&self, max_message_size: usize) -> UdsTransport {
        UdsTransport::new(UdsConfig::with_max_message_size(max_message_size))
    }
    fn listen_addr(&self) -> UdsAddr {
        static N: AtomicU64 = AtomicU64::new(0);
        static SWEPT: std::sync::Once = std::sync::Once::new();
        let dir = std::env::temp_dir().join("transport-uds-tests");
        std::fs::create_dir_all(&dir).expect("create the socket folder");
        SWEPT.call_once(|| sweep_dead(&dir));
        let n = N.fetch_add(1, Ordering::Relaxed);
        UdsAddr(dir.join(format!("{}-{n}.sock", std::process::id())))
    }
}

/// Removes the socket files of test processes that are gone: a child process killed on
/// purpose (SIGKILL) cannot remove its own.
fn sweep_dead(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name.to_string_lossy().split('-').next().map(str::to_owned);
        let alive = match pid.and_then(|p| p.parse::<u32>().ok()) {
            Some(pid) => std::path::Path::new(&format!("/proc/{pid}")).exists(),
            None => true, // not ours
        };
        if !alive {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

impl StreamBackend for UdsBackend {
    type Raw = UnixStream;
    fn stream_transport(&self, stream: StreamConfig) -> UdsTransport {
        UdsTransport::new(UdsConfig {
            stream,
            ..UdsConfig::default()
        })
    }
    async fn connect_raw(&self, addr: &UdsAddr) -> std::io::Result<UnixStream> {
        UnixStream::connect(&addr.0).await
    }
}
