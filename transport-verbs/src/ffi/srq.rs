//! Queue pairs created by this crate (so that they can use a shared receive queue, which the
//! binding's builder cannot set up) and the shared receive queue itself.
//!
//! A shared receive queue (SRQ) holds the eager receive buffers of every connection of one
//! device: memory no longer grows with the number of connections. Its rules:
//! - the SRQ owns every buffer posted to it ([`Srq`]'s table) until a completion names the
//!   buffer's slot; the SRQ is destroyed before the table (and its buffers) is released;
//! - a queue pair that receives through the SRQ keeps it alive ([`RawQp`] holds it), so the SRQ
//!   outlives every queue pair that could still consume its buffers;
//! - every slot a completion takes is posted again: with the same buffer when the glue gives it
//!   back, otherwise with a fresh one ([`Srq::refill`]), so the depth stays what it is;
//! - the depth grows ([`Srq::grow`]: doubles, up to the capacity the SRQ was made with) when
//!   the queue runs low, and never shrinks. Slots beyond the depth are never posted.

use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rdma_mummy_sys as sys;
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionQueue};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{BasicPostSendGuard, QueuePair};

use super::LocalMemory;

/// The generations a slot's `wr_id` carries (31 bits: the bit above is `RECV_BIT`).
const GENERATION_MASK: u32 = 0x7fff_ffff;

/// Fresh buffers [`Srq::grow`] makes before posting them.
const GROW_BATCH: usize = 16;

/// Makes a fresh receive buffer for the SRQ (the device's pool).
pub(crate) type FreshBuf<B> = Box<dyn Fn() -> io::Result<B> + Send + Sync>;

/// Where the buffer of a slot is, readable without the table's lock: written while the slot is
/// free (under the lock, before its post), read when a completion names the slot.
#[derive(Default)]
struct SlotMem {
    addr: AtomicU64,
    len: AtomicU32,
    lkey: AtomicU32,
    /// Counts the slot's posts with a new buffer; stored after the fields above (release) and
    /// carried in the post's `wr_id`.
    generation: AtomicU32,
}

struct Table<B> {
    /// One per slot of the capacity; only the first `depth` are ever posted.
    slots: Vec<Option<B>>,
    /// Slots below `depth` holding no buffer.
    free: Vec<usize>,
    /// Buffers the queue keeps posted: where it started, doubled at each [`Srq::grow`].
    depth: usize,
    /// The lists of one post, kept for their capacity (each post rewrites them), so that
    /// posting allocates nothing. Their pointers are used only during that post.
    sges: Vec<sys::ibv_sge>,
    wrs: Vec<sys::ibv_recv_wr>,
}

/// A shared receive queue and the buffers posted to it.
pub(crate) struct Srq<B: LocalMemory> {
    srq: NonNull<sys::ibv_srq>,
    /// Released after the SRQ is destroyed (`Drop` destroys it first).
    table: Mutex<Table<B>>,
    /// Buffers posted right now.
    posted: AtomicUsize,
    /// Each slot's buffer memory, for completions ([`Srq::peek_posted`]).
    mem: Box<[SlotMem]>,
    /// Slots (and the SRQ's `max_wr`): the most buffers it can grow to.
    capacity: usize,
    buf_size: usize,
    fresh: FreshBuf<B>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: the SRQ handle is used only through libibverbs calls, which are thread-safe; the table
// is behind a mutex.
unsafe impl<B: LocalMemory> Send for Srq<B> {}
// SAFETY: as above.
unsafe impl<B: LocalMemory> Sync for Srq<B> {}

impl<B: LocalMemory> Srq<B> {
    /// Creates an SRQ that can hold `capacity` buffers of `buf_size` bytes on `pd` and fills
    /// `depth` of them (`depth` is raised to at least 1, `capacity` to at least `depth`).
    pub(crate) fn new(
        pd: &Arc<ProtectionDomain>,
        depth: usize,
        capacity: usize,
        buf_size: usize,
        fresh: FreshBuf<B>,
    ) -> io::Result<Arc<Srq<B>>> {
        let depth = depth.max(1);
        let capacity = capacity.max(depth);
        let mut init = sys::ibv_srq_init_attr {
            srq_context: std::ptr::null_mut(),
            attr: sys::ibv_srq_attr {
                max_wr: u32::try_from(capacity).map_err(|_| io::ErrorKind::InvalidInput)?,
                max_sge: 1,
                srq_limit: 0,
            },
        };
        // SAFETY: the protection domain is valid while `pd` lives (the SRQ keeps it); `init`
        // is a valid, writable attribute struct for the duration of the call.
        let srq = unsafe { sys::ibv_create_srq(pd.pd().as_ptr(), &mut init) };
        let srq = NonNull::new(srq).ok_or_else(io::Error::last_os_error)?;
        let s = Arc::new(Srq {
            srq,
            table: Mutex::new(Table {
                slots: (0..capacity).map(|_| None).collect(),
                free: (0..depth).rev().collect(),
                depth,
                sges: Vec::new(),
                wrs: Vec::new(),
            }),
            posted: AtomicUsize::new(0),
            mem: (0..capacity).map(|_| SlotMem::default()).collect(),
            capacity,
            buf_size,
            fresh,
            _pd: pd.clone(),
        });
        s.refill()?;
        Ok(s)
    }

    /// The SRQ's handle, for creating queue pairs that receive through it.
    fn raw(&self) -> *mut sys::ibv_srq {
        self.srq.as_ptr()
    }

    /// Buffers the queue keeps posted now (it holds them when full).
    pub(crate) fn depth(&self) -> usize {
        self.table.lock().unwrap_or_else(|p| p.into_inner()).depth
    }

    /// The most buffers the queue can grow to: every one of them may be taken by receives
    /// before a connection's CQ is polled, so each CQ has room for this many.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Doubles the depth, up to the capacity, and posts fresh buffers into the new slots,
    /// [`GROW_BATCH`] at a time: each fresh buffer is a registration, slow enough that the
    /// first ones should be posted before the last are made. The depth counts only slots
    /// whose buffer was made: on failure (no memory for fresh buffers) it stays where the
    /// made ones took it. Returns the depth after it (unchanged at the capacity).
    pub(crate) fn grow(&self) -> io::Result<usize> {
        let mut depth = self.depth();
        let to = depth.saturating_mul(2).min(self.capacity);
        let mut bufs = Vec::with_capacity(GROW_BATCH);
        while depth < to {
            let n = (to - depth).min(GROW_BATCH);
            for _ in 0..n {
                bufs.push((self.fresh)()?);
            }
            {
                let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
                let from = t.depth;
                depth = (from + n).min(self.capacity);
                t.free.extend((from..depth).rev());
                t.depth = depth;
            }
            self.post(&mut bufs)?;
            bufs.clear();
        }
        Ok(depth)
    }

    /// Buffers posted right now.
    pub(crate) fn posted(&self) -> usize {
        self.posted.load(Ordering::Relaxed)
    }

    /// Bytes of the buffers posted right now.
    pub(crate) fn posted_bytes(&self) -> usize {
        self.posted() * self.buf_size
    }

    /// Names the SRQ in asynchronous events ([`super::AsyncEvent::srq_limit_reached`]).
    pub(crate) fn key(&self) -> usize {
        self.srq.as_ptr() as usize
    }

    /// Posted buffers below which the device reports the SRQ low ([`Srq::arm_limit`]): a
    /// quarter of its depth, at least one.
    pub(crate) fn low_water(&self) -> usize {
        (self.depth() / 4).max(1)
    }

    /// Arms the SRQ's limit (`ibv_modify_srq` with `IBV_SRQ_LIMIT`): the next time a receive
    /// leaves it with fewer than [`Srq::low_water`] buffers posted, the device raises
    /// `IBV_EVENT_SRQ_LIMIT_REACHED` once; arm it again after each event.
    pub(crate) fn arm_limit(&self) -> io::Result<()> {
        let mut attr = sys::ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: u32::try_from(self.low_water()).map_err(|_| io::ErrorKind::InvalidInput)?,
        };
        // SAFETY: the SRQ handle is valid while `self` lives; `attr` is a valid attribute
        // struct for the call, of which only `srq_limit` is read (the mask).
        let rc = unsafe {
            sys::ibv_modify_srq(
                self.raw(),
                &mut attr,
                sys::ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as std::os::raw::c_int,
            )
        };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }

    /// Takes the buffer of a receive completion (`None`: not a slot of this SRQ).
    pub(crate) fn take(&self, slot: usize) -> Option<B> {
        let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let buf = t.slots.get_mut(slot).and_then(Option::take)?;
        t.free.push(slot);
        self.posted.fetch_sub(1, Ordering::Relaxed);
        Some(buf)
    }

    /// The memory of the buffer a receive completion names (address, length, key; `wr_id` as
    /// the completion carries it), left in its slot: for a completion whose buffer is posted
    /// again in place ([`Srq::repost`]). Read without the table's lock when the slot's
    /// generation is the one posted with `wr_id`, else (cannot happen) under it. `None`: the
    /// slot holds no buffer.
    pub(crate) fn peek_posted(&self, wr_id: u64) -> Option<(usize, usize, u32)> {
        let slot = super::recv_slot(wr_id);
        let m = self.mem.get(slot)?;
        // Acquire pairs with the release store in `post`: seeing the generation posted with
        // `wr_id` makes that post's address, length and key visible. They cannot change
        // since: a slot gets another buffer only after a completion naming it took the old
        // one, and this completion is the one that does.
        if m.generation.load(Ordering::Acquire) == (wr_id >> 32) as u32 & GENERATION_MASK {
            return Some((
                m.addr.load(Ordering::Relaxed) as usize,
                m.len.load(Ordering::Relaxed) as usize,
                m.lkey.load(Ordering::Relaxed),
            ));
        }
        let t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let b = t.slots.get(slot)?.as_ref()?;
        Some((b.addr(), b.len(), b.lkey()))
    }

    /// Posts the buffer still in its slot again (`wr_id` as its completion carried it, `sge`
    /// from [`Srq::peek_posted`]), after its receive completed and what was needed of it was
    /// copied out. The table is not touched: the slot keeps its buffer (and its generation),
    /// which only a completion naming the slot takes out. On failure the buffer leaves the
    /// table (back to the pool) and the slot is free for a refill.
    pub(crate) fn repost(&self, wr_id: u64, mut sge: sys::ibv_sge) -> io::Result<()> {
        let slot = super::recv_slot(wr_id);
        let mut wr = sys::ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad: *mut sys::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: one well-formed request whose SGE covers the whole buffer of `slot`
        // (registered, local write), which the table owns until a completion names the slot;
        // its last completion did, and its caller copied out what it kept before this post.
        // The SRQ handle is valid while `self` lives; libibverbs serialises posts to one SRQ.
        let rc = unsafe { sys::ibv_post_srq_recv(self.raw(), &mut wr, &mut bad) };
        if rc != 0 {
            // Out of the table and of the posted count (`take`); the caller refills the slot.
            drop(self.take(slot));
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }

    /// Posts `bufs` into free slots (buffers beyond the free slots are dropped: back to the
    /// pool). One `ibv_post_srq_recv` call. Returns the slots still free after it, read under
    /// the same lock (the caller refills them only when there are any).
    pub(crate) fn post(&self, bufs: &mut Vec<B>) -> io::Result<usize> {
        let mut guard = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let t = &mut *guard;
        let n = bufs.len().min(t.free.len());
        let (sges, wrs) = (&mut t.sges, &mut t.wrs);
        sges.clear();
        wrs.clear();
        // Buffers beyond the free slots go back to the pool; the rest are taken from the end.
        bufs.truncate(n);
        while let Some(buf) = bufs.pop() {
            let slot = t.free.pop().expect("counted above");
            let sge = sys::ibv_sge {
                addr: buf.addr() as u64,
                length: buf.len().min(u32::MAX as usize) as u32,
                lkey: buf.lkey(),
            };
            // The slot is free and the table locked: nobody else writes its memory entry, and
            // no completion reads it until this post.
            let m = &self.mem[slot];
            let generation = m.generation.load(Ordering::Relaxed).wrapping_add(1) & GENERATION_MASK;
            m.addr.store(sge.addr, Ordering::Relaxed);
            m.len.store(sge.length, Ordering::Relaxed);
            m.lkey.store(sge.lkey, Ordering::Relaxed);
            m.generation.store(generation, Ordering::Release);
            sges.push(sge);
            wrs.push(sys::ibv_recv_wr {
                wr_id: super::RECV_BIT | u64::from(generation) << 32 | slot as u64,
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                num_sge: 1,
            });
            t.slots[slot] = Some(buf);
        }
        if n == 0 {
            return Ok(t.free.len());
        }
        for i in 0..n {
            wrs[i].sg_list = &mut sges[i];
            if i + 1 < n {
                wrs[i].next = &mut wrs[i + 1] as *mut _;
            }
        }
        let mut bad: *mut sys::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: `wrs` is a well-formed list whose SGEs (in `sges`, untouched across the call)
        // each cover one whole buffer (`LocalMemory`: registered, local write) that the table
        // now owns until a completion names its slot (or until the SRQ, destroyed before the
        // table is released, is gone). The SRQ handle is valid while `self` lives. The table
        // lock is held, so no other thread reuses these slots meanwhile.
        let rc = unsafe { sys::ibv_post_srq_recv(self.raw(), wrs.as_mut_ptr(), &mut bad) };
        if rc != 0 {
            // Requests from `bad` on were not posted: their buffers go back to the pool. A
            // provider that names no request of the list leaves it unknown which were posted:
            // then all stay in the table (a completion may still name them), never released
            // while the device could write into them.
            let Some(first_bad) = (0..n).find(|&i| std::ptr::eq(&wrs[i], bad)) else {
                self.posted.fetch_add(n, Ordering::Relaxed);
                return Err(io::Error::from_raw_os_error(rc));
            };
            for w in &wrs[first_bad..] {
                let slot = super::recv_slot(w.wr_id);
                t.slots[slot] = None;
                t.free.push(slot);
            }
            self.posted.fetch_add(first_bad, Ordering::Relaxed);
            return Err(io::Error::from_raw_os_error(rc));
        }
        self.posted.fetch_add(n, Ordering::Relaxed);
        Ok(t.free.len())
    }

    /// Posts `bufs` (possibly none) into free slots, then fresh buffers into the slots still
    /// free. Returns how many fresh ones were posted.
    pub(crate) fn post_and_refill(&self, bufs: &mut Vec<B>) -> io::Result<usize> {
        let missing = self.post(bufs)?;
        if missing == 0 {
            return Ok(0);
        }
        bufs.extend(
            (0..missing)
                .map(|_| (self.fresh)())
                .collect::<io::Result<Vec<_>>>()?,
        );
        self.post(bufs)?;
        Ok(missing)
    }

    /// Posts fresh buffers into every free slot. Returns how many were posted.
    pub(crate) fn refill(&self) -> io::Result<usize> {
        self.post_and_refill(&mut Vec::new())
    }
}

impl<B: LocalMemory> Drop for Srq<B> {
    fn drop(&mut self) {
        // Every queue pair that used the SRQ is gone (each holds it). The buffers in the table
        // are released after this body, when the device no longer knows them.
        // SAFETY: the SRQ handle is valid and no queue pair is attached any more.
        unsafe { sys::ibv_destroy_srq(self.srq.as_ptr()) };
    }
}

/// How a queue pair receives: into its own receive queue, or through a shared one (kept alive
/// by the queue pair and by its endpoint).
pub(crate) enum RecvQueue<B: LocalMemory> {
    /// Its own receive queue of this depth.
    Own(usize),
    /// The device's shared receive queue.
    Shared(Arc<Srq<B>>),
}

impl<B: LocalMemory> Clone for RecvQueue<B> {
    fn clone(&self) -> Self {
        match self {
            RecvQueue::Own(d) => RecvQueue::Own(*d),
            RecvQueue::Shared(s) => RecvQueue::Shared(s.clone()),
        }
    }
}

impl<B: LocalMemory> RecvQueue<B> {
    /// Receives this queue pair can complete before its driver polls: its own queue's depth,
    /// or every slot the shared queue can grow to (a peer that ignores its credits can fill
    /// them all).
    pub(crate) fn completions(&self) -> usize {
        match self {
            RecvQueue::Own(d) => *d,
            RecvQueue::Shared(s) => s.capacity(),
        }
    }
}

/// What a queue pair keeps of an [`Srq`], whatever its buffer type.
trait SrqHandle: Send + Sync {}

impl<B: LocalMemory> SrqHandle for Srq<B> {}

/// A reliable-connected queue pair created with `ibv_create_qp`.
pub(crate) struct RawQp {
    qp: NonNull<sys::ibv_qp>,
    _cq: Arc<BasicCompletionQueue>,
    /// The shared receive queue this QP receives through, kept alive until the QP is destroyed.
    _srq: Option<Arc<dyn SrqHandle>>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: the handle is used only through libibverbs calls (thread-safe) and owned by this value.
unsafe impl Send for RawQp {}
// SAFETY: as above.
unsafe impl Sync for RawQp {}

/// What a created queue pair can do, as the device granted it.
pub(crate) struct QpCaps {
    pub(crate) max_inline_data: u32,
}

impl RawQp {
    /// Creates an RC queue pair on `pd` whose send and receive completions go to `cq`.
    pub(crate) fn create<B: LocalMemory>(
        pd: &Arc<ProtectionDomain>,
        cq: &Arc<BasicCompletionQueue>,
        send_depth: usize,
        recv: &RecvQueue<B>,
        inline: u32,
    ) -> io::Result<(RawQp, QpCaps)> {
        let (srq, keep, recv_depth): (_, Option<Arc<dyn SrqHandle>>, _) = match recv {
            RecvQueue::Own(d) => (std::ptr::null_mut(), None, *d),
            RecvQueue::Shared(s) => (s.raw(), Some(s.clone()), 0),
        };
        let depth = |d: usize| u32::try_from(d).map_err(|_| io::ErrorKind::InvalidInput);
        // SAFETY: the handle is only read here; `cq` (kept by the returned QP) keeps it valid.
        let cq_ptr = unsafe { cq.cq() }.as_ptr();
        let mut init = sys::ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq_ptr,
            recv_cq: cq_ptr,
            srq,
            cap: sys::ibv_qp_cap {
                max_send_wr: depth(send_depth)?,
                max_recv_wr: depth(recv_depth)?,
                max_send_sge: 2,
                max_recv_sge: if srq.is_null() { 1 } else { 0 },
                max_inline_data: inline,
            },
            qp_type: sys::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: the protection domain, the completion queue and the SRQ (if any) are valid
        // and kept alive by the returned value for as long as the queue pair exists; `init` is
        // valid and writable for the call (the provider writes the granted capabilities back).
        let qp = unsafe { sys::ibv_create_qp(pd.pd().as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(io::Error::last_os_error)?;
        Ok((
            RawQp {
                qp,
                _cq: cq.clone(),
                _srq: keep,
                _pd: pd.clone(),
            },
            QpCaps {
                max_inline_data: init.cap.max_inline_data,
            },
        ))
    }
}

impl Drop for RawQp {
    fn drop(&mut self) {
        // SAFETY: the handle is valid and owned by this value; nothing uses it after this.
        unsafe { sys::ibv_destroy_qp(self.qp.as_ptr()) };
    }
}

// The binding's trait gives `modify` (with its typed errors) and `qp_number` to a queue pair it
// did not create. Work requests are posted with `ibv_post_send`/`ibv_post_recv` by `Endpoint`,
// never through the binding's post guard.
impl QueuePair for RawQp {
    unsafe fn qp(&self) -> NonNull<sys::ibv_qp> {
        self.qp
    }

    type Guard<'g>
        = BasicPostSendGuard<'g>
    where
        Self: 'g;

    fn start_post_send(&mut self) -> Self::Guard<'_> {
        // Never called: `Endpoint::ring` posts work requests itself (see above). The binding
        // gives no way to make its guard for a queue pair it did not create.
        unreachable!("RawQp work requests are posted by Endpoint::ring")
    }
}
