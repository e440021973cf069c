//! Prints gRPC (tonic over transport-stream) vs native RPC on uds, tcp and verbs (when this
//! machine has an RDMA device; in the soft-RoCE guest: `cargo xtask testbed run`).

use clap::Parser;
use grpc_demo::compare::{compare, table_header, CompareConfig};
use transport_tcp::TcpTransport;
use transport_uds::{UdsAddr, UdsTransport};

/// Measures what the gRPC and tarpc frameworks cost over each transport, next to the native RPC layer.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Transports to measure.
    #[arg(long, value_delimiter = ',', default_values = ["uds", "tcp", "verbs"])]
    transport: Vec<String>,
    /// Payload of the small unary call, bytes.
    #[arg(long, default_value_t = 64)]
    small_size: usize,
    /// Number of small calls.
    #[arg(long, default_value_t = 20_000)]
    small_calls: usize,
    /// Payload of the large unary echo, bytes.
    #[arg(long, default_value_t = 1 << 20)]
    large_size: usize,
    /// Number of large calls.
    #[arg(long, default_value_t = 300)]
    large_calls: usize,
    /// Calls in flight at once on the connection.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run(Args::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("grpc-vs-native: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), grpc_demo::compare::Error> {
    if let Some(bad) = args
        .transport
        .iter()
        .find(|t| !["uds", "tcp", "verbs"].contains(&t.as_str()))
    {
        return Err(format!("unknown transport `{bad}` (uds, tcp, verbs)").into());
    }
    let cfg = CompareConfig {
        small_size: args.small_size,
        small_calls: args.small_calls,
        large_size: args.large_size,
        large_calls: args.large_calls,
        concurrency: args.concurrency,
    };
    println!(
        "gRPC and tarpc vs native RPC, one connection, {} call(s) in flight, client and server in one process",
        cfg.concurrency
    );
    println!("{}", table_header(&cfg));
    let dir = tempfile::tempdir()?;
    for t in &args.transport {
        let c = match t.as_str() {
            "uds" => {
                let n = std::sync::atomic::AtomicU32::new(0);
                let base = dir.path().to_path_buf();
                compare(
                    "uds",
                    UdsTransport::default(),
                    move || {
                        let i = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        UdsAddr(base.join(format!("cmp{i}.sock")))
                    },
                    &cfg,
                )
                .await?
            }
            "tcp" => {
                compare(
                    "tcp",
                    TcpTransport::default(),
                    || "127.0.0.1:0".parse().unwrap(),
                    &cfg,
                )
                .await?
            }
            "verbs" => {
                let ip = match transport_verbs::local_rdma_ip() {
                    Ok(ip) => ip,
                    Err(e) => {
                        println!("verbs     not available: {e}");
                        continue;
                    }
                };
                let t =
                    transport_verbs::VerbsTransport::new(transport_verbs::VerbsConfig::default())?;
                compare("verbs", t, || std::net::SocketAddr::new(ip, 0), &cfg).await?
            }
            other => return Err(format!("unknown transport `{other}` (uds, tcp, verbs)").into()),
        };
        println!("{c}");
        if t == "tcp" {
            let plain = grpc_demo::compare::measure_grpc_plain_tcp(&cfg).await?;
            println!(
                "{:<9} {:<12} {:>15.0} calls/s {:>21.1} MB/s   (tonic's own TcpStream, no adapter)",
                "tcp", "gRPC plain", plain.small_calls_per_s, plain.large_mb_per_s
            );
            let serde = grpc_demo::compare::measure_tarpc_serde_tcp(&cfg).await?;
            println!(
                "{:<9} {:<12} {:>15.0} calls/s {:>21.1} MB/s   (tarpc's own serde_transport, bincode)",
                "tcp", "tarpc serde", serde.small_calls_per_s, serde.large_mb_per_s
            );
        }
    }
    Ok(())
}
