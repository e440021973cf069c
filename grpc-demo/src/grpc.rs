//! The `Echo` service on tonic, over any transport through `transport-stream`.

use crate::pb::echo_client::EchoClient;
use crate::pb::echo_server::{Echo, EchoServer};
use crate::pb::{EchoReply, EchoRequest, StreamRequest};
use crate::MAX_MESSAGE;
use futures_util::{Stream, StreamExt};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status, Streaming};
use transport_core::{Listener, Transport};
use transport_stream::hyper_support::Connector;
use transport_stream::{ByteStreamConfig, StreamListener};

/// HTTP/2 flow-control windows used on both sides. h2's defaults (64 KiB per stream) cap a
/// large message at one window per round trip; these let a 1 MiB call go out in one go.
pub const STREAM_WINDOW: u32 = 8 << 20;
/// HTTP/2 connection window, see [`STREAM_WINDOW`].
pub const CONNECTION_WINDOW: u32 = 16 << 20;
/// Largest HTTP/2 frame either side accepts. h2's default (16 KiB) makes it write, and flush,
/// one 16 KiB frame at a time: one transport message each.
pub const MAX_FRAME: u32 = 1 << 20;

/// The service implementation.
#[derive(Debug, Default, Clone)]
pub struct EchoService;

type ReplyStream = Pin<Box<dyn Stream<Item = Result<EchoReply, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Echo for EchoService {
    async fn unary(&self, req: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        Ok(Response::new(EchoReply {
            payload: req.into_inner().payload,
            seq: 0,
        }))
    }

    type ServerStreamStream = ReplyStream;

    async fn server_stream(
        &self,
        req: Request<StreamRequest>,
    ) -> Result<Response<ReplyStream>, Status> {
        let StreamRequest { count, size } = req.into_inner();
        if size as usize > MAX_MESSAGE - 64 {
            return Err(Status::invalid_argument("size above the max message size"));
        }
        // One payload, shared by every reply (the encoder copies it into HTTP/2 frames).
        let payload = crate::pattern(size as usize, 7);
        let stream = futures_util::stream::iter(0..u64::from(count)).map(move |seq| {
            Ok(EchoReply {
                payload: payload.clone(),
                seq,
            })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    type BidiStream = ReplyStream;

    async fn bidi(
        &self,
        req: Request<Streaming<EchoRequest>>,
    ) -> Result<Response<ReplyStream>, Status> {
        let stream = req.into_inner().enumerate().map(|(seq, r)| {
            r.map(|m| EchoReply {
                payload: m.payload,
                seq: seq as u64,
            })
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// The tonic service with this crate's message limits.
pub fn service() -> EchoServer<EchoService> {
    EchoServer::new(EchoService)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE)
}

/// Serves `Echo` on every stream `listener` accepts until `shutdown` completes.
pub async fn serve<L: Listener>(
    listener: StreamListener<L>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    Server::builder()
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .add_service(service())
        .serve_with_incoming_shutdown(listener.incoming(), shutdown)
        .await
}

/// A tonic client of `Echo` at `addr` over `transport`. The HTTP URI is a placeholder: the
/// connector dials `addr`.
pub async fn connect<T: Transport>(
    transport: T,
    addr: T::Addr,
) -> Result<EchoClient<Channel>, tonic::transport::Error> {
    connect_shared(Arc::new(transport), addr).await
}

/// [`connect`] with a shared transport.
pub async fn connect_shared<T: Transport>(
    transport: Arc<T>,
    addr: T::Addr,
) -> Result<EchoClient<Channel>, tonic::transport::Error> {
    let channel = Endpoint::from_static("http://transport.invalid")
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .connect_with_connector(Connector::shared(
            transport,
            addr,
            ByteStreamConfig::default(),
        ))
        .await?;
    Ok(EchoClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE))
}
