//! # transport-rpc
//!
//! The RPC layer over any `transport-core` connection: a fixed header ([`header`]), a client
//! that pipelines many calls on one connection ([`RpcClient`]) and a server that runs a
//! [`Handler`] for each ([`RpcServer`]).
//!
//! ```no_run
//! # async fn demo<T: transport_core::Transport>(transport: T, addr: T::Addr) -> Result<(), Box<dyn std::error::Error>> {
//! use bytes::Bytes;
//! use transport_core::{Listener, Transport};
//! use transport_rpc::{ClientConfig, Request, RpcClient, RpcServer, ServerConfig, Status};
//!
//! let listener = transport.listen(&addr).await?;
//! let addr = listener.local_addr()?;
//! let server = RpcServer::new(|r: Request| async move { Ok::<_, Status>(r.payload) }, ServerConfig::default());
//! tokio::spawn({ let s = server.clone(); async move { s.serve(listener).await } });
//!
//! let client = RpcClient::new(transport.connect(&addr).await?, ClientConfig::default());
//! assert_eq!(client.call(1, Bytes::from_static(b"hi")).await?, "hi");
//! # Ok(()) }
//! ```
//!
//! Serialization is the caller's: payloads are bytes. [`blocking`] has a synchronous client
//! and a thread-per-connection server for the same wire format (the lowest latency when
//! client and server share a CPU).
//!
//! | kind | sent by | payload | answered by |
//! |---|---|---|---|
//! | Request | client | arguments | Response or Error with the same request id |
//! | Oneway | client | arguments | nothing |
//! | Response | server | result | — |
//! | Error | server | code (u32 LE) + UTF-8 message | — |
//! | Cancel | client | empty | nothing (the handler is dropped) |

pub mod blocking;
mod client;
mod error;
pub mod header;
mod server;

pub use client::{CallOptions, ClientConfig, RpcClient};
pub use error::{code, ProtocolError, RpcError, Status, MAX_STATUS_MESSAGE};
pub use header::{HeaderError, Kind, RpcHeader, RPC_HEADER_LEN};
pub use server::{
    default_max_connections, Handler, Request, RpcServer, ServerConfig, DEFAULT_IDLE_TIMEOUT,
    DEFAULT_REQUEST_BYTES_PER_CONNECTION, DEFAULT_SERVER_BUDGET,
};

#[cfg(test)]
mod test_util;
