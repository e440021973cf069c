//! The `Echo` service on the transport-core RPC layer: each call is one request message and one
//! response message, payload = the bytes themselves (no protobuf, no HTTP/2).
//!
//! The native layer has no streams; the server-streaming call maps to [`NativeEcho::fetch`]
//! calls pipelined on one connection (many in flight, answered in any order).

use bytes::{BufMut, Bytes};
use transport_core::{Connection, MessageSender};
use transport_rpc::{
    code, ClientConfig, Request, RpcClient, RpcError, RpcServer, ServerConfig, Status,
};

/// Method id of the unary echo.
pub const UNARY: u32 = 1;
/// Method id of fetch: request = `size` (u32 LE), response = `size` bytes.
pub const FETCH: u32 = 2;

/// The native server (cheap to clone; `serve(listener)` it).
pub fn server() -> RpcServer<impl transport_rpc::Handler> {
    RpcServer::new(handle, ServerConfig::default())
}

async fn handle(req: Request) -> Result<Bytes, Status> {
    match req.method {
        UNARY => Ok(req.payload),
        FETCH => {
            let size = <[u8; 4]>::try_from(&req.payload[..])
                .map(u32::from_le_bytes)
                .map_err(|_| Status::new(code::INVALID_ARGUMENT, "fetch takes a u32 size"))?;
            // The response is built in a buffer from the connection's pool (registered on verbs).
            let mut buf = req.alloc(size as usize);
            let p = crate::pattern(size as usize, 7);
            buf.put_slice(&p);
            Ok(buf.freeze())
        }
        m => Err(Status::unknown_method(m)),
    }
}

/// A typed client of the native service.
pub struct NativeEcho<S: MessageSender> {
    rpc: RpcClient<S>,
}

impl<S: MessageSender> Clone for NativeEcho<S> {
    fn clone(&self) -> Self {
        NativeEcho {
            rpc: self.rpc.clone(),
        }
    }
}

impl<S: MessageSender> NativeEcho<S> {
    /// A client on an established connection.
    pub fn new<C: Connection<Sender = S>>(conn: C) -> NativeEcho<S> {
        NativeEcho {
            rpc: RpcClient::new(conn, ClientConfig::default()),
        }
    }

    /// Echoes `payload`.
    pub async fn unary(&self, payload: Bytes) -> Result<Bytes, RpcError> {
        self.rpc.call(UNARY, payload).await
    }

    /// Returns `size` bytes from the server.
    pub async fn fetch(&self, size: u32) -> Result<Bytes, RpcError> {
        self.rpc
            .call(FETCH, Bytes::copy_from_slice(&size.to_le_bytes()))
            .await
    }

    /// The underlying RPC client.
    pub fn rpc(&self) -> &RpcClient<S> {
        &self.rpc
    }
}
