//! A tarpc service over transport-core's messages: the server and the client in one
//! process, over the transport named on the command line.
//!
//! ```text
//! cargo run -p transport-tarpc --example hello -- uds
//! cargo run -p transport-tarpc --example hello -- tcp 127.0.0.1:0
//! cargo run -p transport-tarpc --example hello -- verbs 10.0.0.1:0   # an RDMA device's IP
//! ```

use futures_util::{future, StreamExt};
use std::time::Instant;
use tarpc::context::Context;
use tarpc::server::{BaseChannel, Channel};
use transport_core::{Listener, Transport};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tarpc::service]
trait Hello {
    /// A greeting for `name`.
    async fn hello(name: String) -> String;
}

#[derive(Clone)]
struct HelloServer;

impl Hello for HelloServer {
    async fn hello(self, _: Context, name: String) -> String {
        format!("Hello, {name}!")
    }
}

/// Serves [`HelloServer`] on `transport` at `addr`, then calls it from a client over a
/// connection of the same transport.
async fn run<T: Transport>(transport: T, addr: T::Addr) -> Result<(), Error> {
    let listener = transport.listen(&addr).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(
        transport_tarpc::incoming(listener)
            .filter_map(|conn| future::ready(conn.ok()))
            .for_each(|t| {
                let requests = BaseChannel::with_defaults(t).execute(HelloServer.serve());
                tokio::spawn(requests.for_each(|call| async {
                    tokio::spawn(call);
                }));
                future::ready(())
            }),
    );
    let t = transport_tarpc::connect(&transport, &addr).await?;
    let client = HelloClient::new(tarpc::client::Config::default(), t).spawn();
    println!(
        "{}",
        client
            .hello(tarpc::context::current(), "world".into())
            .await?
    );
    let calls = 10_000;
    let start = Instant::now();
    for _ in 0..calls {
        client.hello(tarpc::context::current(), "x".into()).await?;
    }
    let per_call = start.elapsed() / calls;
    println!("{calls} calls over {addr}: {per_call:?} per call, one at a time");
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "uds".into());
    let addr = args.next();
    match which.as_str() {
        "uds" => {
            let dir = tempfile::tempdir()?;
            let path = dir.path().join("hello.sock");
            let t = transport_uds::UdsTransport::new(Default::default());
            run(t, path.into()).await
        }
        "tcp" => {
            let t = transport_tcp::TcpTransport::new(Default::default());
            run(t, addr.as_deref().unwrap_or("127.0.0.1:0").parse()?).await
        }
        "verbs" => {
            let t = transport_verbs::VerbsTransport::new(Default::default())?;
            let Some(addr) = addr else {
                return Err("verbs needs the RDMA interface's address, e.g. 10.0.0.1:0".into());
            };
            run(t, addr.parse()?).await
        }
        other => Err(format!("unknown transport {other:?}: uds, tcp or verbs").into()),
    }
}
