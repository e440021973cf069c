//! tarpc over transport-core's messages, on any backend (Unix sockets, TCP, RDMA verbs).
//!
//! tarpc's transport is any [`Stream`] of received items and
//! [`Sink`](futures_util::Sink) of items to send. [`MessageTransport`] is that, over one
//! transport-core connection: each tarpc message is one transport message, encoded with
//! postcard into the transport header when it fits, else straight into a buffer of the
//! connection's pool (registered memory on verbs, sent without a copy). There is no byte
//! stream in between, so no length-delimited codec and no copy through
//! `AsyncRead`/`AsyncWrite` as with tarpc's `serde_transport` or the `transport-stream`
//! adapter. A [`Payload`] in a service's arguments or results crosses without a copy both
//! ways.
//!
//! ```
//! use futures_util::{future, StreamExt};
//! use tarpc::server::{BaseChannel, Channel};
//! use transport_core::{Listener, Transport};
//! use transport_uds::{UdsConfig, UdsTransport};
//!
//! #[tarpc::service]
//! trait Hello {
//!     async fn hello(name: String) -> String;
//! }
//!
//! #[derive(Clone)]
//! struct HelloServer;
//!
//! impl Hello for HelloServer {
//!     async fn hello(self, _: tarpc::context::Context, name: String) -> String {
//!         format!("Hello, {name}!")
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("hello.sock");
//! let transport = UdsTransport::new(UdsConfig::default());
//! let listener = transport.listen(&path.clone().into()).await?;
//! // Server: every accepted connection is a tarpc channel, its requests served on tasks.
//! tokio::spawn(
//!     transport_tarpc::incoming(listener)
//!         .filter_map(|conn| future::ready(conn.ok()))
//!         .for_each(|t| {
//!             let requests = BaseChannel::with_defaults(t).execute(HelloServer.serve());
//!             tokio::spawn(requests.for_each(|call| async { tokio::spawn(call); }));
//!             future::ready(())
//!         }),
//! );
//! // Client: the generated client over a connection of the same transport.
//! let t = transport_tarpc::connect(&transport, &path.into()).await?;
//! let client = HelloClient::new(tarpc::client::Config::default(), t).spawn();
//! let reply = client.hello(tarpc::context::current(), "verbs".into()).await?;
//! assert_eq!(reply, "Hello, verbs!");
//! # Ok(())
//! # }
//! ```
//!
//! The same code runs over `transport_tcp::TcpTransport` and
//! `transport_verbs::VerbsTransport`: only the transport value and its address change.
//!
//! # Wire format
//!
//! One message per tarpc item (a `ClientMessage` from client to server, a `Response` back),
//! encoded with [postcard](https://docs.rs/postcard), in one of two forms:
//! - header form: the item's encoding, with its first [`Payload`] replaced by an empty byte
//!   string, is the transport header (at most 64 bytes), and that payload's bytes are the
//!   message's payload (empty when the item has no `Payload`);
//! - plain form: an empty header, and a payload of exactly the item's encoding (every
//!   `Payload` inline as a byte string).
//!
//! The sender uses the header form whenever the item fits. Both sides must be built with the
//! same service definition (postcard is not self-describing).
//!
//! # Limits and errors
//!
//! - An item larger than the peer's message limit fails in `start_send` with
//!   [`Error::TooLarge`] before anything is written. tarpc then ends the connection: its
//!   dispatch stops on its transport's first error, as with any tarpc transport.
//! - What the peer sends is decoded only within the message it came in: bytes after the
//!   value (or a header-form payload that no `Payload` takes), or bytes that do not decode are
//!   [`Error::TrailingBytes`] and [`Error::Decode`]. A length inside the value larger than the
//!   message fails to decode; it allocates nothing of that size. The transport's own limits
//!   (message size, stalls, a peer that dies mid-message) hold as for any user of it.
//! - A message is sent when tarpc flushes: up to [`MAX_QUEUED`] items queued between flushes go
//!   to the transport in one `send_batch`.

mod codec;
mod payload;
mod transport;

pub use payload::Payload;
pub use transport::{MessageTransport, MAX_QUEUED};

use futures_util::Stream;
use tarpc::{ClientMessage, Response};
use transport_core::{Listener, Transport, TransportError};

/// The transport of a tarpc client: sends requests, receives responses. Pass it to a
/// generated client's `new` or to [`tarpc::client::new`].
pub type ClientTransport<C, Req, Resp> = MessageTransport<C, Response<Resp>, ClientMessage<Req>>;

/// The transport of a tarpc server channel: receives requests, sends responses. Pass it to
/// [`tarpc::server::BaseChannel::with_defaults`].
pub type ServerTransport<C, Req, Resp> = MessageTransport<C, ClientMessage<Req>, Response<Resp>>;

/// What can go wrong between tarpc and the transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The transport failed (the connection's error, typed).
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// An item could not be encoded (a type serde cannot write as postcard).
    #[error("cannot encode a tarpc message: {0}")]
    Encode(postcard::Error),
    /// An item's encoding is larger than the peer accepts; nothing was sent.
    #[error("a tarpc message of {len} bytes is over the peer's limit of {max} bytes")]
    TooLarge {
        /// Encoded size of the item.
        len: usize,
        /// The peer's message limit.
        max: usize,
    },
    /// The transport's pool gave a buffer too small for an item (a pool that breaks its
    /// contract: it should fall back to the heap).
    #[error("the buffer pool gave {capacity} bytes for a {len}-byte message")]
    PoolTooSmall {
        /// Encoded size of the item.
        len: usize,
        /// What the pool gave.
        capacity: usize,
    },
    /// The peer sent bytes that are not an item of this service.
    #[error("cannot decode the peer's tarpc message: {0}")]
    Decode(postcard::Error),
    /// The peer's message holds more than one value (bytes after it, or a payload that no
    /// [`Payload`] of the value takes).
    #[error("the peer's tarpc message has {0} bytes after its value")]
    TrailingBytes(usize),
}

/// Connects to a listener at `addr` and returns a tarpc client transport over the new
/// connection.
pub async fn connect<T: Transport, Req, Resp>(
    transport: &T,
    addr: &T::Addr,
) -> Result<ClientTransport<T::Connection, Req, Resp>, Error> {
    Ok(MessageTransport::new(transport.connect(addr).await?))
}

/// The connections `listener` accepts, each as a tarpc server transport. A connection that
/// fails during its set-up is an `Err` item and the stream goes on; it never ends by itself.
pub fn incoming<L: Listener, Req, Resp>(
    listener: L,
) -> impl Stream<Item = Result<ServerTransport<L::Connection, Req, Resp>, Error>> + Send {
    futures_util::stream::unfold(listener, |mut listener| async move {
        let conn = listener.accept().await;
        Some((
            conn.map(MessageTransport::new).map_err(Error::from),
            listener,
        ))
    })
}
