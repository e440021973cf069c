//! tonic integration (feature `tonic`): serve and call gRPC over any transport.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use tonic::transport::{Endpoint, Server};
//! use transport_stream::{hyper_support::Connector, ByteStreamConfig, StreamListener};
//! use transport_tcp::TcpTransport;
//!
//! let tcp = TcpTransport::default();
//! let listener = StreamListener::bind(&tcp, &"127.0.0.1:0".parse()?, ByteStreamConfig::default()).await?;
//! let addr = listener.local_addr()?;
//! // Server::builder().add_service(MyServer::new(svc)).serve_with_incoming(listener.incoming()).await?;
//! let channel = Endpoint::from_static("http://transport.invalid")
//!     .connect_with_connector(Connector::new(tcp, addr, ByteStreamConfig::default()))
//!     .await?;
//! // MyClient::new(channel).my_method(..).await?;
//! # Ok(()) }
//! ```

use crate::ByteStream;
use transport_core::Connection;

/// What a tonic handler sees of the connection (`request.extensions().get::<StreamInfo>()`).
#[derive(Debug, Clone)]
pub struct StreamInfo {
    /// The peer's address as the transport reports it.
    pub peer: String,
}

impl<C: Connection> tonic::transport::server::Connected for ByteStream<C> {
    type ConnectInfo = StreamInfo;

    fn connect_info(&self) -> StreamInfo {
        StreamInfo {
            peer: self.peer().to_string(),
        }
    }
}
