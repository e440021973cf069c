//! The unary echo as a tarpc service, run two ways: over transport-core's messages
//! ([`transport_tarpc`]: one message per tarpc item, postcard into the pool) on any backend,
//! and over tarpc's own `serde_transport` (length-delimited bincode frames on a tokio
//! socket) as the framework's baseline.

use crate::compare::{drive, figures, CompareConfig, Error, Figures};
use bytes::Bytes;
use futures_util::{future, Stream, StreamExt};
use std::sync::Arc;
use tarpc::context::Context;
use tarpc::server::{BaseChannel, Channel};
use tarpc::tokio_serde::formats::Bincode;
use transport_core::{Listener, Transport};

/// The echo, as tarpc sees it.
#[tarpc::service]
pub trait TarpcEcho {
    /// The payload back.
    async fn unary(payload: Bytes) -> Bytes;
}

/// The server side of [`TarpcEcho`].
#[derive(Clone, Copy, Debug, Default)]
pub struct EchoServer;

impl TarpcEcho for EchoServer {
    async fn unary(self, _: Context, payload: Bytes) -> Bytes {
        payload
    }
}

/// A context whose deadline leaves room for the large calls.
fn ctx() -> Context {
    let mut c = tarpc::context::current();
    c.deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    c
}

/// Serves [`EchoServer`] on each transport `incoming` yields, every request on a task, until
/// the stream ends (or the task is aborted).
async fn serve_all<S, T>(incoming: S)
where
    S: Stream<Item = T>,
    T: tarpc::Transport<tarpc::Response<TarpcEchoResponse>, tarpc::ClientMessage<TarpcEchoRequest>>
        + Send
        + 'static,
{
    incoming
        .for_each(|t| {
            let requests = BaseChannel::with_defaults(t).execute(EchoServer.serve());
            tokio::spawn(requests.for_each(|call| async {
                tokio::spawn(call);
            }));
            future::ready(())
        })
        .await
}

/// The small and the large echo with `client`, warm-up first; the elapsed times.
async fn run_client(client: TarpcEchoClient, cfg: &CompareConfig) -> Result<Figures, Error> {
    let run = |size: usize, calls: usize| {
        let client = client.clone();
        let payload = crate::pattern(size, 1);
        drive(calls, cfg.concurrency, move || {
            let client = client.clone();
            let payload = payload.clone();
            async move {
                let reply = client.unary(ctx(), payload.clone()).await?;
                crate::compare::check(&reply, &payload)
            }
        })
    };
    run(cfg.small_size, 200).await?;
    let small = run(cfg.small_size, cfg.small_calls).await?;
    run(cfg.large_size, 5).await?;
    let large = run(cfg.large_size, cfg.large_calls).await?;
    Ok(figures(cfg, small, large))
}

/// Measures tarpc over `transport`'s messages (server and client in this process).
pub async fn measure_tarpc<T: Transport>(
    transport: Arc<T>,
    listen_addr: T::Addr,
    cfg: &CompareConfig,
) -> Result<Figures, Error> {
    let listener = transport.listen(&listen_addr).await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(serve_all(
        transport_tarpc::incoming(listener).filter_map(|t| future::ready(t.ok())),
    ));
    let t = transport_tarpc::connect(&*transport, &addr).await?;
    let client = TarpcEchoClient::new(tarpc::client::Config::default(), t).spawn();
    let r = run_client(client, cfg).await;
    server.abort();
    r
}

/// Measures tarpc on its own `serde_transport` over loopback TCP (bincode, length-delimited
/// frames up to [`crate::MAX_MESSAGE`]): the framework with the I/O it ships with.
pub async fn measure_tarpc_serde_tcp(cfg: &CompareConfig) -> Result<Figures, Error> {
    let mut incoming = tarpc::serde_transport::tcp::listen("127.0.0.1:0", Bincode::default).await?;
    incoming.config_mut().max_frame_length(crate::MAX_MESSAGE);
    let addr = incoming.local_addr();
    let server = tokio::spawn(serve_all(incoming.filter_map(|t| {
        future::ready(t.ok().filter(|t| t.get_ref().set_nodelay(true).is_ok()))
    })));
    let mut connect = tarpc::serde_transport::tcp::connect(addr, Bincode::default);
    connect.config_mut().max_frame_length(crate::MAX_MESSAGE);
    let t = connect.await?;
    t.get_ref().set_nodelay(true)?;
    let client = TarpcEchoClient::new(tarpc::client::Config::default(), t).spawn();
    let r = run_client(client, cfg).await;
    server.abort();
    r
}
