//! The pending-call table: each call's entry (its waker, its reply when another task read
//! it), the call ids, and who waits for the receiving half.

use super::*;

pub(super) type Reply = Result<Bytes, RpcError>;

/// A call waiting for its reply.
pub(super) struct Waiting {
    /// Its request id (see [`Pending`]).
    pub(super) id: u64,
    /// Its reply, once read (or the connection's error).
    pub(super) reply: Option<Reply>,
    /// Woken when the reply is put here, or when the receiving half is free for it to read.
    pub(super) waker: Option<Waker>,
    /// Queued in [`State::want_inbox`].
    pub(super) wants_inbox: bool,
}

/// The calls in flight, by request id: a slab whose slot index is the id's low 32 bits and
/// whose high 32 bits are a generation that changes with every call (never 0, so no call has
/// id 0, the id of oneway calls). A reply to a call that went away finds its slot empty or
/// taken by a later call under another generation: it is dropped. Entering and removing a
/// call costs a few instructions, not a hash table's probe.
#[derive(Default)]
pub(super) struct Pending {
    pub(super) calls: Slab<Waiting>,
    pub(super) generation: u32,
}

impl Pending {
    /// Enters a new call; its id.
    pub(super) fn insert(&mut self) -> u64 {
        self.generation = self.generation.wrapping_add(1).max(1);
        let entry = self.calls.vacant_entry();
        // Below 2^32: the table holds at most `MAX_IN_FLIGHT` calls.
        let id = u64::from(self.generation) << 32 | entry.key() as u64;
        entry.insert(Waiting {
            id,
            reply: None,
            waker: None,
            wants_inbox: false,
        });
        id
    }

    pub(super) fn slot(id: u64) -> usize {
        (id & 0xffff_ffff) as usize
    }

    pub(super) fn get_mut(&mut self, id: u64) -> Option<&mut Waiting> {
        self.calls.get_mut(Self::slot(id)).filter(|w| w.id == id)
    }

    pub(super) fn remove(&mut self, id: u64) -> Option<Waiting> {
        let slot = Self::slot(id);
        if self.calls.get(slot)?.id != id {
            return None;
        }
        Some(self.calls.remove(slot))
    }

    pub(super) fn len(&self) -> usize {
        self.calls.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Waiting> {
        self.calls.iter().map(|(_, w)| w)
    }

    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut Waiting> {
        self.calls.iter_mut().map(|(_, w)| w)
    }
}

/// The most calls a client keeps in flight, whatever [`ClientConfig::max_in_flight`] says:
/// a call's slot index must fit in the low half of its id.
pub(super) const MAX_IN_FLIGHT: usize = 1 << 31;

/// The calls in flight and the receiving half, under one lock (no channel per call, no
/// async lock for the receiver: a call that waits registers its waker in its entry).
pub(super) struct State {
    pub(super) pending: Pending,
    /// Set once the connection is gone: every later call fails with it.
    pub(super) closed: Option<RpcError>,
    /// The receiving half while nobody reads it; taken by the call (or the blocked write)
    /// that reads, and put back when it stops ([`Reading`]).
    pub(super) inbox: Option<Box<dyn DynReceiver>>,
    /// Calls without a reply that wait for the receiving half, oldest first (entries of calls
    /// that ended or got their reply since are skipped).
    pub(super) want_inbox: VecDeque<u64>,
    /// A write the peer does not drain waits here to read replies meanwhile.
    pub(super) writer_waker: Option<Waker>,
    /// A call went away before its answer was read: an answer may still come for it, which
    /// no entry of `pending` tells (see [`State::owes_nothing`]).
    pub(super) orphaned: bool,
    /// Calls waiting for a slot (`pending` is full: [`ClientConfig::max_in_flight`]); each
    /// entry removed then wakes one of them ([`Shared::slot_freed`]).
    pub(super) slot_waiters: usize,
    /// `close` waits for `pending` to empty ([`Shared::idle`]).
    pub(super) close_waits: bool,
}

impl State {
    /// Whether no answer can be on its way: no call waits for one and none went away before
    /// its own arrived. A blocked write then has nothing to read meanwhile (a request that
    /// starts now is written only after it).
    pub(super) fn owes_nothing(&self) -> bool {
        self.pending.is_empty() && !self.orphaned
    }

    /// When the receiving half is free and calls wait for it, the wakers that should come
    /// and take it: the oldest waiting call, and the blocked write if there is one.
    pub(super) fn pass_inbox(&mut self) -> (Option<Waker>, Option<Waker>) {
        if self.inbox.is_none() {
            return (None, None);
        }
        let mut call = None;
        while let Some(id) = self.want_inbox.pop_front() {
            if let Some(w) = self.pending.get_mut(id) {
                w.wants_inbox = false;
                if w.reply.is_none() {
                    if let Some(waker) = w.waker.take() {
                        call = Some(waker);
                        break;
                    }
                }
            }
        }
        (call, self.writer_waker.take())
    }

    /// Removes call `id`'s entry, noting who must be woken for the slot it frees.
    pub(super) fn remove(&mut self, id: u64, freed: &mut Freed) -> Option<Waiting> {
        let w = self.pending.remove(id)?;
        freed.slot |= self.slot_waiters > 0;
        freed.idle |= self.close_waits && self.pending.is_empty();
        Some(w)
    }
}

/// Who to wake once an entry has left `pending` (after the lock is released): a call waiting
/// for a slot, and `close` once none is left.
#[derive(Default)]
pub(super) struct Freed {
    pub(super) slot: bool,
    pub(super) idle: bool,
}

pub(super) fn wake_all((a, b): (Option<Waker>, Option<Waker>)) {
    if let Some(w) = a {
        w.wake();
    }
    if let Some(w) = b {
        w.wake();
    }
}
