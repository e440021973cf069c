//! gRPC-over-transport and tarpc-on-messages vs the native RPC layer on the same transport:
//! what a framework costs.
//!
//! Both sides run the same two workloads on one connection, in the same process, one after the
//! other: a small unary echo (calls/s) and a large unary echo (MB/s, payload bytes counted once
//! per call), each with `concurrency` calls in flight.

use crate::{grpc, native, pb, tarpc_echo};
use bytes::Bytes;
use futures_util::{future, StreamExt};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tarpc::tokio_serde::formats::Bincode;
use tokio::sync::oneshot;
use transport_core::{Listener, Transport};
use transport_rpc::RpcServer;
use transport_stream::{ByteStreamConfig, StreamListener};
use transport_tarpc::Payload;

/// Any error of a comparison run.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// What to measure.
#[derive(Debug, Clone)]
pub struct CompareConfig {
    /// Payload of the small call, bytes.
    pub small_size: usize,
    /// Number of small calls.
    pub small_calls: usize,
    /// Payload of the large call, bytes.
    pub large_size: usize,
    /// Number of large calls.
    pub large_calls: usize,
    /// Calls in flight at once (tasks sharing one connection).
    pub concurrency: usize,
}

impl Default for CompareConfig {
    fn default() -> Self {
        CompareConfig {
            small_size: 64,
            small_calls: 20_000,
            large_size: 1 << 20,
            large_calls: 300,
            concurrency: 1,
        }
    }
}

/// Figures of one framework on one transport.
#[derive(Debug, Clone, Copy)]
pub struct Figures {
    /// Small unary calls per second.
    pub small_calls_per_s: f64,
    /// Large unary echo, payload MB (10^6 bytes) per second.
    pub large_mb_per_s: f64,
}

/// gRPC vs native on one transport.
#[derive(Debug, Clone)]
pub struct Comparison {
    /// Transport name (`uds`, `tcp`, `verbs`).
    pub transport: String,
    /// What was measured.
    pub config: CompareConfig,
    /// tonic over the byte-stream adapter.
    pub grpc: Figures,
    /// transport-core RPC.
    pub native: Figures,
    /// tarpc over the transport's messages ([`transport_tarpc`]).
    pub tarpc: Figures,
}

impl Comparison {
    /// gRPC / native for the small call.
    pub fn small_ratio(&self) -> f64 {
        self.grpc.small_calls_per_s / self.native.small_calls_per_s
    }
    /// gRPC / native for the large call.
    pub fn large_ratio(&self) -> f64 {
        self.grpc.large_mb_per_s / self.native.large_mb_per_s
    }
    /// tarpc / native for the small call.
    pub fn tarpc_small_ratio(&self) -> f64 {
        self.tarpc.small_calls_per_s / self.native.small_calls_per_s
    }
    /// tarpc / native for the large call.
    pub fn tarpc_large_ratio(&self) -> f64 {
        self.tarpc.large_mb_per_s / self.native.large_mb_per_s
    }
}

/// Header of the table [`Comparison`]'s `Display` prints rows of.
pub fn table_header(config: &CompareConfig) -> String {
    format!(
        "{:<9} {:<12} {:>22} {:>24}",
        "transport",
        "framework",
        format!("unary {} B", config.small_size),
        format!("unary echo {} KiB", config.large_size >> 10)
    )
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let row = |f: &mut fmt::Formatter<'_>, name: &str, x: &Figures| {
            writeln!(
                f,
                "{:<9} {:<12} {:>15.0} calls/s {:>21.1} MB/s",
                self.transport, name, x.small_calls_per_s, x.large_mb_per_s
            )
        };
        row(f, "gRPC (tonic)", &self.grpc)?;
        row(f, "native RPC", &self.native)?;
        row(f, "tarpc (msgs)", &self.tarpc)?;
        writeln!(
            f,
            "{:<9} {:<12} {:>21.2} x {:>26.2} x",
            self.transport,
            "gRPC/native",
            self.small_ratio(),
            self.large_ratio()
        )?;
        write!(
            f,
            "{:<9} {:<12} {:>21.2} x {:>26.2} x",
            self.transport,
            "tarpc/native",
            self.tarpc_small_ratio(),
            self.tarpc_large_ratio()
        )
    }
}

/// Runs `calls` calls of `call` with `concurrency` in flight; returns the elapsed time.
async fn drive<F, Fut>(calls: usize, concurrency: usize, call: F) -> Result<Duration, Error>
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), Error>> + Send,
{
    let concurrency = concurrency.clamp(1, calls.max(1));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(concurrency);
    for i in 0..concurrency {
        let n = calls / concurrency + usize::from(i < calls % concurrency);
        let call = call.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..n {
                call().await?;
            }
            Ok::<_, Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(start.elapsed())
}

fn figures(cfg: &CompareConfig, small: Duration, large: Duration) -> Figures {
    Figures {
        small_calls_per_s: cfg.small_calls as f64 / small.as_secs_f64(),
        large_mb_per_s: (cfg.large_size * cfg.large_calls) as f64 / 1e6 / large.as_secs_f64(),
    }
}

/// Measures tonic over `transport` (server and client in this process).
pub async fn measure_grpc<T: Transport>(
    transport: Arc<T>,
    listen_addr: T::Addr,
    cfg: &CompareConfig,
) -> Result<Figures, Error> {
    let listener =
        StreamListener::bind(&*transport, &listen_addr, ByteStreamConfig::default()).await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(grpc::serve(listener, async {
        let _ = stopped.await;
    }));
    let client = grpc::connect_shared(transport, addr).await?;

    let figures = small_then_large(cfg, client.clone(), |mut c, payload| async move {
        Ok(c.unary(pb::EchoRequest { payload })
            .await?
            .into_inner()
            .payload)
    })
    .await?;
    drop(client);
    let _ = stop.send(());
    server.await??;
    Ok(figures)
}

/// Measures tonic on its own TCP I/O (tokio `TcpStream`, no adapter): the baseline that
/// separates the adapter's cost from the framework's.
pub async fn measure_grpc_plain_tcp(cfg: &CompareConfig) -> Result<Figures, Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .initial_stream_window_size(grpc::STREAM_WINDOW)
            .initial_connection_window_size(grpc::CONNECTION_WINDOW)
            .max_frame_size(grpc::MAX_FRAME)
            .tcp_nodelay(true)
            .add_service(grpc::service())
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                async {
                    let _ = stopped.await;
                },
            ),
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .initial_stream_window_size(grpc::STREAM_WINDOW)
        .initial_connection_window_size(grpc::CONNECTION_WINDOW)
        .max_frame_size(grpc::MAX_FRAME)
        .tcp_nodelay(true)
        .connect()
        .await?;
    let client = pb::echo_client::EchoClient::new(channel)
        .max_decoding_message_size(crate::MAX_MESSAGE)
        .max_encoding_message_size(crate::MAX_MESSAGE);
    let figures = small_then_large(cfg, client.clone(), |mut c, payload| async move {
        Ok(c.unary(pb::EchoRequest { payload })
            .await?
            .into_inner()
            .payload)
    })
    .await?;
    drop(client);
    let _ = stop.send(());
    server.await??;
    Ok(figures)
}

/// Measures the native RPC layer over `transport` (server and client in this process).
pub async fn measure_native<T: Transport>(
    transport: Arc<T>,
    listen_addr: T::Addr,
    cfg: &CompareConfig,
) -> Result<Figures, Error> {
    let listener = transport.listen(&listen_addr).await?;
    let addr = listener.local_addr()?;
    let server: RpcServer<_> = native::server();
    let serving = tokio::spawn({
        let server = server.clone();
        async move { server.serve(listener).await }
    });
    let client = native::NativeEcho::new(transport.connect(&addr).await?);

    let figures = small_then_large(cfg, client.clone(), |c, payload| async move {
        Ok(c.unary(payload).await?)
    })
    .await?;
    drop(client);
    server.shutdown().await;
    serving.await??;
    Ok(figures)
}

/// The small echo (after 200 warm-up calls) and the large one (after 5) through `echo`, with
/// `cfg`'s calls in flight: the figures. Every reply's length is checked.
async fn small_then_large<C, F, Fut>(
    cfg: &CompareConfig,
    client: C,
    echo: F,
) -> Result<Figures, Error>
where
    C: Clone + Send + 'static,
    F: Fn(C, Bytes) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<Bytes, Error>> + Send,
{
    let run = |size: usize, calls: usize| {
        let (client, echo) = (client.clone(), echo.clone());
        let payload = crate::pattern(size, 1);
        drive(calls, cfg.concurrency, move || {
            let (client, echo, payload) = (client.clone(), echo.clone(), payload.clone());
            async move {
                let reply = echo(client, payload.clone()).await?;
                check(&reply, &payload)
            }
        })
    };
    run(cfg.small_size, 200).await?;
    let small = run(cfg.small_size, cfg.small_calls).await?;
    run(cfg.large_size, 5).await?;
    let large = run(cfg.large_size, cfg.large_calls).await?;
    Ok(figures(cfg, small, large))
}

fn check(got: &Bytes, want: &Bytes) -> Result<(), Error> {
    if got.len() != want.len() {
        return Err(format!("echo returned {} bytes, sent {}", got.len(), want.len()).into());
    }
    Ok(())
}

/// Measures gRPC, native RPC, then tarpc on `transport`'s messages; `addr` gives a fresh
/// listen address per server.
pub async fn compare<T: Transport>(
    name: &str,
    transport: T,
    addr: impl Fn() -> T::Addr,
    cfg: &CompareConfig,
) -> Result<Comparison, Error> {
    let transport = Arc::new(transport);
    let grpc = measure_grpc(transport.clone(), addr(), cfg).await?;
    let native = measure_native(transport.clone(), addr(), cfg).await?;
    let tarpc = measure_tarpc(transport, addr(), cfg).await?;
    Ok(Comparison {
        transport: name.to_string(),
        config: cfg.clone(),
        grpc,
        native,
        tarpc,
    })
}

/// A context whose deadline leaves room for the large calls.
fn tarpc_ctx() -> tarpc::context::Context {
    let mut c = tarpc::context::current();
    c.deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    c
}

/// The small and the large echo with `client`, warm-up first; the elapsed times.
async fn run_tarpc_client(
    client: tarpc_echo::TarpcEchoClient,
    cfg: &CompareConfig,
) -> Result<Figures, Error> {
    small_then_large(cfg, client, |c, payload| async move {
        Ok(c.unary(tarpc_ctx(), Payload(payload)).await?.into_bytes())
    })
    .await
}

/// Measures tarpc over `transport`'s messages (server and client in this process).
pub async fn measure_tarpc<T: Transport>(
    transport: Arc<T>,
    listen_addr: T::Addr,
    cfg: &CompareConfig,
) -> Result<Figures, Error> {
    let listener = transport.listen(&listen_addr).await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(tarpc_echo::serve_all(
        transport_tarpc::incoming(listener).filter_map(|t| future::ready(t.ok())),
    ));
    let t = transport_tarpc::connect(&*transport, &addr).await?;
    let client = tarpc_echo::TarpcEchoClient::new(tarpc::client::Config::default(), t).spawn();
    let r = run_tarpc_client(client, cfg).await;
    server.abort();
    r
}

/// Measures tarpc on its own `serde_transport` over loopback TCP (bincode, length-delimited
/// frames up to [`crate::MAX_MESSAGE`]): the framework with the I/O it ships with.
pub async fn measure_tarpc_serde_tcp(cfg: &CompareConfig) -> Result<Figures, Error> {
    let mut incoming = tarpc::serde_transport::tcp::listen("127.0.0.1:0", Bincode::default).await?;
    incoming.config_mut().max_frame_length(crate::MAX_MESSAGE);
    let addr = incoming.local_addr();
    let server = tokio::spawn(tarpc_echo::serve_all(incoming.filter_map(|t| {
        future::ready(t.ok().filter(|t| t.get_ref().set_nodelay(true).is_ok()))
    })));
    let mut connect = tarpc::serde_transport::tcp::connect(addr, Bincode::default);
    connect.config_mut().max_frame_length(crate::MAX_MESSAGE);
    let t = connect.await?;
    t.get_ref().set_nodelay(true)?;
    let client = tarpc_echo::TarpcEchoClient::new(tarpc::client::Config::default(), t).spawn();
    let r = run_tarpc_client(client, cfg).await;
    server.abort();
    r
}
