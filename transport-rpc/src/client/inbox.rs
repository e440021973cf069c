//! The receiving half as the client holds it: a read that owns its receiver and outlives
//! the call that polled it, a look at what is there at once, and replies decoded.

use super::*;

/// What the receiving half had at once ([`DynReceiver::try_now`]).
pub(super) enum Found {
    /// A message, decoded: a reply's call id and outcome, or why it is no reply.
    Decoded(Result<(u64, Reply), RpcError>),
    /// The end of the connection, or its error (boxed: rare, and it would make every look's
    /// result several times larger).
    Other(Box<Result<Option<Message>, TransportError>>),
}

/// A receiving half that can be read without naming its type (the client is generic over the
/// sender only).
pub(super) trait DynReceiver: Send {
    /// Polls the read in progress (starting one if none is): cancel safe, the read stays
    /// here for whoever polls next.
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Message>, TransportError>>;

    /// What a read would return at once (a message decoded as a reply), when no read is in
    /// progress and the transport can tell without one ([`MessageReceiver::try_recv`]);
    /// `None` otherwise.
    fn try_now(&mut self) -> Option<Found>;
}

/// What one read of an [`Inbox`] gives: the message (or the end, or the error) and the
/// receiver back.
pub(super) type Received<R> = (Result<Option<Message>, TransportError>, Box<R>);

/// The receiving half and its read: the read owns the (boxed) receiver while it runs and
/// hands it back with what it read, and the next read takes the same allocation. So a read
/// costs no allocation, and a read in progress lives here, not in the future of the call
/// that polled it (a call dropped mid-read leaves it to the next reader).
///
/// Between reads the receiver is `idle`, and a read first asks it for what it has at once
/// ([`MessageReceiver::try_recv`]): a reply that is already there (verbs: in the completion
/// queue) is taken without starting a read future.
pub(super) struct Inbox<R: MessageReceiver> {
    /// The receiver while no read runs; `read` then holds a finished read (kept for its
    /// allocation) that is not polled again.
    pub(super) idle: Option<Box<R>>,
    pub(super) read: ReusableBoxFuture<'static, Received<R>>,
}

impl<R: MessageReceiver> Inbox<R> {
    pub(super) fn new(rx: R) -> Inbox<R> {
        Inbox {
            idle: Some(Box::new(rx)),
            // A placeholder, never polled: the first read takes its own allocation, and the
            // reads after it reuse that one.
            read: ReusableBoxFuture::new(std::future::pending()),
        }
    }
}

/// One read, owning its receiver (async: it starts only when first polled).
pub(super) async fn read_owned<R: MessageReceiver>(mut rx: Box<R>) -> Received<R> {
    let got = rx.recv().await;
    (got, rx)
}

impl<R: MessageReceiver> DynReceiver for Inbox<R> {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Message>, TransportError>> {
        if let Some(rx) = self.idle.as_mut() {
            if let TryRecv::Ready(got) = rx.try_recv() {
                return Poll::Ready(got);
            }
            // Nothing there yet (or the transport cannot tell): a read, in the same
            // allocation as the last one.
            let rx = self.idle.take().expect("checked above");
            self.read.set(read_owned(rx));
        }
        let (got, rx) = std::task::ready!(self.read.poll(cx));
        self.idle = Some(rx);
        Poll::Ready(got)
    }

    fn try_now(&mut self) -> Option<Found> {
        match self.idle.as_mut()?.try_recv() {
            // Decoded here, where the receiver's type is known: the message is not moved
            // through the trait object.
            TryRecv::Ready(Ok(Some(msg))) => Some(Found::Decoded(decode_reply(msg))),
            TryRecv::Ready(other) => Some(Found::Other(Box::new(other))),
            TryRecv::Empty | TryRecv::Unknown => None,
        }
    }
}

/// A reply's call id and outcome; an error when the message is no reply.
pub(super) fn decode_reply(msg: Message) -> Result<(u64, Reply), RpcError> {
    let h = RpcHeader::decode(msg.header.as_slice())?;
    h.check_payload(msg.payload.len())?;
    match h.kind {
        Kind::Response => Ok((h.request_id, Ok(msg.payload))),
        Kind::Error => Ok((
            h.request_id,
            Err(RpcError::Remote(Status::decode(&msg.payload))),
        )),
        other => Err(ProtocolError::UnexpectedKind {
            from: "server",
            kind: other,
        }
        .into()),
    }
}
