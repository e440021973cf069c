//! # transport-core
//!
//! One transport abstraction for RPC at the speed of the wire, and the RPC layer built on it.
//!
//! - [`Transport`], [`Listener`], [`Connection`], [`MessageSender`], [`MessageReceiver`]: connect /
//!   listen / accept and whole-message send and receive. Backends: `transport-tcp`,
//!   `transport-uds`, `transport-verbs`.
//! - [`Message`] = inline header ([`HeaderBytes`]) + [`bytes::Bytes`] payload; [`SendBuffer`] and
//!   [`BufferPool`] let a backend hand out memory it sends without copying (registered slabs on
//!   verbs).
//! - [`Capabilities`] and per-connection [`Metrics`] (messages, bytes, payload bytes copied,
//!   syscalls, doorbells, registrations, in-flight depth) so tools can explain where time goes.
//! - [`budget`]: memory budgets shared by a transport's receivers or a server's handlers.
//! - [`frame`]: the sans-IO stream framing; [`stream`]: connections over any byte stream
//!   ([`stream::StreamConnection`] is the TCP and Unix-socket connection).
//! - [`spin`]: spinning before a runtime thread parks (a tokio `on_thread_park` hook).
//! - [`rpc`]: the sans-IO RPC header codec, [`rpc::RpcClient`] and [`rpc::RpcServer`].
//! - `conformance` (feature `conformance`): the test suite every backend runs.
//!
//! ```no_run
//! # async fn demo<T: transport_core::Transport>(transport: T, addr: T::Addr) -> Result<(), Box<dyn std::error::Error>> {
//! use bytes::Bytes;
//! use transport_core::rpc::{ClientConfig, Request, RpcClient, RpcServer, ServerConfig, Status};
//! use transport_core::{Listener, Transport};
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

pub mod budget;
mod caps;
mod error;
pub mod frame;
mod message;
mod metrics;
pub mod rpc;
mod sock;
pub mod spin;
pub mod stream;
mod transport;

/// Polls `fut` once, on the calling task: its output if it is ready, `Pending` (with the
/// task's waker registered by `fut`) if not.
pub(crate) async fn poll_once<F: std::future::Future + ?Sized>(
    mut fut: std::pin::Pin<&mut F>,
) -> std::task::Poll<F::Output> {
    std::future::poll_fn(|cx| std::task::Poll::Ready(fut.as_mut().poll(cx))).await
}

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "conformance")]
pub mod hostile;

pub use caps::Capabilities;
pub use error::{BackendError, TransportError};
pub use message::{BackendRegion, HeaderBytes, Message, SendBuffer, MAX_HEADER_LEN};
pub use metrics::{Counter, LevelGauge, Metrics, MetricsSnapshot};
pub use transport::{
    BufferPool, Connection, HeapPool, Listener, MessageReceiver, MessageSender, Transport, TryRecv,
};
