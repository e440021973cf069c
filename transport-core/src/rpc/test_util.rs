//! Test helpers: an in-memory stream connection for the RPC client and server tests.

use crate::stream::{StreamConfig, StreamReceiver, StreamSender};
use crate::{Capabilities, Connection, Metrics};
use std::sync::Arc;
use tokio::io::{DuplexStream, ReadHalf, WriteHalf};

/// One end of an in-memory stream connection.
pub(crate) struct Duplex {
    pub(crate) io: DuplexStream,
    pub(crate) config: StreamConfig,
    metrics: Arc<Metrics>,
}

impl Duplex {
    pub(crate) fn pair(max_message_size: usize) -> (Duplex, Duplex) {
        let (a, b) = tokio::io::duplex(1 << 20);
        let config = StreamConfig {
            max_message_size,
            ..StreamConfig::default()
        };
        let end = |io| Duplex {
            io,
            config: config.clone(),
            metrics: Arc::default(),
        };
        (end(a), end(b))
    }
}

impl Connection for Duplex {
    type Sender = StreamSender<WriteHalf<DuplexStream>>;
    type Receiver = StreamReceiver<ReadHalf<DuplexStream>>;

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: "duplex",
            max_message_size: self.config.max_message_size,
            max_header_len: crate::MAX_HEADER_LEN,
            inline_size: 0,
            rdma_read: false,
            rdma_write: false,
            zero_copy_send: true,
            zero_copy_recv: true,
            registered_buffers: false,
            event_fd: false,
            reliable_ordered: true,
        }
    }
    fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }
    fn peer(&self) -> String {
        "duplex".into()
    }
    fn split(self) -> (Self::Sender, Self::Receiver) {
        let (r, w) = tokio::io::split(self.io);
        (
            StreamSender::new(w, self.metrics.clone(), &self.config),
            StreamReceiver::new(r, self.metrics, &self.config),
        )
    }
}

/// Serves `end` with an echo handler that holds every call until the returned switch is set to
/// `true`; also returns the serving task.
pub(crate) fn gated_echo_server(
    end: Duplex,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<Result<(), crate::rpc::RpcError>>,
) {
    use crate::rpc::{Request, RpcServer, ServerConfig, Status};
    let (open, gate) = tokio::sync::watch::channel(false);
    let server = RpcServer::new(
        move |req: Request| {
            let mut gate = gate.clone();
            async move {
                let _ = gate.wait_for(|open| *open).await;
                Ok::<_, Status>(req.payload)
            }
        },
        ServerConfig::default(),
    );
    let serving = tokio::spawn(async move { server.serve_connection(end).await });
    (open, serving)
}
