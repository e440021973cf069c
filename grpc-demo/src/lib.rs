//! # grpc-demo
//!
//! One service, `Echo` (`proto/echo.proto`: a unary call, a server-streaming call and a
//! bidirectional stream), run two ways over the same transports:
//!
//! - [`grpc`]: tonic (gRPC over HTTP/2) on any `transport-core` backend through the
//!   `transport-stream` byte-stream adapter;
//! - [`native`]: the same service on the transport-core RPC layer ([`transport_rpc`]),
//!   where each call is one message each way;
//! - [`tarpc_echo`]: the unary echo as a tarpc service, over transport-core's messages with
//!   [`transport_tarpc`] and over tarpc's own `serde_transport`;
//!
//! and [`compare`], which measures them on the same transport (calls/s of a small unary call,
//! MB/s of a large one) so the cost of the framework shows up next to the transport's.
//! The binary `grpc-vs-native` prints that comparison for uds and tcp.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use grpc_demo::{grpc, pb};
//! use transport_stream::{ByteStreamConfig, StreamListener};
//! use transport_tcp::TcpTransport;
//!
//! let tcp = TcpTransport::default();
//! let listener = StreamListener::bind(&tcp, &"127.0.0.1:0".parse()?, ByteStreamConfig::default()).await?;
//! let addr = listener.local_addr()?;
//! tokio::spawn(grpc::serve(listener, std::future::pending()));
//! let mut client = grpc::connect(tcp, addr).await?;
//! let reply = client.unary(pb::EchoRequest { payload: "hi".into() }).await?;
//! assert_eq!(reply.into_inner().payload, "hi");
//! # Ok(()) }
//! ```

pub mod compare;
pub mod grpc;
pub mod native;
pub mod tarpc_echo;

/// The generated protobuf messages and tonic client/server of `proto/echo.proto`.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("echo");
}

/// Largest message either side accepts (tonic's default is 4 MiB).
pub const MAX_MESSAGE: usize = 64 << 20;

/// A payload of `len` bytes whose content depends on `seed` (tests compare it byte for byte).
pub fn pattern(len: usize, seed: u64) -> bytes::Bytes {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
