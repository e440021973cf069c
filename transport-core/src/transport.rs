//! The transport abstraction: connect / listen / accept and message-oriented connections.

use crate::{Capabilities, Message, Metrics, SendBuffer, TransportError};

use std::fmt::{Debug, Display};
use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;

/// A transport backend (TCP, Unix sockets, verbs, ...): the factory of connections.
///
/// Methods are `async` (return `impl Future + Send`), so code generic over `T: Transport`
/// compiles to direct calls: no boxing, no dynamic dispatch on the data path.
pub trait Transport: Send + Sync + 'static {
    /// The address type (`SocketAddr`, a socket path, ...). `Display`/`FromStr` round-trip.
    type Addr: Clone + Debug + Display + FromStr<Err: Debug> + Send + Sync + 'static;
    /// The connection type.
    type Connection: Connection;
    /// The listener type.
    type Listener: Listener<Addr = Self::Addr, Connection = Self::Connection>;

    /// What this backend can do, with this transport's configuration.
    fn capabilities(&self) -> Capabilities;

    /// Opens a connection to a listener at `addr`.
    fn connect(
        &self,
        addr: &Self::Addr,
    ) -> impl Future<Output = Result<Self::Connection, TransportError>> + Send;

    /// Listens at `addr` (a TCP port of 0 picks a free port: see [`Listener::local_addr`]).
    fn listen(
        &self,
        addr: &Self::Addr,
    ) -> impl Future<Output = Result<Self::Listener, TransportError>> + Send;
}

/// Accepts incoming connections.
pub trait Listener: Send + 'static {
    /// The address type.
    type Addr: Clone + Debug + Display + Send + Sync + 'static;
    /// The connection type.
    type Connection: Connection;

    /// The address peers connect to.
    fn local_addr(&self) -> Result<Self::Addr, TransportError>;

    /// Waits for the next connection. Cancel safe: dropping the future loses no connection.
    fn accept(&mut self) -> impl Future<Output = Result<Self::Connection, TransportError>> + Send;
}

/// An established, reliable, ordered, message-oriented connection.
///
/// Split it into a [`MessageSender`] and a [`MessageReceiver`] so that one task can receive
/// while others send.
pub trait Connection: Send + 'static {
    /// The sending half.
    type Sender: MessageSender;
    /// The receiving half.
    type Receiver: MessageReceiver;

    /// What this connection can do.
    fn capabilities(&self) -> Capabilities;

    /// The counters of this connection, shared by both halves.
    fn metrics(&self) -> Arc<Metrics>;

    /// The peer's address, for logs.
    fn peer(&self) -> String;

    /// Splits into independently usable halves.
    fn split(self) -> (Self::Sender, Self::Receiver);
}

/// The sending half of a connection.
pub trait MessageSender: Send + 'static {
    /// Sends one whole message. Returns when the transport has taken it (written to the socket,
    /// or posted and its buffer pinned until completion): the peer has not necessarily read it.
    ///
    /// A message larger than [`MessageSender::max_message_size`] fails with
    /// [`TransportError::MessageTooLarge`] before anything is written.
    ///
    /// Cancel safety: if the future is dropped, the message was either not taken at all, or it
    /// was taken and its remainder goes out with the next `send`, `send_batch`, `flush` or
    /// `close` on this sender. A stream is never left with half a frame.
    fn send(&mut self, msg: Message) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Sends several messages, in order, with as few system calls or doorbells as the backend
    /// can manage. `msgs` is drained.
    ///
    /// Cancel safety: if the future is dropped, the messages still in `msgs` were not taken
    /// (they can be sent again); the one being sent at that moment follows `send`'s rule.
    /// The default sends them one by one and takes each out of `msgs` only when it starts.
    ///
    /// **Backends whose `send` may wait before taking its message** (for credits, ring room
    /// or free slots, as verbs and shm do) must override this: dropped while such a `send`
    /// waits, the default loses the message it took out of `msgs` but `send` never took. The
    /// default cannot keep it in `msgs` instead, since a `send` that did take it finishes it
    /// with the next operation and it would go twice. Every backend in this workspace has its
    /// own (`raw_send_batch_dropped_at_any_poll_loses_nothing` in the conformance suite checks
    /// it).
    fn send_batch(
        &mut self,
        msgs: &mut Vec<Message>,
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        async move {
            while !msgs.is_empty() {
                // Not `drain(..)`: dropping a `Drain` mid-way drops the messages not yet sent.
                let msg = msgs.remove(0);
                self.send(msg).await?;
            }
            Ok(())
        }
    }

    /// Where payload buffers that this backend sends without copying come from.
    fn buffer_pool(&self) -> Arc<dyn BufferPool> {
        Arc::new(HeapPool)
    }

    /// Writes out whatever an earlier, cancelled `send` left half-written.
    fn flush(&mut self) -> impl Future<Output = Result<(), TransportError>> + Send {
        async { Ok(()) }
    }

    /// Largest message (header + payload) the peer accepts, as configured.
    fn max_message_size(&self) -> usize;

    /// Flushes and closes the sending direction; the peer's receiver sees a clean end.
    fn close(&mut self) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// The connection's counters.
    fn metrics(&self) -> &Arc<Metrics>;
}

/// The receiving half of a connection.
pub trait MessageReceiver: Send + 'static {
    /// Receives the next whole message; `Ok(None)` when the peer closed cleanly.
    ///
    /// Cancel safe: dropping the future loses no data (a partially received message stays
    /// buffered for the next call). After a fatal error (see [`TransportError::is_fatal`])
    /// the receiver keeps returning errors.
    fn recv(&mut self) -> impl Future<Output = Result<Option<Message>, TransportError>> + Send;

    /// Bytes still to arrive of a message that has started arriving, when its length is
    /// known; `None` between messages (and always on transports that deliver whole
    /// messages). The RPC server uses it to hold small replies while the next request is
    /// still streaming in, so they go out together.
    fn remaining_in_message(&self) -> Option<usize> {
        None
    }

    /// Whether the next [`recv`](Self::recv) returns a message that has already arrived
    /// whole, without waiting for the peer; `false` when not, or when the transport cannot
    /// tell. The RPC server takes such requests before it writes large replies, and reads
    /// no further until they are written.
    fn has_buffered_message(&self) -> bool {
        false
    }

    /// The next message if it is there now, without waiting and without leaving anything
    /// to wake this task: [`TryRecv::Empty`] when nothing is (the next `recv` would wait),
    /// [`TryRecv::Unknown`] when the transport cannot tell without a `recv` (the default).
    /// The RPC server looks here before it writes the replies it has, so that it does not
    /// start a wait on a connection it is about to write to; the RPC client looks here
    /// before it starts a read, so that a reply already there costs no read future.
    /// An implementation should be cheap when nothing is there (no system call): the
    /// client looks before every read it starts.
    fn try_recv(&mut self) -> TryRecv {
        TryRecv::Unknown
    }

    /// The connection's counters.
    fn metrics(&self) -> &Arc<Metrics>;
}

/// What [`MessageReceiver::try_recv`] found.
#[derive(Debug)]
pub enum TryRecv {
    /// What `recv` would have returned at once.
    Ready(Result<Option<Message>, TransportError>),
    /// Nothing has arrived: `recv` would wait.
    Empty,
    /// The transport cannot tell without a `recv`.
    Unknown,
}

/// A source of send buffers (registered slabs on verbs, the heap on sockets).
pub trait BufferPool: Send + Sync + 'static {
    /// A buffer with room for at least `capacity` bytes (heap memory if the pool cannot serve
    /// that size: sending it then costs the backend a copy or a cached registration).
    fn alloc(&self, capacity: usize) -> SendBuffer;
}

/// The pool of the socket backends: plain heap memory.
#[derive(Debug, Default, Clone, Copy)]
pub struct HeapPool;

impl BufferPool for HeapPool {
    fn alloc(&self, capacity: usize) -> SendBuffer {
        SendBuffer::heap(capacity)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HeaderBytes;
    use bytes::Bytes;

    /// A sender that records what it sent and stops before its `stop_at`-th message.
    struct Stalling {
        sent: Vec<u8>,
        stop_at: usize,
        metrics: Arc<Metrics>,
    }

    impl MessageSender for Stalling {
        async fn send(&mut self, msg: Message) -> Result<(), TransportError> {
            if self.sent.len() == self.stop_at {
                std::future::pending::<()>().await;
            }
            self.sent.push(msg.header.as_slice()[0]);
            Ok(())
        }
        fn max_message_size(&self) -> usize {
            1024
        }
        async fn close(&mut self) -> Result<(), TransportError> {
            Ok(())
        }
        fn metrics(&self) -> &Arc<Metrics> {
            &self.metrics
        }
    }

    /// A default `send_batch` dropped part-way keeps the messages it had not started, in
    /// order, so nothing is lost without the caller knowing.
    #[tokio::test]
    async fn default_send_batch_keeps_unsent_messages_when_dropped() {
        let mut sender = Stalling {
            sent: Vec::new(),
            stop_at: 2,
            metrics: Arc::default(),
        };
        let mut msgs: Vec<Message> = (0..5u8)
            .map(|i| Message::new(HeaderBytes::from([i]), Bytes::new()))
            .collect();
        let batch = tokio::time::timeout(
            std::time::Duration::from_millis(20),
            sender.send_batch(&mut msgs),
        );
        assert!(batch.await.is_err(), "the third message stalls");
        assert_eq!(sender.sent, vec![0, 1]);
        // Message 2 was being sent when the batch was dropped; 3 and 4 were never taken.
        let left: Vec<u8> = msgs.iter().map(|m| m.header.as_slice()[0]).collect();
        assert_eq!(left, vec![3, 4]);
    }
}
