//! `--rpc-io blocking`: the RPC rows measured with `transport_rpc::blocking` (a client
//! blocking in `recv`, a thread per connection on the server) instead of the async client
//! and server, in local mode on uds and tcp.

use crate::measure::SocketTarget as Target;
use crate::proto;
use crate::sys;
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::thread::JoinHandle;
use std::time::Duration;
use transport_rpc::blocking::{BlockingConfig, BlockingServer};
use transport_rpc::ServerConfig;

/// The accepting thread (`None`: it could not be pinned and never served).
type Accept = JoinHandle<Option<std::io::Result<()>>>;

/// The in-process blocking RPC server: serves until dropped.
pub struct Server {
    target: Target,
    stop: Box<dyn Fn() + Send>,
    accept: Option<Accept>,
    /// The runtime behind the handlers' `block_on` (the bench's handlers answer at once).
    _runtime: tokio::runtime::Runtime,
}

impl Server {
    /// Listens at `bind` (a TCP port 0 gets a free port) on a thread pinned to `core`; the
    /// connection threads it starts inherit the pinning. Its runtime and connection threads
    /// poll for `spin` before they sleep.
    pub fn start(bind: Target, core: Option<usize>, spin: Duration) -> Result<Server, String> {
        let runtime = sys::runtime(spin).map_err(|e| format!("blocking rpc: runtime: {e}"))?;
        let server = BlockingServer::new(
            proto::rpc_handler(proto::payload_pool()),
            ServerConfig::default(),
            BlockingConfig::default()
                .with_max_message_size(proto::MAX_PAYLOAD + 64)
                .with_spin(spin),
            runtime.handle().clone(),
        );
        let serving = server.clone();
        let (target, accept) = match bind {
            Target::Uds(p) => {
                let l = UnixListener::bind(&p)
                    .map_err(|e| format!("blocking rpc: listen on {}: {e}", p.display()))?;
                (Target::Uds(p), spawn(move || serving.serve(l), core)?)
            }
            Target::Tcp(a) => {
                let l = TcpListener::bind(a)
                    .map_err(|e| format!("blocking rpc: listen on {a}: {e}"))?;
                let a = l.local_addr().map_err(|e| format!("blocking rpc: {e}"))?;
                (Target::Tcp(a), spawn(move || serving.serve(l), core)?)
            }
        };
        Ok(Server {
            target,
            stop: Box::new(move || server.shutdown()),
            accept: Some(accept),
            _runtime: runtime,
        })
    }

    /// Where clients connect.
    pub fn target(&self) -> &Target {
        &self.target
    }
}

fn spawn(
    serve: impl FnOnce() -> std::io::Result<()> + Send + 'static,
    core: Option<usize>,
) -> Result<Accept, String> {
    sys::spawn_pinned("rpc-blocking-accept", core, serve).map_err(|e| format!("blocking rpc: {e}"))
}

impl Drop for Server {
    fn drop(&mut self) {
        (self.stop)();
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        if let Target::Uds(p) = &self.target {
            let _ = std::fs::remove_file(p);
        }
    }
}
