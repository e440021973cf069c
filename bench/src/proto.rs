//! What the bench client and server say to each other, and the server.
//!
//! Every connection opens with one message whose header names its mode:
//!
//! | mode | what the server does |
//! |---|---|
//! | `echo` | sends every message back as it came (raw ping-pong and raw echo stream) |
//! | `sink` | drops messages; answers an `end` message with `ack` + bytes received (u64 LE) |
//! | `source` | for each `src` request (size u32 LE, count u64 LE) sends `count` messages of `size` bytes |
//! | `rpc` | hands the connection to an [`RpcServer`] with the [`method`] ids below |
//!
//! Raw modes use the backend's `Connection` directly (the same code the RPC layer runs on),
//! so the difference between a raw and an RPC figure is the RPC layer's cost.

use bytes::{Buf, Bytes};
use std::sync::{Arc, LazyLock, Mutex};
use transport_core::rpc::{Request, RpcServer, ServerConfig, Status};
use transport_core::{
    Capabilities, Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender,
    Metrics, MetricsSnapshot, TransportError,
};

/// Counters of the connections this process's bench server has served.
#[derive(Default)]
struct ServerCounters {
    live: Vec<Arc<Metrics>>,
    /// Final counts of the connections that ended.
    ended: MetricsSnapshot,
}

static SERVER_COUNTERS: LazyLock<Mutex<ServerCounters>> = LazyLock::new(Default::default);

fn server_counters() -> std::sync::MutexGuard<'static, ServerCounters> {
    SERVER_COUNTERS.lock().unwrap_or_else(|p| p.into_inner())
}

/// The sum of the counters of every connection the bench server in this process has served
/// (zero when the server runs elsewhere). In local mode the difference over a measurement is
/// the server's side of it: copies made while receiving requests happen there.
pub fn server_totals() -> MetricsSnapshot {
    let c = server_counters();
    let mut total = c.ended;
    for m in &c.live {
        total.accumulate(&m.snapshot());
    }
    total
}

/// A served connection's entry in [`SERVER_COUNTERS`]; folded into the ended total on drop.
struct Counted(Arc<Metrics>);

impl Counted {
    fn register(metrics: Arc<Metrics>) -> Counted {
        server_counters().live.push(metrics.clone());
        Counted(metrics)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        let mut c = server_counters();
        c.live.retain(|m| !Arc::ptr_eq(m, &self.0));
        c.ended.accumulate(&self.0.snapshot());
    }
}

/// Header of the first message of a raw echo connection.
pub const MODE_ECHO: &[u8] = b"echo";
/// Header of the first message of a raw sink connection.
pub const MODE_SINK: &[u8] = b"sink";
/// Header of the first message of a raw source connection.
pub const MODE_SOURCE: &[u8] = b"source";
/// Header of the first message of an RPC connection.
pub const MODE_RPC: &[u8] = b"rpc";
/// Sink: "tell me what you received".
pub const SINK_END: &[u8] = b"end";
/// Sink: the answer to [`SINK_END`].
pub const SINK_ACK: &[u8] = b"ack";
/// Source: a request for a stream of messages.
pub const SOURCE_REQ: &[u8] = b"src";

/// Largest payload the bench moves (1 MB is the largest size of the issue; 16 MiB leaves room).
pub const MAX_PAYLOAD: usize = 16 << 20;

/// RPC method ids of the bench server.
pub mod method {
    /// `void o()`: empty request, empty response.
    pub const PING: u32 = 0;
    /// Byte sequence in, nothing out (twoway send).
    pub const SEND: u32 = 1;
    /// Byte sequence in, oneway.
    pub const ONEWAY: u32 = 2;
    /// Size (u32 LE) in, byte sequence of that size out.
    pub const RECV: u32 = 3;
    /// Byte sequence in, the same out.
    pub const ECHO: u32 = 4;
}

/// A connection whose halves were already split (so the server can read the mode message
/// first and then hand the rest of the connection to the RPC server).
pub struct Presplit<S, R> {
    tx: S,
    rx: R,
    caps: Capabilities,
    metrics: Arc<Metrics>,
    peer: String,
}

impl<S, R> Presplit<S, R> {
    /// Reassembles a connection from its halves and what it reported before the split.
    pub fn new(tx: S, rx: R, caps: Capabilities, metrics: Arc<Metrics>, peer: String) -> Self {
        Presplit {
            tx,
            rx,
            caps,
            metrics,
            peer,
        }
    }
}

impl<S: MessageSender, R: MessageReceiver> Connection for Presplit<S, R> {
    type Sender = S;
    type Receiver = R;
    fn capabilities(&self) -> Capabilities {
        self.caps.clone()
    }
    fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }
    fn peer(&self) -> String {
        self.peer.clone()
    }
    fn split(self) -> (S, R) {
        (self.tx, self.rx)
    }
}

fn payload_pool() -> Bytes {
    Bytes::from(vec![0x5au8; MAX_PAYLOAD])
}

/// The bench's RPC handler.
fn rpc_server(pool: Bytes) -> RpcServer<impl transport_core::rpc::Handler> {
    RpcServer::new(
        move |r: Request| {
            let pool = pool.clone();
            async move {
                match r.method {
                    method::PING | method::SEND | method::ONEWAY => Ok(Bytes::new()),
                    method::ECHO => Ok(r.payload),
                    method::RECV => {
                        let mut p = r.payload;
                        if p.len() != 4 {
                            return Err(Status::new(
                                transport_core::rpc::code::INVALID_ARGUMENT,
                                "recv wants a u32 size",
                            ));
                        }
                        let n = (p.get_u32_le() as usize).min(pool.len());
                        Ok(pool.slice(..n))
                    }
                    m => Err(Status::unknown_method(m)),
                }
            }
        },
        ServerConfig::default(),
    )
}

/// Serves bench connections from `listener` until the process ends.
pub async fn serve<L: Listener>(mut listener: L) -> Result<(), TransportError> {
    let pool = payload_pool();
    let rpc = rpc_server(pool.clone());
    loop {
        let conn = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                eprintln!("bench server: accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let rpc = rpc.clone();
        let pool = pool.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_connection(conn, rpc, pool).await {
                tracing_free_log(&e);
            }
        });
    }
}

fn tracing_free_log(e: &TransportError) {
    // A client that stops mid-run (Ctrl-C) is normal; anything else is worth a line.
    if !matches!(e, TransportError::Closed | TransportError::Io(_)) {
        eprintln!("bench server: connection ended: {e}");
    }
}

async fn serve_connection<C: Connection>(
    conn: C,
    rpc: RpcServer<impl transport_core::rpc::Handler>,
    pool: Bytes,
) -> Result<(), TransportError> {
    let caps = conn.capabilities();
    let metrics = conn.metrics();
    let _counted = Counted::register(metrics.clone());
    let peer = conn.peer();
    let (mut tx, mut rx) = conn.split();
    let Some(first) = rx.recv().await? else {
        return Ok(());
    };
    match first.header.as_slice() {
        MODE_ECHO => {
            while let Some(m) = rx.recv().await? {
                tx.send(m).await?;
            }
        }
        MODE_SINK => {
            let mut received = 0u64;
            while let Some(m) = rx.recv().await? {
                if m.header.as_slice() == SINK_END {
                    let ack = Bytes::copy_from_slice(&received.to_le_bytes());
                    tx.send(Message::new(HeaderBytes::from(*b"ack"), ack))
                        .await?;
                    received = 0;
                } else {
                    received += m.payload.len() as u64;
                }
            }
        }
        MODE_SOURCE => {
            while let Some(mut m) = rx.recv().await? {
                if m.header.as_slice() != SOURCE_REQ || m.payload.len() != 12 {
                    return Err(TransportError::Malformed("bench source: bad request"));
                }
                let size = (m.payload.get_u32_le() as usize).min(pool.len());
                let count = m.payload.get_u64_le();
                let payload = pool.slice(..size);
                for _ in 0..count {
                    tx.send(Message::new(HeaderBytes::EMPTY, payload.clone()))
                        .await?;
                }
            }
        }
        MODE_RPC => {
            let conn = Presplit {
                tx,
                rx,
                caps,
                metrics,
                peer,
            };
            if let Err(e) = rpc.serve_connection(conn).await {
                if !e.is_connection_error() {
                    eprintln!("bench server: rpc connection ended: {e}");
                }
            }
            return Ok(());
        }
        _ => return Err(TransportError::Malformed("bench server: unknown mode")),
    }
    let _ = tx.close().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Server totals add up live connections and keep what ended connections counted.
    #[test]
    fn server_totals_count_live_and_ended_connections() {
        let before = server_totals();
        let m = Arc::new(Metrics::default());
        let counted = Counted::register(m.clone());
        m.payload_bytes_copied.add(100);
        assert_eq!((server_totals() - before).payload_bytes_copied, 100);
        drop(counted);
        assert_eq!((server_totals() - before).payload_bytes_copied, 100);
        m.payload_bytes_copied.add(5);
        assert_eq!(
            (server_totals() - before).payload_bytes_copied,
            100,
            "an ended connection is no longer read"
        );
    }
}
