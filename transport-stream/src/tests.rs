use super::*;
use futures_util::StreamExt;
use transport_core::Listener;

/// A listener whose every accept fails the same way.
struct Failing(io::ErrorKind);

impl Listener for Failing {
    type Addr = String;
    type Connection = transport_tcp::TcpConnection;

    fn local_addr(&self) -> Result<String, TransportError> {
        Ok("nowhere".into())
    }

    async fn accept(&mut self) -> Result<Self::Connection, TransportError> {
        tokio::task::yield_now().await;
        Err(TransportError::Io(io::Error::new(self.0, "accept failed")))
    }
}

/// A receiver that answers from a script, then clean ends.
struct Scripted {
    replies: std::collections::VecDeque<Result<Option<Message>, TransportError>>,
    metrics: Arc<Metrics>,
}

impl Scripted {
    fn new(replies: impl IntoIterator<Item = Result<Option<Message>, TransportError>>) -> Self {
        Scripted {
            replies: replies.into_iter().collect(),
            metrics: Arc::default(),
        }
    }
}

impl MessageReceiver for Scripted {
    async fn recv(&mut self) -> Result<Option<Message>, TransportError> {
        self.replies.pop_front().unwrap_or(Ok(None))
    }

    fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

/// A sender whose first send fails with `error`; later ones succeed (so a writer that
/// asked again would not see an error from it).
struct FailsOnce {
    error: Option<TransportError>,
    metrics: Arc<Metrics>,
}

impl MessageSender for FailsOnce {
    async fn send(&mut self, _msg: Message) -> Result<(), TransportError> {
        self.error.take().map_or(Ok(()), Err)
    }

    fn max_message_size(&self) -> usize {
        1 << 20
    }

    async fn close(&mut self) -> Result<(), TransportError> {
        Ok(())
    }

    fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

/// The `TransportError` inside an `io::Error`, if there is one.
fn inner(e: &io::Error) -> Option<&TransportError> {
    e.get_ref()?.downcast_ref::<TransportError>()
}

/// The first error's `TransportError`, reached from a later error through `source()`.
fn source_of(e: &io::Error) -> &TransportError {
    use std::error::Error;
    e.source()
        .and_then(|s| s.downcast_ref::<TransportError>())
        .expect("the first error is the source, typed")
}

async fn read_err<R: MessageReceiver>(r: &mut StreamReader<R>) -> io::Error {
    use tokio::io::AsyncReadExt;
    r.read(&mut [0u8; 16]).await.expect_err("the reader failed")
}

/// After the transport fails a read, later reads fail with the same kind and carry the
/// first error typed: `Failed(first)` inside, `first` as the source. The receiver is not
/// asked again (its next answer would be a clean end).
#[tokio::test]
async fn a_failed_reader_keeps_the_transport_error_typed() {
    let cut = TransportError::Truncated {
        received: 5,
        expected: 100,
    };
    let mut r = StreamReader::new(Scripted::new([Err(cut)]));
    let first = read_err(&mut r).await;
    assert_eq!(first.kind(), io::ErrorKind::UnexpectedEof);
    assert!(matches!(
        inner(&first),
        Some(TransportError::Truncated {
            received: 5,
            expected: 100
        })
    ));
    for _ in 0..2 {
        let again = read_err(&mut r).await;
        assert_eq!(again.kind(), io::ErrorKind::UnexpectedEof);
        assert!(matches!(inner(&again), Some(TransportError::Failed(_))));
        assert!(matches!(
            source_of(&again),
            TransportError::Truncated {
                received: 5,
                expected: 100
            }
        ));
        assert!(again.to_string().contains("failed earlier"), "{again}");
    }
}

/// A receiver that already answers `Failed` is not wrapped a second time.
#[tokio::test]
async fn a_repeat_from_the_transport_is_not_wrapped_again() {
    let first = Arc::new(TransportError::Malformed("bad magic"));
    let mut r = StreamReader::new(Scripted::new([Err(TransportError::Failed(first))]));
    let e = read_err(&mut r).await;
    assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    let again = read_err(&mut r).await;
    assert!(matches!(
        source_of(&again),
        TransportError::Malformed("bad magic")
    ));
}

/// After a send fails with an OS error, later writes fail with the same kind and the OS
/// error (its code) is still there, typed, behind `source()`.
#[tokio::test]
async fn a_failed_writer_keeps_the_os_error() {
    use tokio::io::AsyncWriteExt;
    const EPIPE: i32 = 32;
    let sender = FailsOnce {
        error: Some(TransportError::Io(io::Error::from_raw_os_error(EPIPE))),
        metrics: Arc::default(),
    };
    let mut w = StreamWriter::new(sender, &ByteStreamConfig { chunk_size: 4 });
    let first = match w.write_all(b"four").await {
        Err(e) => e,
        Ok(()) => w.flush().await.expect_err("the send failed"),
    };
    assert_eq!(first.raw_os_error(), Some(EPIPE));
    for again in [
        w.write_all(b"more").await.unwrap_err(),
        w.flush().await.unwrap_err(),
        w.write_chunk(Bytes::from_static(b"x")).await.unwrap_err(),
    ] {
        assert_eq!(again.kind(), first.kind());
        match source_of(&again) {
            TransportError::Io(e) => assert_eq!(e.raw_os_error(), Some(EPIPE)),
            other => panic!("expected the first I/O error, got {other:?}"),
        }
    }
}

/// A peer that is not a `ByteStream`, or that ends without the marker, is a typed
/// `ByteStreamError`, the same at every later read.
#[tokio::test]
async fn protocol_errors_are_typed_and_repeat() {
    let foreign = Message::new(HeaderBytes::from([7u8, 7]), Bytes::from_static(b"rpc"));
    let cases = [
        (
            Ok(Some(foreign)),
            ByteStreamError::NotAByteStream {
                header: HeaderBytes::from([7u8, 7]),
            },
        ),
        (Ok(None), ByteStreamError::MissingEndOfStream),
    ];
    for (reply, expected) in cases {
        let mut r = StreamReader::new(Scripted::new([reply]));
        for _ in 0..2 {
            let e = read_err(&mut r).await;
            assert_eq!(e.kind(), expected.kind());
            let got = e
                .get_ref()
                .and_then(|i| i.downcast_ref::<ByteStreamError>());
            assert_eq!(got, Some(&expected));
        }
    }
}

/// `to_io_error` keeps each variant inside, with the kinds it always had; `Failed` takes
/// its first error's kind.
#[test]
fn io_kinds_follow_the_first_error() {
    let cases = [
        (TransportError::Closed, io::ErrorKind::BrokenPipe),
        (TransportError::Malformed("x"), io::ErrorKind::InvalidData),
        (TransportError::Unsupported("x"), io::ErrorKind::Unsupported),
        (
            TransportError::Stalled {
                received: 0,
                expected: 0,
                after: std::time::Duration::ZERO,
            },
            io::ErrorKind::ConnectionAborted,
        ),
        (
            TransportError::Failed(Arc::new(TransportError::Io(io::Error::from(
                io::ErrorKind::ConnectionReset,
            )))),
            io::ErrorKind::ConnectionReset,
        ),
    ];
    for (e, kind) in cases {
        let shown = e.to_string();
        let io = to_io_error(e);
        assert_eq!(io.kind(), kind, "{shown}");
        assert_eq!(inner(&io).map(|t| t.to_string()), Some(shown));
    }
}

/// A lasting accept error is yielded at most once per backoff, not in a tight loop.
#[tokio::test(start_paused = true)]
async fn incoming_backs_off_after_accept_errors() {
    let incoming = StreamListener::new(
        Failing(io::ErrorKind::OutOfMemory),
        ByteStreamConfig::default(),
    )
    .incoming();
    let mut incoming = std::pin::pin!(incoming);
    let start = tokio::time::Instant::now();
    for _ in 0..5 {
        let e = incoming.next().await.expect("the stream never ends");
        assert_eq!(e.err().map(|e| e.kind()), Some(io::ErrorKind::OutOfMemory));
    }
    assert!(
        start.elapsed() >= 5 * ACCEPT_ERROR_BACKOFF,
        "5 errors in {:?}",
        start.elapsed()
    );
}
