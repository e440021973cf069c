//! A hyper/tower connector over any transport (feature `hyper`).
//!
//! [`Connector`] is a `tower_service::Service<http::Uri>` that opens a transport connection and
//! wraps it in a [`ByteStream`] inside hyper's tokio adapter ([`TokioIo`]). The URI is ignored:
//! the connector always dials the address it was built with, so give the client any
//! syntactically valid URI (for example `http://transport.invalid`).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use transport_stream::{hyper_support::Connector, ByteStreamConfig};
//! use transport_uds::UdsTransport;
//!
//! let connector = Connector::new(UdsTransport::default(), "/tmp/svc.sock".parse()?, ByteStreamConfig::default());
//! // tonic: Endpoint::from_static("http://transport.invalid").connect_with_connector(connector)
//! # let _ = connector; Ok(()) }
//! ```

use crate::{ByteStream, ByteStreamConfig};
use hyper_util::rt::TokioIo;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use transport_core::Transport;

/// Dials one address through a transport and yields hyper-ready byte streams.
pub struct Connector<T: Transport> {
    transport: Arc<T>,
    addr: T::Addr,
    config: ByteStreamConfig,
}

impl<T: Transport> Connector<T> {
    /// A connector that dials `addr` through `transport`.
    pub fn new(transport: T, addr: T::Addr, config: ByteStreamConfig) -> Connector<T> {
        Connector::shared(Arc::new(transport), addr, config)
    }

    /// Like [`Connector::new`], sharing a transport.
    pub fn shared(transport: Arc<T>, addr: T::Addr, config: ByteStreamConfig) -> Connector<T> {
        Connector {
            transport,
            addr,
            config,
        }
    }
}

impl<T: Transport> Clone for Connector<T> {
    fn clone(&self) -> Self {
        Connector {
            transport: self.transport.clone(),
            addr: self.addr.clone(),
            config: self.config.clone(),
        }
    }
}

/// The future of `Connector::call` (the `tower_service::Service` impl).
pub type ConnectFuture<C> =
    Pin<Box<dyn Future<Output = io::Result<TokioIo<ByteStream<C>>>> + Send + 'static>>;

impl<T: Transport> tower_service::Service<http::Uri> for Connector<T> {
    type Response = TokioIo<ByteStream<T::Connection>>;
    type Error = io::Error;
    type Future = ConnectFuture<T::Connection>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: http::Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let stream = ByteStream::connect(&*this.transport, &this.addr, this.config).await?;
            Ok(TokioIo::new(stream))
        })
    }
}
