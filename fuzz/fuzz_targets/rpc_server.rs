//! The RPC server (`RpcServer::serve_connection`, over the stream framing on an in-memory
//! socket) fed a connection's worth of frames from a hostile client: RPC headers built from
//! fields (any kind, flags, method, id, announced length) or raw header bytes, any payloads,
//! then raw bytes, then the end of the stream. It must not panic; it must end once the
//! client's stream ends (bounded wait); and everything it writes back must be a whole frame
//! with a valid RPC reply header whose payload length matches and whose request id is one
//! the client used. `RpcHeader::decode` and `Status::decode` are checked on their own too:
//! a decoded header encodes back to the same bytes.
#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use arbitrary::Arbitrary;
use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream, ReadHalf, WriteHalf};
use tokio_util::codec::Decoder;
use transport_core::{Capabilities, Connection, Metrics};
use transport_framed::frame::{FrameDecoder, FramePrefix};
use transport_framed::{StreamConfig, StreamReceiver, StreamSender};
use transport_rpc::header::{Kind, RpcHeader, RPC_HEADER_LEN};
use transport_rpc::{RpcServer, ServerConfig, Status};

const MAX_MESSAGE: usize = 1 << 16;

#[derive(Arbitrary, Debug)]
enum Head {
    /// A header from fields: kind byte, flags, method, request id, announced payload length
    /// (`None`: the true length).
    Fields {
        kind: u8,
        flags: u16,
        method: u32,
        id: u64,
        len: Option<u32>,
    },
    /// Any header bytes (at most 64).
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
struct Input {
    calls: Vec<(Head, Vec<u8>)>,
    trailer: Vec<u8>,
}

/// One end of an in-memory stream connection.
struct Duplex {
    io: DuplexStream,
    config: StreamConfig,
    metrics: Arc<Metrics>,
}

impl Connection for Duplex {
    type Sender = StreamSender<WriteHalf<DuplexStream>>;
    type Receiver = StreamReceiver<ReadHalf<DuplexStream>>;

    fn capabilities(&self) -> Capabilities {
        self.config.capabilities("duplex", false)
    }
    fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }
    fn peer(&self) -> String {
        "fuzz".into()
    }
    fn split(self) -> (Self::Sender, Self::Receiver) {
        let (r, w) = tokio::io::split(self.io);
        (
            StreamSender::new(w, self.metrics.clone(), &self.config),
            StreamReceiver::new(r, self.metrics, &self.config),
        )
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    })
}

fn header_bytes(h: &Head, payload_len: usize) -> Vec<u8> {
    match h {
        Head::Fields {
            kind,
            flags,
            method,
            id,
            len,
        } => {
            let len = len.unwrap_or(payload_len as u32);
            let mut b = vec![0u8; RPC_HEADER_LEN];
            b[0..2].copy_from_slice(b"RP");
            b[2] = 1;
            b[3] = *kind;
            b[4..6].copy_from_slice(&flags.to_le_bytes());
            b[8..12].copy_from_slice(&method.to_le_bytes());
            b[12..20].copy_from_slice(&id.to_le_bytes());
            b[20..24].copy_from_slice(&len.to_le_bytes());
            // The decoder on its own: a header it accepts encodes back to the same bytes.
            if let Ok(d) = RpcHeader::decode(&b) {
                assert_eq!(d.encode()[..], b[..], "decode/encode differ");
            }
            b
        }
        Head::Raw(r) => {
            let r = &r[..r.len().min(64)];
            if let Ok(d) = RpcHeader::decode(r) {
                assert_eq!(d.encode()[..], r[..], "decode/encode differ");
            }
            r.to_vec()
        }
    }
}

fuzz_target!(|input: Input| {
    let mut stream = Vec::new();
    let mut ids = Vec::new();
    for (head, payload) in &input.calls {
        let h = header_bytes(head, payload.len());
        if h.len() >= 20 {
            ids.push(u64::from_le_bytes(h[12..20].try_into().expect("8 bytes")));
        }
        let p = FramePrefix::new(h.len(), payload.len()).expect("lengths within the format");
        stream.extend_from_slice(&p.to_bytes());
        stream.extend_from_slice(&h);
        stream.extend_from_slice(payload);
        let _ = Status::decode(payload);
    }
    stream.extend_from_slice(&input.trailer);

    runtime().block_on(async move {
        let (client, server) = tokio::io::duplex(1 << 16);
        let config = StreamConfig::default().with_max_message_size(MAX_MESSAGE);
        let conn = Duplex {
            io: server,
            config,
            metrics: Arc::default(),
        };
        let rpc = RpcServer::new(
            |req: transport_rpc::Request| async move {
                match req.method {
                    1 => Ok(req.payload),
                    2 => Err(Status::new(7, "refused")),
                    _ => Ok(Bytes::new()),
                }
            },
            ServerConfig::default(),
        );
        let serve = tokio::spawn(async move { rpc.serve_connection(conn).await });
        let (mut rd, mut wr) = tokio::io::split(client);
        let write = async move {
            let _ = wr.write_all(&stream).await;
            let _ = wr.shutdown().await;
            // Keep the write half (and so the connection) until the server is done.
            wr
        };
        let read = async move {
            let mut buf = BytesMut::new();
            let mut d = FrameDecoder::new(usize::MAX);
            loop {
                while let Some(m) = d.decode(&mut buf).expect("the server wrote a valid frame") {
                    let h = RpcHeader::decode(m.header.as_slice())
                        .expect("the server wrote a valid RPC header");
                    h.check_payload(m.payload.len())
                        .expect("the reply's payload has its announced length");
                    assert!(
                        matches!(h.kind, Kind::Response | Kind::Error),
                        "the server sent a {:?}",
                        h.kind
                    );
                    assert!(
                        ids.contains(&h.request_id),
                        "a reply to request id {} that the client never used",
                        h.request_id
                    );
                }
                match rd.read_buf(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
            assert!(
                d.decode_eof(&mut buf).is_ok(),
                "the server's stream ended mid-frame"
            );
        };
        let all = async {
            let (_wr, ()) = tokio::join!(write, read);
            serve.await
        };
        let r = tokio::time::timeout(Duration::from_secs(10), all).await;
        let served = r.expect("the server ended within 10 s of the client's end");
        let _ = served.expect("the server's task did not panic");
    });
});
