//! The byte-stream adapter over every backend: the same cases per transport.
//!
//! Each backend is one `stream_tests!(module_name, BackendExpr)` line; the backend type is the
//! conformance suite's [`Backend`] (the verbs backend implements it too).

use bytes::Bytes;
use std::io;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use transport_core::{Connection, HeaderBytes, Message, MessageSender, Transport};
use transport_stream::{ByteStream, ByteStreamConfig, ByteStreamError, StreamListener};
use transport_test::conformance::{pattern, Backend, PROMPT};

const MIB: usize = 1 << 20;
const MAX_MESSAGE: usize = 64 * MIB;

use transport_tcp::conformance::TcpBackend as Tcp;
use transport_uds::conformance::UdsBackend as Uds;
use transport_verbs::conformance::VerbsBackend;

type Stream<B> = ByteStream<<<B as Backend>::T as Transport>::Connection>;

/// A connected (client, server) pair of streams.
async fn pair<B: Backend>(b: &B, config: ByteStreamConfig) -> (Stream<B>, Stream<B>) {
    let t = b.transport(MAX_MESSAGE);
    let mut listener = StreamListener::bind(&t, &b.listen_addr(), config.clone())
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let (client, server) = tokio::join!(ByteStream::connect(&t, &addr, config), listener.accept());
    (client.unwrap(), server.unwrap())
}

/// 16 MiB written in one call, echoed back by the server through `tokio::io::copy`, read back
/// and compared; large writes become few messages.
async fn round_trip_16mb<B: Backend>(b: &B) {
    let (client, server) = pair(b, ByteStreamConfig::default()).await;
    let echo = tokio::spawn(async move {
        let (mut r, mut w) = server.into_split();
        let n = tokio::io::copy_buf(&mut r, &mut w).await?;
        w.shutdown().await?;
        io::Result::Ok(n)
    });
    let data = pattern(16 * MIB, 1);
    let metrics = client.metrics().clone();
    let (mut r, mut w) = client.into_split();
    let writer = {
        let data = data.clone();
        tokio::spawn(async move {
            w.write_all(&data).await?;
            w.shutdown().await
        })
    };
    let mut back = Vec::new();
    r.read_to_end(&mut back).await.unwrap();
    writer.await.unwrap().unwrap();
    assert_eq!(echo.await.unwrap().unwrap(), data.len() as u64);
    assert!(back == data, "echoed bytes differ");
    let sent = metrics.messages_sent.get();
    assert!(sent <= 3, "16 MiB in one write took {sent} messages");
}

/// 100 000 writes of 7 bytes arrive intact, coalesced into chunk-sized messages.
async fn many_small_writes<B: Backend>(b: &B) {
    let config = ByteStreamConfig::default().with_chunk_size(64 << 10);
    let (mut client, mut server) = pair(b, config).await;
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.map(|_| got)
    });
    let mut expect = Vec::new();
    for i in 0..100_000u32 {
        let w = [(i % 251) as u8, 1, 2, 3, 4, 5, (i >> 8) as u8];
        client.write_all(&w).await.unwrap();
        expect.extend_from_slice(&w);
    }
    client.shutdown().await.unwrap();
    let got = reader.await.unwrap().unwrap();
    assert!(got == expect, "bytes differ");
    let sent = client.metrics().messages_sent.get() as usize;
    let bound = expect.len() / (64 << 10) + 2;
    assert!(sent <= bound, "{sent} messages for {} bytes", expect.len());
}

/// Vectored writes (what hyper/h2 use) gather into one message.
async fn vectored_write_is_one_message<B: Backend>(b: &B) {
    let (mut client, mut server) = pair(b, ByteStreamConfig::default()).await;
    let parts = [
        io::IoSlice::new(b"head"),
        io::IoSlice::new(b"-"),
        io::IoSlice::new(b"body"),
    ];
    let n = client.write_vectored(&parts).await.unwrap();
    assert_eq!(n, 9);
    client.flush().await.unwrap();
    assert_eq!(client.metrics().messages_sent.get(), 1);
    let chunk = server.read_chunk().await.unwrap().unwrap();
    assert_eq!(&chunk[..], b"head-body");
}

/// One side shuts down its writing direction; the other reads EOF and can still answer.
async fn half_close<B: Backend>(b: &B) {
    let (mut client, mut server) = pair(b, ByteStreamConfig::default()).await;
    client.write_all(b"question").await.unwrap();
    client.shutdown().await.unwrap();
    let err = client.write_all(b"more").await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);

    let mut q = Vec::new();
    server.read_to_end(&mut q).await.unwrap();
    assert_eq!(q, b"question");
    assert_eq!(
        server.read(&mut [0u8; 8]).await.unwrap(),
        0,
        "EOF is sticky"
    );
    server.write_all(b"answer").await.unwrap();
    server.shutdown().await.unwrap();

    let mut a = String::new();
    client.read_to_string(&mut a).await.unwrap();
    assert_eq!(a, "answer");
}

/// A peer that drops its stream mid-stream (no shutdown) is an error for the reader, promptly.
async fn peer_death_fails_reader<B: Backend>(b: &B) {
    let (mut client, mut server) = pair(b, ByteStreamConfig::default()).await;
    client.write_all(&pattern(100_000, 2)).await.unwrap();
    client.flush().await.unwrap();
    let mut first = vec![0u8; 1000];
    server.read_exact(&mut first).await.unwrap();
    // The server dies holding unread data and without sending the end-of-stream marker.
    drop(server);
    let mut sink = Vec::new();
    let r = tokio::time::timeout(PROMPT, client.read_to_end(&mut sink))
        .await
        .expect("reader hung after the peer died");
    let e = r.expect_err("peer death must be an error, not a clean EOF");
    assert!(
        matches!(
            e.kind(),
            io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe
        ),
        "unexpected error kind {:?}: {e}",
        e.kind()
    );
    // The reader stays failed, and a later read still says why.
    let again = client.read(&mut [0u8; 8]).await.expect_err("stays failed");
    assert_eq!(again.kind(), e.kind());
    assert!(again.to_string().contains(&e.to_string()), "{again} / {e}");
}

/// Sockets: a writer whose peer dropped its stream (unread data and all) gets an error instead
/// of blocking forever: from a write or flush once the kernel answers with a reset, at the
/// latest from `shutdown`. (Not run on verbs: there a dropped connection lingers and discards
/// what still arrives, so only a peer that really dies is detected; see
/// `peer_process_killed`.)
async fn dropped_peer_fails_writer<B: Backend>(b: &B) {
    let (mut client, server) = pair(b, ByteStreamConfig::default()).await;
    drop(server);
    let chunk = vec![7u8; MIB];
    let r = tokio::time::timeout(PROMPT * 6, async {
        for _ in 0..64 {
            client.write_all(&chunk).await?;
            client.flush().await?;
        }
        client.shutdown().await
    })
    .await
    .expect("writer hung after the peer died");
    assert!(
        r.is_err(),
        "64 MiB and a shutdown to a dead peer without an error"
    );
    // Errors are sticky.
    assert!(client.write_all(b"x").await.is_err());
}

const CHILD_ENV: &str = "TRANSPORT_STREAM_TEST_CHILD";
const CHILD_READY: &str = "STREAM_CHILD_LISTENING ";

/// The child process of [`peer_process_killed`]: accepts one stream, reads and discards,
/// writes without end until killed (bounded, so an orphan cannot live forever).
async fn stream_child<B: Backend>(b: &B) {
    use std::io::Write;
    let t = b.transport(MAX_MESSAGE);
    let mut l = StreamListener::bind(&t, &b.listen_addr(), ByteStreamConfig::default())
        .await
        .unwrap();
    println!("\n{CHILD_READY}{}", l.local_addr().unwrap());
    std::io::stdout().flush().unwrap();
    let (mut r, mut w) = l.accept().await.unwrap().into_split();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 64 << 10];
        while r.read(&mut buf).await.is_ok_and(|n| n > 0) {}
    });
    let chunk = pattern(256 << 10, 9);
    let end = std::time::Instant::now() + std::time::Duration::from_secs(100);
    while std::time::Instant::now() < end {
        if w.write_all(&chunk).await.is_err() || w.flush().await.is_err() {
            break;
        }
    }
}

/// The peer process is killed (SIGKILL) mid-stream, both directions busy: the reader gets an
/// error (not a clean EOF) once the data sent before the death is drained, and the writer gets
/// an error at the latest from `shutdown`; neither hangs.
async fn peer_process_killed<B: Backend>(b: &B, test_name: &str) {
    use tokio::io::AsyncBufReadExt as _;
    if std::env::var_os(CHILD_ENV).is_some() {
        return stream_child(b).await;
    }
    let exe = std::env::current_exe().unwrap();
    let mut child = tokio::process::Command::new(exe)
        // `--include-ignored`: the parent may be a device test, ignored unless asked for.
        .args([
            test_name,
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
            "--include-ignored",
        ])
        .env(CHILD_ENV, "1")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the child");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = loop {
        let line = tokio::time::timeout(PROMPT * 6, lines.next_line())
            .await
            .expect("child started in time")
            .unwrap()
            .expect("child printed its address");
        if let Some(at) = line.find(CHILD_READY) {
            break line[at + CHILD_READY.len()..]
                .trim()
                .parse::<<B::T as Transport>::Addr>()
                .expect("child address");
        }
    };
    let t = b.transport(MAX_MESSAGE);
    let stream = ByteStream::connect(&t, &addr, ByteStreamConfig::default())
        .await
        .unwrap();
    let (mut r, mut w) = stream.into_split();
    let mut buf = vec![0u8; MIB];
    r.read_exact(&mut buf).await.unwrap();
    assert!(
        buf[..256 << 10] == pattern(256 << 10, 9)[..],
        "child's bytes differ"
    );
    let chunk = vec![1u8; MIB];
    w.write_all(&chunk).await.unwrap();
    w.flush().await.unwrap();

    child.start_kill().unwrap();
    child.wait().await.unwrap();

    let read = tokio::time::timeout(PROMPT, async {
        loop {
            match r.read(&mut buf).await {
                Ok(0) => break Ok(()),
                Ok(_) => continue,
                Err(e) => break Err(e),
            }
        }
    })
    .await
    .expect("reader hung after the peer process died");
    let e = read.expect_err("a killed peer must be an error for the reader, not a clean EOF");
    eprintln!("reader after peer kill: {:?}: {e}", e.kind());

    let write = tokio::time::timeout(PROMPT * 6, async {
        for _ in 0..64 {
            w.write_all(&chunk).await?;
            w.flush().await?;
        }
        w.shutdown().await
    })
    .await
    .expect("writer hung after the peer process died");
    let e = write.expect_err("64 MiB and a shutdown to a killed peer without an error");
    eprintln!("writer after peer kill: {:?}: {e}", e.kind());
}

/// `write_chunk` / `read_chunk` move payloads without copies through the adapter.
async fn zero_copy_chunks<B: Backend>(b: &B) {
    let (mut client, mut server) = pair(b, ByteStreamConfig::default()).await;
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        while let Some(c) = server.read_chunk().await? {
            got.extend_from_slice(&c);
        }
        io::Result::Ok((got, server.metrics().payload_bytes_copied.get()))
    });
    let data = pattern(3 * MIB, 3);
    client.write_chunk(data.clone()).await.unwrap();
    client.shutdown().await.unwrap();
    let (got, server_copied) = reader.await.unwrap().unwrap();
    assert!(got == data, "bytes differ");
    assert_eq!(client.metrics().payload_bytes_copied.get(), 0);
    // The adapter copies nothing. Below it, a socket backend has read up to one read buffer
    // ahead before it learns a large frame's length, and copies that part into the frame's
    // buffer (counted); verbs receives into registered memory and copies nothing.
    let read_ahead = if b.transport(MAX_MESSAGE).capabilities().registered_buffers {
        0
    } else {
        transport_framed::DEFAULT_READ_BUFFER as u64
    };
    assert!(
        server_copied <= read_ahead,
        "{server_copied} bytes copied on receive, at most {read_ahead} expected"
    );
}

/// Reads through `AsyncBufRead` (lines) across message boundaries.
async fn buf_read_lines<B: Backend>(b: &B) {
    let (mut client, server) = pair(b, ByteStreamConfig::default().with_chunk_size(5)).await;
    client.write_all(b"alpha\nbeta\ngamma\n").await.unwrap();
    client.shutdown().await.unwrap();
    let mut lines = server.lines();
    let mut got = Vec::new();
    while let Some(l) = lines.next_line().await.unwrap() {
        got.push(l);
    }
    assert_eq!(got, ["alpha", "beta", "gamma"]);
}

/// A peer that is not a byte stream (a message with an unknown header) is `InvalidData`, a typed
/// [`ByteStreamError`] carrying the header, and the reader stays failed with the same error.
async fn foreign_message_is_invalid_data<B: Backend>(b: &B) {
    let t = b.transport(MAX_MESSAGE);
    let mut listener = StreamListener::bind(&t, &b.listen_addr(), ByteStreamConfig::default())
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let (raw, server) = tokio::join!(t.connect(&addr), listener.accept());
    let (mut tx, _rx) = raw.unwrap().split();
    let mut server = server.unwrap();
    tx.send(Message::new(
        HeaderBytes::from([1u8, 2, 3]),
        Bytes::from_static(b"x"),
    ))
    .await
    .unwrap();
    let expected = ByteStreamError::NotAByteStream {
        header: HeaderBytes::from([1u8, 2, 3]),
    };
    for _ in 0..2 {
        let e = server.read(&mut [0u8; 16]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        let typed = e
            .get_ref()
            .and_then(|i| i.downcast_ref::<ByteStreamError>());
        assert_eq!(typed, Some(&expected));
    }
}

macro_rules! stream_tests {
    ($module:ident, $backend:expr $(, extra: [$($extra:ident),*])? $(, #[$attr:meta])*) => {
        mod $module {
            use super::*;
            transport_test::backend_cases!([super::] $backend, $(#[$attr])*;
                round_trip_16mb,
                many_small_writes,
                vectored_write_is_one_message,
                half_close,
                peer_death_fails_reader,
                zero_copy_chunks,
                buf_read_lines,
                foreign_message_is_invalid_data
                $($(, $extra)*)?
            );

            #[test]
            $(#[$attr])*
            fn peer_process_killed() {
                let backend = $backend;
                transport_test::conformance::run("peer_process_killed", async move {
                    let name = concat!(stringify!($module), "::peer_process_killed");
                    super::peer_process_killed(&backend, name).await
                });
            }
        }
    };
}

stream_tests!(tcp, Tcp, extra: [dropped_peer_fails_writer]);
stream_tests!(uds, Uds, extra: [dropped_peer_fails_writer]);
stream_tests!(
    verbs,
    VerbsBackend::for_this_machine(),
    #[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
);
