//! [`MessageTransport`]: a transport-core connection as tarpc's transport, a [`Stream`] of
//! received items and a [`Sink`] of items to send.

use crate::codec::{decode, encode};
use crate::Error;
use futures_util::task::AtomicWaker;
use futures_util::{Sink, Stream};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll, Wake, Waker};
use tokio_util::sync::ReusableBoxFuture;
use transport_core::{
    BufferPool, Connection, Message, MessageReceiver, MessageSender, TransportError, TryRecv,
};

/// Items [`MessageTransport`] queues before `poll_ready` waits for them to be taken: the
/// messages that go to the transport in one `send_batch` (one vectored write on sockets, one
/// doorbell on verbs) when tarpc flushes.
pub const MAX_QUEUED: usize = 64;

// The halves are boxed so that lending one to its future and taking it back moves a pointer,
// not the half itself.
type SendDone<S> = (Box<S>, Vec<Message>, Result<(), TransportError>);
type RecvDone<R> = (Box<R>, Result<Option<Message>, TransportError>);

/// tarpc's transport over one transport-core [`Connection`]: receives `In` and sends `Out`,
/// each as one message encoded with postcard (see the crate docs for the wire format).
///
/// Sending: `start_send` encodes the item straight into a buffer of the connection's pool
/// (registered memory on verbs: sent without a copy) and queues it; `poll_flush` hands the
/// queue to [`MessageSender::send_batch`]. Receiving: a message already there is taken with
/// [`MessageReceiver::try_recv`]; otherwise one `recv` is kept in flight across polls, and
/// polled again only once something it waits on woke it (tarpc polls its stream on every
/// wake-up of its task, whatever woke it). Both
/// futures live in a box allocated once per direction and reused, so a message costs no
/// allocation here beyond what the item's own encoding and decoding need.
///
/// Errors: a transport error, a message the peer cannot take, or one this side cannot decode
/// ends the connection for tarpc (its dispatch stops on the first error of its transport).
pub struct MessageTransport<C: Connection, In, Out> {
    tx: Option<Box<C::Sender>>,
    send: Option<ReusableBoxFuture<'static, SendDone<C::Sender>>>,
    out: SendSide,
    queue: Vec<Message>,
    spare: Vec<Message>,
    pool: Arc<dyn BufferPool>,
    max_out: usize,
    rx: Option<Box<C::Receiver>>,
    recv: Option<ReusableBoxFuture<'static, RecvDone<C::Receiver>>>,
    /// Polls the receive future only when it was woken.
    gate: Gated,
    ended: bool,
    _items: PhantomData<fn(Out) -> In>,
}

impl<C: Connection, In, Out> fmt::Debug for MessageTransport<C, In, Out> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MessageTransport")
            .field("queued", &self.queue.len())
            .field("sending", &self.out)
            .field("receiving", &self.rx.is_none())
            .field("ended", &self.ended)
            .field("max_out", &self.max_out)
            .finish()
    }
}

/// Where the sending half is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SendSide {
    /// At home in `tx`, nothing in flight.
    Idle,
    /// In the send box, with a batch.
    Sending,
    /// In the send box, closing.
    Closing,
    /// Closed: nothing more can be sent.
    Closed,
}

/// Lets a future be polled only when something it waits on woke it. tarpc polls its
/// transport's stream whenever its task wakes, for any reason (a new call, a flush done):
/// several times per message. Polling a waiting `recv` again costs a trip down to the socket's
/// readiness (about 240 instructions); asking the gate costs an atomic swap.
struct Gated {
    gate: Arc<Gate>,
    /// `gate` as the waker the future is polled with, made once.
    waker: Waker,
}

struct Gate {
    /// Something the future waits on fired since it was last polled.
    woken: AtomicBool,
    /// The task polling the transport.
    task: AtomicWaker,
}

impl Wake for Gate {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl Gated {
    fn new() -> Gated {
        let gate = Arc::new(Gate {
            woken: AtomicBool::new(false),
            task: AtomicWaker::new(),
        });
        Gated {
            waker: Waker::from(gate.clone()),
            gate,
        }
    }

    /// Polls `fut` when it is `fresh` (not polled yet) or was woken since its last poll, with
    /// the gate's waker, which wakes `cx`'s task; otherwise returns `Pending` at once (the
    /// task is woken when the future is).
    fn poll<F: Future + ?Sized>(
        &self,
        cx: &mut Context<'_>,
        fut: Pin<&mut F>,
        fresh: bool,
    ) -> Poll<F::Output> {
        self.gate.task.register(cx.waker());
        let woken = self.gate.woken.swap(false, Ordering::AcqRel);
        if !fresh && !woken {
            return Poll::Pending;
        }
        fut.poll(&mut Context::from_waker(&self.waker))
    }
}

// Nothing in the struct is pinned: the futures are boxed, the halves are moved in and out.
impl<C: Connection, In, Out> Unpin for MessageTransport<C, In, Out> {}

impl<C: Connection, In, Out> MessageTransport<C, In, Out> {
    /// Wraps an established connection.
    pub fn new(conn: C) -> Self {
        let (tx, rx) = conn.split();
        MessageTransport {
            gate: Gated::new(),
            pool: tx.buffer_pool(),
            max_out: tx.max_message_size(),
            tx: Some(Box::new(tx)),
            send: None,
            out: SendSide::Idle,
            queue: Vec::new(),
            spare: Vec::new(),
            rx: Some(Box::new(rx)),
            recv: None,
            ended: false,
            _items: PhantomData,
        }
    }

    /// Largest item encoding the peer accepts (its message limit): a larger item fails in
    /// `start_send` with [`Error::TooLarge`], before anything is written.
    pub fn max_item_size(&self) -> usize {
        self.max_out
    }

    /// The connection's buffer pool (registered memory on verbs): keep it before handing the
    /// transport to tarpc, and build [`Payload`](crate::Payload)s in its buffers to send
    /// them with no copy on every backend (a heap `Payload` is copied into registered memory
    /// on verbs).
    pub fn buffer_pool(&self) -> Arc<dyn BufferPool> {
        self.pool.clone()
    }

    /// Drives the send in flight, then starts one for what is queued, until both are done.
    fn poll_sent(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        loop {
            match self.out {
                SendSide::Sending => {
                    let fut = self.send.as_mut().expect("a send future while sending");
                    let (tx, mut spare, r) = ready!(fut.poll(cx));
                    self.out = SendSide::Idle;
                    self.tx = Some(tx);
                    spare.clear();
                    self.spare = spare;
                    r?;
                }
                SendSide::Closing | SendSide::Closed if !self.queue.is_empty() => {
                    return Poll::Ready(Err(Error::Transport(TransportError::Closed)));
                }
                SendSide::Idle | SendSide::Closing | SendSide::Closed => {}
            }
            if self.queue.is_empty() {
                return Poll::Ready(Ok(()));
            }
            let mut tx = self.tx.take().expect("the sender is home when idle");
            let mut batch = std::mem::replace(&mut self.queue, std::mem::take(&mut self.spare));
            self.start(async move {
                let r = tx.send_batch(&mut batch).await;
                (tx, batch, r)
            });
            self.out = SendSide::Sending;
        }
    }

    /// Puts `fut` in the send box (reusing its memory when the layout allows).
    fn start(&mut self, fut: impl Future<Output = SendDone<C::Sender>> + Send + 'static) {
        match &mut self.send {
            Some(b) => b.set(fut),
            None => self.send = Some(ReusableBoxFuture::new(fut)),
        }
    }

    /// The next received message, or the end.
    fn poll_message(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Message>, Error>> {
        let fresh = if let Some(rx) = &mut self.rx {
            match rx.try_recv() {
                TryRecv::Ready(r) => return Poll::Ready(r.map_err(Error::from)),
                TryRecv::Empty | TryRecv::Unknown => {}
            }
            let mut rx = self.rx.take().expect("checked above");
            let fut = async move {
                let r = rx.recv().await;
                (rx, r)
            };
            match &mut self.recv {
                Some(b) => b.set(fut),
                None => self.recv = Some(ReusableBoxFuture::new(fut)),
            }
            true
        } else {
            false
        };
        let fut = self
            .recv
            .as_mut()
            .expect("a receive future while receiving");
        let (rx, r) = ready!(self.gate.poll(cx, fut.get_pin(), fresh));
        self.rx = Some(rx);
        Poll::Ready(r.map_err(Error::from))
    }
}

impl<C: Connection, In: DeserializeOwned, Out> Stream for MessageTransport<C, In, Out> {
    type Item = Result<In, Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        match ready!(this.poll_message(cx)) {
            Ok(Some(msg)) => Poll::Ready(Some(decode(&msg))),
            Ok(None) => {
                this.ended = true;
                Poll::Ready(None)
            }
            Err(e) => Poll::Ready(Some(Err(e))),
        }
    }
}

impl<C: Connection, In, Out: Serialize> Sink<Out> for MessageTransport<C, In, Out> {
    type Error = Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        let this = self.get_mut();
        if this.queue.len() < MAX_QUEUED {
            return Poll::Ready(Ok(()));
        }
        this.poll_sent(cx)
    }

    fn start_send(self: Pin<&mut Self>, item: Out) -> Result<(), Error> {
        let this = self.get_mut();
        let msg = encode(&item, &*this.pool, this.max_out)?;
        this.queue.push(msg);
        Ok(())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        self.get_mut().poll_sent(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        let this = self.get_mut();
        loop {
            match this.out {
                SendSide::Idle | SendSide::Sending => {
                    ready!(this.poll_sent(cx))?;
                    let mut tx = this.tx.take().expect("the sender is home when idle");
                    this.start(async move {
                        let r = tx.close().await;
                        (tx, Vec::new(), r)
                    });
                    this.out = SendSide::Closing;
                }
                SendSide::Closing => {
                    let fut = this.send.as_mut().expect("a close future while closing");
                    let (_tx, _, r) = ready!(fut.poll(cx));
                    this.out = SendSide::Closed;
                    return Poll::Ready(r.map_err(Error::from));
                }
                SendSide::Closed => return Poll::Ready(Ok(())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Counts its polls; ready once its sender sends.
    struct Counted {
        polls: Arc<AtomicUsize>,
        rx: tokio::sync::oneshot::Receiver<u32>,
    }

    impl Future for Counted {
        type Output = u32;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<u32> {
            self.polls.fetch_add(1, Ordering::Relaxed);
            Pin::new(&mut self.rx).poll(cx).map(|r| r.unwrap())
        }
    }

    /// Counts its wake-ups.
    struct Task(AtomicUsize);

    impl Wake for Task {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_waiting_future_is_polled_again_only_once_woken() {
        let polls = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut fut = Counted {
            polls: polls.clone(),
            rx,
        };
        let task = Arc::new(Task(AtomicUsize::new(0)));
        let waker = Waker::from(task.clone());
        let mut cx = Context::from_waker(&waker);
        let gated = Gated::new();
        assert!(gated.poll(&mut cx, Pin::new(&mut fut), true).is_pending());
        for _ in 0..50 {
            assert!(gated.poll(&mut cx, Pin::new(&mut fut), false).is_pending());
        }
        assert_eq!(
            polls.load(Ordering::Relaxed),
            1,
            "polled again before any wake-up"
        );
        assert_eq!(task.0.load(Ordering::Relaxed), 0);
        tx.send(7).unwrap();
        assert_eq!(task.0.load(Ordering::Relaxed), 1, "the gate wakes the task");
        assert_eq!(
            gated.poll(&mut cx, Pin::new(&mut fut), false),
            Poll::Ready(7)
        );
        assert_eq!(polls.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_fresh_future_is_polled_whatever_the_gate_says() {
        let gated = Gated::new();
        let waker = Waker::from(Arc::new(Task(AtomicUsize::new(0))));
        let mut cx = Context::from_waker(&waker);
        let mut pending = std::future::pending::<u32>();
        assert!(gated
            .poll(&mut cx, Pin::new(&mut pending), true)
            .is_pending());
        // The gate is shut (nothing woke the pending future), yet the next future is polled.
        let mut ready = std::future::ready(3);
        assert_eq!(
            gated.poll(&mut cx, Pin::new(&mut ready), true),
            Poll::Ready(3)
        );
    }
}
