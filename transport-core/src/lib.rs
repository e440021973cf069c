//! # transport-core
//!
//! One transport abstraction for RPC at the speed of the wire: the traits every backend
//! implements and the messages they carry. Messages framed over byte streams (the TCP and
//! Unix-socket connection) are `transport-framed`; the RPC layer built on the traits is
//! `transport-rpc`; the suites every backend runs are `transport-test`.
//!
//! - [`Transport`], [`Listener`], [`Connection`], [`MessageSender`], [`MessageReceiver`]: connect /
//!   listen / accept and whole-message send and receive. Backends: `transport-tcp`,
//!   `transport-uds`, `transport-verbs`, `transport-shm`.
//! - [`Message`] = inline header ([`HeaderBytes`]) + [`bytes::Bytes`] payload; [`SendBuffer`] and
//!   [`BufferPool`] let a backend hand out memory it sends without copying (registered slabs on
//!   verbs, shared memory on shm).
//! - [`Capabilities`] and per-connection [`Metrics`] (messages, bytes, payload bytes copied,
//!   syscalls, doorbells, registrations, in-flight depth) so tools can explain where time goes.
//! - [`budget`]: memory budgets shared by a transport's receivers or a server's handlers.
//! - [`spin`]: spinning before a runtime thread parks (a tokio `on_thread_park` hook).
//!
//! ```no_run
//! # async fn demo<T: transport_core::Transport>(transport: T, addr: T::Addr) -> Result<(), Box<dyn std::error::Error>> {
//! use bytes::Bytes;
//! use transport_core::{Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport};
//!
//! let mut listener = transport.listen(&addr).await?;
//! let addr = listener.local_addr()?;
//! let (mut tx, _rx) = transport.connect(&addr).await?.split();
//! let (_stx, mut srx) = listener.accept().await?.split();
//! tx.send(Message::new(HeaderBytes::EMPTY, Bytes::from_static(b"hi"))).await?;
//! assert_eq!(srx.recv().await?.expect("open").payload, "hi");
//! # Ok(()) }
//! ```

pub mod budget;
mod caps;
mod error;
mod message;
mod metrics;
pub mod spin;
mod transport;

/// Polls `fut` once, on the calling task: its output if it is ready, `Pending` (with the
/// task's waker registered by `fut`) if not. (Public for `transport-rpc`.)
#[doc(hidden)]
pub async fn poll_once<F: std::future::Future + ?Sized>(
    mut fut: std::pin::Pin<&mut F>,
) -> std::task::Poll<F::Output> {
    std::future::poll_fn(|cx| std::task::Poll::Ready(fut.as_mut().poll(cx))).await
}

pub use caps::Capabilities;
pub use error::{BackendError, TransportError};
pub use message::{BackendRegion, HeaderBytes, Message, SendBuffer, MAX_HEADER_LEN};
pub use metrics::{Counter, LevelGauge, Metrics, MetricsSnapshot};
pub use transport::{
    BufferPool, Connection, HeapPool, Listener, MessageReceiver, MessageSender, Transport, TryRecv,
};
