//! The sending side of the client: calls queue their messages, and whoever holds the writer
//! writes every message queued meanwhile in one batch; a write a dropped call started is
//! finished on a spawned task.

use super::*;

impl<S: MessageSender> Shared<S> {
    /// Sends one message: queues it, then writes it, together with whatever other calls
    /// queued meanwhile, unless an earlier writer already took it.
    ///
    /// Calls coalesce: while one batch is being written (on a stream, while the socket is
    /// full), the calls behind it queue their messages and the next writer sends them all in
    /// one `send_batch` (one vectored write). Requests then leave back to back, with one
    /// system call per batch instead of per call, and the server sees no gap between them.
    /// When other calls are in flight, a writer also yields to the runtime once before it
    /// writes, so that calls started in the same turn join its batch. Each caller still
    /// returns only once the transport has taken its own message.
    ///
    /// Dropping the future: a message not yet taken may still be sent by a later writer; a
    /// write already started is finished (by the next writer, or by a task spawned for it),
    /// so the connection never stalls on half a message.
    ///
    /// `others`: whether other calls are in flight, when the caller knows (`None`: looked up).
    pub(super) async fn send(
        self: &Arc<Self>,
        msg: Message,
        others: Option<bool>,
    ) -> Result<(), RpcError> {
        let mut msg = Some(msg);
        let started =
            std::future::poll_fn(|cx| Poll::Ready(self.start_send(&mut msg, others, cx))).await?;
        match started {
            None => Ok(()),
            Some((ticket, writer)) => self.write_through(ticket, writer).await,
        }
    }

    /// [`Shared::send`]'s first step, within the caller's poll: writes `msg` (taken out of
    /// the option) at once if nobody is writing and no other call is in flight (a ping loop,
    /// a stream of oneway calls: see `write_alone`), else queues it. `None` once the
    /// transport has taken it; else its ticket and the writer if this caller holds it, for
    /// [`Shared::write_through`]. The callers on the hot path (a call, a oneway) take this
    /// step themselves, so that a write that goes through at once costs no future of its own.
    #[allow(clippy::type_complexity)]
    pub(super) fn start_send(
        &self,
        msg: &mut Option<Message>,
        others: Option<bool>,
        cx: &mut Context<'_>,
    ) -> Result<Option<(u64, Option<AsyncMutexGuard<'_, Writer<S>>>)>, RpcError> {
        match self.writer.try_lock() {
            Some(mut w)
                if w.unfinished.is_none()
                    && !others.map_or_else(|| self.others_in_flight(), Ok)? =>
            {
                Ok(self
                    .write_alone(&mut w, msg, cx)?
                    .map(|ticket| (ticket, Some(w))))
            }
            w => {
                let Some(m) = msg.take() else {
                    return Err(RpcError::ClientClosed);
                };
                let mut outbox = self.outbox();
                outbox.queue.push(m);
                outbox.queued += 1;
                Ok(Some((outbox.queued, w)))
            }
        }
    }

    /// Whether calls other than the caller's own are in flight; the connection's error once
    /// it has ended (one look at the state for both).
    pub(super) fn others_in_flight(&self) -> Result<bool, RpcError> {
        let st = self.state();
        match &st.closed {
            Some(e) => Err(e.clone()),
            None => Ok(st.pending.len() > 1),
        }
    }

    /// Writes `msg` (taken out of the option) while holding the writer with nothing
    /// unfinished: if no message is queued either, it takes the next ticket and goes straight
    /// to the transport, tried once within the caller's poll (one lock of the outbox, no trip
    /// through the queue, nothing of it kept in the caller's future); a write that cannot
    /// finish at once is left unfinished in the writer, as in [`Shared::write_through`].
    /// Otherwise it joins the queue behind the messages already there. `None` once the
    /// transport took it, else its ticket, for [`Shared::write_through`] to finish with the
    /// writer.
    pub(super) fn write_alone(
        &self,
        writer: &mut Writer<S>,
        msg: &mut Option<Message>,
        cx: &mut Context<'_>,
    ) -> Result<Option<u64>, RpcError> {
        let Some(m) = msg.take() else {
            return Err(RpcError::ClientClosed);
        };
        let upto = {
            let mut outbox = self.outbox();
            outbox.queued += 1;
            if !outbox.queue.is_empty() {
                outbox.queue.push(m);
                return Ok(Some(outbox.queued));
            }
            outbox.queued
        };
        writer.batch.push(m);
        match self.write_once(writer, upto, cx) {
            Poll::Ready(Err(e)) => Err(e),
            Poll::Ready(Ok(())) => Ok(None),
            Poll::Pending => Ok(Some(upto)),
        }
    }

    /// One try at writing the writer's batch, whose last message has ticket `upto`, within
    /// the caller's poll (most writes go through at once: the socket has room, the send queue
    /// has slots). A write that has to wait is left unfinished in the writer: dropping the
    /// pending `send_batch` is allowed (see [`Writer`]). On an error the connection is failed
    /// and its error returned.
    pub(super) fn write_once(
        &self,
        writer: &mut Writer<S>,
        upto: u64,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), RpcError>> {
        let first = std::pin::pin!(writer.sender.send_batch(&mut writer.batch)).poll(cx);
        let Poll::Ready(result) = first else {
            writer.unfinished = Some(upto);
            return Poll::Pending;
        };
        let failed = result.is_err();
        self.record_write(upto, result);
        writer.batch.clear();
        if failed {
            return Poll::Ready(Err(self.closed_error_or(RpcError::ClientClosed)));
        }
        Poll::Ready(Ok(()))
    }

    /// The error the connection ended with (set by `fail_all`), or `otherwise`.
    pub(super) fn closed_error_or(&self, otherwise: RpcError) -> RpcError {
        self.state().closed.clone().unwrap_or(otherwise)
    }

    /// Writes until every message up to `ticket` has been taken by the transport, with the
    /// writer if the caller already holds it.
    pub(super) async fn write_through(
        self: &Arc<Self>,
        ticket: u64,
        writer: Option<AsyncMutexGuard<'_, Writer<S>>>,
    ) -> Result<(), RpcError> {
        let mut writer = match writer {
            Some(w) => w,
            None => match self.writer.try_lock() {
                Some(w) => w,
                None => self.writer.lock().await,
            },
        };
        loop {
            self.finish_write(&mut writer).await;
            if self.written.load(Ordering::Acquire) >= ticket {
                return Ok(());
            }
            let others = {
                let st = self.state();
                if let Some(e) = &st.closed {
                    return Err(e.clone());
                }
                st.pending.len() > 1
            };
            if others {
                // Other calls are in flight: their replies tend to arrive together and the
                // calls they make room for start in the same turn of the runtime. Letting that
                // turn finish first puts their requests in this write (small calls then make
                // several times the calls/s:
                // docs/notes/2026-12-01-bench-rpc-against-raw-first-rounds.md); a lone call (a
                // ping loop) is written at once.
                tokio::task::yield_now().await;
            }
            let upto = {
                let mut outbox = self.outbox();
                std::mem::swap(&mut outbox.queue, &mut writer.batch);
                outbox.queued
            };
            // Tried at once, with no reading alongside; a write that has to wait is finished
            // by `finish_write` at the top of the loop. Its error, if any, has failed every
            // call: the state check above returns it on the next turn.
            let w = &mut *writer;
            let _ = std::future::poll_fn(|cx| Poll::Ready(self.write_once(w, upto, cx))).await;
        }
    }

    /// Records how a write of every message up to ticket `upto` ended.
    pub(super) fn record_write(&self, upto: u64, result: Result<(), TransportError>) {
        match result {
            Ok(()) => self.written.store(upto, Ordering::Release),
            // Messages were checked against the size limit before they were queued, so an
            // error leaves the batch's fate unknown: the connection is done for.
            Err(e) => self.fail_all(RpcError::from(e)),
        }
    }

    /// Drives an unfinished write to its end (the rest of what the first try left
    /// half-written, then the messages it did not take) and records what became of it.
    pub(super) async fn finish_write(self: &Arc<Self>, writer: &mut Writer<S>) {
        let Some(upto) = writer.unfinished else {
            return;
        };
        let mut finish = FinishOnDrop {
            shared: self,
            armed: true,
        };
        // Replies are read meanwhile only if one may come: a peer blocked on writing one to
        // us would otherwise not drain this write. Without any (a stream of oneway calls) the
        // write is awaited alone.
        let owes_nothing = self.state().owes_nothing();
        let result = {
            let Writer { sender, batch, .. } = &mut *writer;
            let mut write = std::pin::pin!(async {
                sender.flush().await?;
                sender.send_batch(batch).await
            });
            if owes_nothing {
                write.await
            } else {
                self.read_while(&mut write).await
            }
        };
        finish.armed = false;
        writer.unfinished = None;
        writer.batch.clear();
        self.record_write(upto, result);
    }
}

/// Finishes a started write on a spawned task when the call driving it is dropped, so the
/// connection is not left with half a message (the server would wait for the rest).
pub(super) struct FinishOnDrop<'a, S: MessageSender> {
    pub(super) shared: &'a Arc<Shared<S>>,
    pub(super) armed: bool,
}

impl<S: MessageSender> Drop for FinishOnDrop<'_, S> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let shared = self.shared.clone();
        rt.spawn(async move {
            // Errors reach the calls through the connection state.
            let mut writer = shared.writer.lock().await;
            shared.finish_write(&mut writer).await;
        });
    }
}
