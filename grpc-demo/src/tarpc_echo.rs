//! The unary echo as a tarpc service, and its server over any tarpc transport: over
//! transport-core's messages ([`transport_tarpc`]: one message per tarpc item, postcard into
//! the pool) or over tarpc's own `serde_transport` (length-delimited bincode frames on a tokio
//! socket). [`crate::compare`] measures both.

use futures_util::{future, Stream, StreamExt};
use tarpc::context::Context;
use tarpc::server::{BaseChannel, Channel};
use transport_tarpc::Payload;

/// The echo, as tarpc sees it.
#[tarpc::service]
pub trait TarpcEcho {
    /// The payload back. A [`Payload`]: on transport-tarpc it crosses without a copy both
    /// ways; on `serde_transport` it is a byte string, as `Bytes` would be.
    async fn unary(payload: Payload) -> Payload;
}

/// The server side of [`TarpcEcho`].
#[derive(Clone, Copy, Debug, Default)]
pub struct EchoServer;

impl TarpcEcho for EchoServer {
    async fn unary(self, _: Context, payload: Payload) -> Payload {
        payload
    }
}

/// Serves [`EchoServer`] on each transport `incoming` yields, every request on a task, until
/// the stream ends (or the task is aborted).
pub async fn serve_all<S, T>(incoming: S)
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
