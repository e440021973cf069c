//! The in-process servers of local mode and `bench scenario`: CPU placement, a server on its
//! own pinned thread, a private directory for Unix sockets, and the verbs transport of this
//! machine.

use crate::args::Pin;
use crate::report::Placement;
use crate::{proto, sys, tuning};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use transport_core::{Listener, Transport};
use transport_verbs::VerbsTransport;

/// CPU placement for local mode: (client core, server core, summary).
pub(crate) fn placement(pin: Pin, mode: &str) -> Placement {
    let cpus = sys::allowed_cpus();
    let first = cpus.first().copied().unwrap_or(0);
    let (c, s, summary) = match pin {
        Pin::Same => (
            Some(first),
            Some(first),
            format!("client threads and server pinned to the same CPU {first}"),
        ),
        Pin::Split if cpus.len() >= 2 => (
            Some(cpus[0]),
            Some(cpus[1]),
            format!(
                "client threads pinned to CPU {}, server to CPU {}",
                cpus[0], cpus[1]
            ),
        ),
        Pin::Split => (
            Some(first),
            Some(first),
            format!("only CPU {first} is allowed: client and server share it"),
        ),
        Pin::None => (
            None,
            None,
            "not pinned (the scheduler places client and server)".into(),
        ),
    };
    let (c, s, summary) = if mode == "remote" {
        (
            c,
            None,
            match c {
                Some(c) => format!("client threads pinned to CPU {c}; server on the remote host"),
                None => "client not pinned; server on the remote host".into(),
            },
        )
    } else {
        (c, s, summary)
    };
    Placement {
        mode: mode.into(),
        client_core: c,
        server_core: s,
        allowed_cpus: cpus,
        summary: format!("{summary} ({} CPUs allowed)", sys::allowed_cpus().len()),
    }
}

/// Starts a bench server for `transport` at `addr` on its own pinned thread; returns the
/// address it listens on and the server's connection counters (for its side of the copies).
pub(crate) fn spawn_server<T: Transport + Clone>(
    transport: T,
    addr: T::Addr,
    core: Option<usize>,
    spin: Duration,
) -> Result<(T::Addr, Arc<proto::ServerCounters>), String> {
    let counters = Arc::new(proto::ServerCounters::default());
    let served = counters.clone();
    let addr = spawn_server_with(transport, addr, core, spin, |l| async move {
        let _ = proto::serve(l, served).await;
    })?;
    Ok((addr, counters))
}

/// Like [`spawn_server`] with another server loop (`serve` gets the listener). The server's
/// runtime polls for `spin` before it sleeps (zero: never).
pub(crate) fn spawn_server_with<T, F, Fut>(
    transport: T,
    addr: T::Addr,
    core: Option<usize>,
    spin: Duration,
    serve: F,
) -> Result<T::Addr, String>
where
    T: Transport + Clone,
    F: FnOnce(T::Listener) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("bench-server".into())
        .spawn(move || {
            if let Some(c) = core {
                if let Err(e) = sys::pin_current_thread(c) {
                    let _ = tx.send(Err(e));
                    return;
                }
            }
            let rt = match sys::runtime(spin) {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = tx.send(Err(e.to_string()));
                    return;
                }
            };
            rt.block_on(async move {
                let listener = match transport.listen(&addr).await {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = tx.send(Err(format!("listen on {addr}: {e}")));
                        return;
                    }
                };
                let _ = tx.send(listener.local_addr().map_err(|e| e.to_string()));
                serve(listener).await;
            });
        })
        .map_err(|e| e.to_string())?;
    rx.recv()
        .map_err(|_| "the server thread died".to_string())?
}

/// The verbs transport with the `--verbs-*` settings `args`, and an address of this
/// machine's RDMA device, or why there is none.
pub(crate) fn verbs_here(args: &tuning::VerbsArgs) -> Result<(VerbsTransport, SocketAddr), String> {
    let verbs = VerbsTransport::new(args.config()).map_err(|e| e.to_string())?;
    let ip = args.local_ip()?;
    Ok((verbs, SocketAddr::new(ip, 0)))
}

/// A fresh private directory (mode 0700, in the temporary directory) and a socket path inside
/// it, for the in-process servers of local mode and `bench scenario`: no other user can
/// predict, pre-create or connect to it. Dropping the directory removes it and its sockets.
pub(crate) fn local_socket() -> Result<(tempfile::TempDir, PathBuf), String> {
    use std::os::unix::fs::PermissionsExt;
    // Explicit: tempfile creates directories with the umask's mode (often 0755) otherwise.
    let dir = tempfile::Builder::new()
        .prefix("bench-")
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir()
        .map_err(|e| format!("cannot create a temporary directory for the socket: {e}"))?;
    let path = dir.path().join("bench.sock");
    Ok((dir, path))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Local mode's socket is in a fresh directory only this user can enter, removed with it.
    #[test]
    fn local_socket_is_in_a_private_directory() {
        use std::os::unix::fs::PermissionsExt;
        let (dir, path) = local_socket().unwrap();
        let parent = path.parent().unwrap().to_path_buf();
        assert_eq!(parent, dir.path());
        assert_ne!(
            parent,
            std::env::temp_dir(),
            "not directly in the shared directory"
        );
        let mode = std::fs::metadata(&parent).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "{mode:o}");
        let (other, _) = local_socket().unwrap();
        assert_ne!(other.path(), dir.path(), "not predictable from the process");
        drop(dir);
        assert!(!parent.exists());
    }
}
