//! The crate's only `unsafe` code: the calls into the verbs binding that the compiler cannot check.
//!
//! Everything here is small and commented; the rest of the crate is safe Rust.
//!
//! The rule that makes the data path sound is encoded in [`Endpoint`]: every work request is
//! posted together with the owner of the memory it reads or writes (a pool buffer, a payload
//! [`Bytes`] kept alive together with its registration), and the endpoint keeps that owner in its
//! send FIFO or receive table until the work request's completion comes back. The queue pair is
//! the first field of the endpoint, so on drop it is destroyed (no more DMA) before any memory
//! it could touch is released.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use bytes::Bytes;
use rdma_mummy_sys as sys;
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue};
use sideway::ibverbs::memory_region::{MemoryRegion, RegisterMemoryRegionError};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairState};
use sideway::ibverbs::AccessFlags;

use crate::pool::PoolBuf;

/// A heap buffer registered with a protection domain. The registration is dropped before the
/// memory (field order), so the device never holds a key to freed memory.
pub(crate) struct OwnedRegion {
    // Declared first: dropped first (ibv_dereg_mr), then `buf` is freed.
    mr: Arc<MemoryRegion>,
    buf: Box<[u8]>,
}

impl OwnedRegion {
    /// Allocates `len` zeroed bytes and registers them for local write and remote read/write.
    pub(crate) fn new(
        pd: &Arc<ProtectionDomain>,
        len: usize,
    ) -> Result<Self, RegisterMemoryRegionError> {
        let mut buf = vec![0u8; len].into_boxed_slice();
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead;
        // SAFETY: `buf` is a live heap allocation of exactly `len` bytes whose address does not
        // change when the Box moves into `Self`. The only handle to the registration (`mr`, never
        // cloned out of this struct) is dropped before `buf` (field order), so the memory stays
        // valid for as long as the memory region exists.
        let mr = unsafe { pd.reg_mr(buf.as_mut_ptr() as usize, buf.len(), access)? };
        Ok(OwnedRegion { mr, buf })
    }

    pub(crate) fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    pub(crate) fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    pub(crate) fn addr(&self) -> usize {
        self.buf.as_ptr() as usize
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buf
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

/// User memory (a payload [`Bytes`]) registered for remote reads, for rendezvous sends of
/// payloads that do not live in a pool buffer. Holds the `Bytes`, so the memory cannot be freed
/// or reused while registered; the registration is dropped first (field order).
pub(crate) struct UserRegion {
    mr: Arc<MemoryRegion>,
    bytes: Bytes,
}

impl UserRegion {
    pub(crate) fn new(
        pd: &Arc<ProtectionDomain>,
        bytes: Bytes,
    ) -> Result<Self, RegisterMemoryRegionError> {
        // Remote read only: the peer reads it, nothing writes it (so read-only pages work too).
        let access = AccessFlags::RemoteRead | AccessFlags::LocalWrite;
        // SAFETY: `bytes` keeps its memory alive and unchanged (Bytes are immutable) for as long
        // as `Self` exists, and `mr` is dropped before `bytes`. Local-write access only lets the
        // NIC write into it through work requests that name this key, and this crate never
        // posts a receive or a READ into a user region.
        let mr = unsafe { pd.reg_mr(bytes.as_ptr() as usize, bytes.len(), access)? };
        Ok(UserRegion { mr, bytes })
    }

    pub(crate) fn start(&self) -> usize {
        self.bytes.as_ptr() as usize
    }

    pub(crate) fn len(&self) -> usize {
        self.bytes.len()
    }

    pub(crate) fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    pub(crate) fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
}

/// A payload that lies inside registered memory, with the owners that keep both the bytes and
/// the registration alive. Built by the pool's registry lookup or by the registration cache.
pub(crate) struct HeldBytes {
    pub(crate) bytes: Bytes,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    /// For user memory: the registration (pool buffers own theirs, kept alive by `bytes`).
    pub(crate) _reg: Option<Arc<UserRegion>>,
}

/// `RLIMIT_MEMLOCK` (soft limit) in bytes, `None` for unlimited.
pub(crate) fn memlock_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into the valid, exclusively borrowed `lim`.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    if rc != 0 || lim.rlim_cur == libc::RLIM_INFINITY {
        None
    } else {
        Some(lim.rlim_cur)
    }
}

/// Sets the soft `RLIMIT_MEMLOCK` (tests use it to provoke a registration failure).
pub fn set_memlock_soft_limit(bytes: Option<u64>) -> io::Result<()> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: as above.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    lim.rlim_cur = bytes.unwrap_or(libc::RLIM_INFINITY);
    // SAFETY: setrlimit reads one valid `rlimit`.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Drops `CAP_IPC_LOCK` from the calling thread's effective and permitted capabilities, so that
/// `RLIMIT_MEMLOCK` applies even to root (tests use it; threads created afterwards inherit it).
pub fn drop_ipc_lock_capability() -> io::Result<()> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    const CAP_IPC_LOCK: u32 = 14;
    let mut h = Header {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut d = [Data::default(); 2];
    // SAFETY: capget reads the header and writes two `Data` entries (version 3), both valid
    // and exclusively borrowed.
    if unsafe { libc::syscall(libc::SYS_capget, &mut h as *mut Header, d.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    d[0].effective &= !(1 << CAP_IPC_LOCK);
    d[0].permitted &= !(1 << CAP_IPC_LOCK);
    // SAFETY: capset reads the header and two `Data` entries, all valid.
    if unsafe { libc::syscall(libc::SYS_capset, &mut h as *mut Header, d.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Bit set in the `wr_id` of receive work requests.
const RECV_BIT: u64 = 1 << 63;
/// Bytes of one control slot (transport header + message header).
pub(crate) const CTRL_SLOT: usize = 128;

/// What a send-queue work request reads from or writes to. Kept until its completion.
pub(crate) enum SqLocal {
    /// The control slot of this work request only (`len` bytes of it).
    Ctrl { len: usize },
    /// The control slot, then a registered payload (two SGEs, no copy).
    CtrlPayload { len: usize, payload: HeldBytes },
    /// The control slot, then any payload bytes, copied by the provider at post (inline).
    Inline { len: usize, payload: Bytes },
    /// A pool buffer holding the whole message (copied in).
    Buf { buf: PoolBuf, len: usize },
}

/// An RDMA READ of `len` bytes at `remote_addr`/`rkey` into `target[offset..]`.
pub(crate) struct ReadSpec {
    pub(crate) target: Arc<PoolBuf>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    pub(crate) tag: u64,
}

enum SqEntry {
    /// Kept only so the memory outlives the work request.
    Send { _local: SqLocal },
    Read {
        target: Arc<PoolBuf>,
        tag: u64,
        len: usize,
    },
}

struct Staged {
    seq: u64,
    opcode: u32,
    flags: u32,
    sge_start: usize,
    num_sge: usize,
    remote: Option<(u64, u32)>,
}

/// A completion, with the memory owner it released.
pub(crate) enum Completion {
    /// A receive landed in `buf` (`len` bytes), or failed.
    Recv {
        buf: PoolBuf,
        len: usize,
        status: Result<(), WcError>,
    },
    /// An RDMA READ into `target` finished (or failed).
    Read {
        target: Arc<PoolBuf>,
        tag: u64,
        len: usize,
        status: Result<(), WcError>,
    },
    /// Sends up to a signaled one finished (`status` of that one).
    Sent { status: Result<(), WcError> },
}

/// A failed work completion.
#[derive(Debug, Clone)]
pub(crate) struct WcError {
    pub(crate) status: u32,
    pub(crate) vendor_err: u32,
}

impl WcError {
    pub(crate) fn is_flush(&self) -> bool {
        self.status == sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR
    }
}

impl std::fmt::Display for WcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self.status {
            1 => "local length error",
            2 => "local QP operation error",
            4 => "local protection error",
            5 => "work request flushed (QP in error state)",
            9 => "remote invalid request",
            10 => "remote access error",
            11 => "remote operation error",
            12 => "transport retry counter exceeded (peer unreachable)",
            13 => "RNR retry counter exceeded",
            _ => "work completion error",
        };
        write!(
            f,
            "{name} (ibv_wc_status {}, vendor error {:#x})",
            self.status, self.vendor_err
        )
    }
}

/// The file descriptor of a channel (completion or rdma_cm event channel), holding the channel
/// so that the fd stays open for as long as anything watches it.
pub(crate) struct ChannelFd<T: AsRawFd>(pub(crate) Arc<T>);

impl<T: AsRawFd> AsRawFd for ChannelFd<T> {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Watches a channel's (non-blocking) fd with tokio.
pub(crate) fn watch<T: AsRawFd>(
    fd: ChannelFd<T>,
) -> io::Result<tokio::io::unix::AsyncFd<ChannelFd<T>>> {
    // SAFETY: `ChannelFd` holds the channel, so the fd stays open until the `AsyncFd` (which
    // deregisters it on drop) is gone; nothing else closes it.
    unsafe { tokio::io::unix::AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)
}

/// A connected RC queue pair with its completion queue and channel, and the owners of every
/// buffer the device may still be using.
pub(crate) struct Endpoint {
    // Field order is drop order: the QP goes first, so no work request can touch memory below.
    qp: BasicQueuePair,
    cq: Arc<BasicCompletionQueue>,
    channel: Arc<CompletionChannel>,
    unacked_events: u32,
    ctrl: OwnedRegion,
    sq: VecDeque<(u64, SqEntry)>,
    next_seq: u64,
    sq_depth: usize,
    recv: Vec<Option<PoolBuf>>,
    recv_free: Vec<usize>,
    staged: Vec<Staged>,
    sges: Vec<sys::ibv_sge>,
    staged_recv: Vec<(u64, sys::ibv_sge)>,
    wcs: Vec<sys::ibv_wc>,
    inline_max: usize,
    unsignaled: u32,
}

impl Endpoint {
    pub(crate) fn new(
        qp: BasicQueuePair,
        cq: Arc<BasicCompletionQueue>,
        channel: Arc<CompletionChannel>,
        ctrl: OwnedRegion,
        sq_depth: usize,
        recv_depth: usize,
        inline_max: usize,
    ) -> Endpoint {
        Endpoint {
            qp,
            cq,
            channel,
            unacked_events: 0,
            ctrl,
            sq: VecDeque::with_capacity(sq_depth),
            next_seq: 0,
            sq_depth,
            recv: (0..recv_depth).map(|_| None).collect(),
            recv_free: (0..recv_depth).rev().collect(),
            staged: Vec::new(),
            sges: Vec::new(),
            staged_recv: Vec::new(),
            wcs: Vec::with_capacity(32),
            inline_max,
            unsignaled: 0,
        }
    }

    pub(crate) fn channel_fd(&self) -> ChannelFd<CompletionChannel> {
        ChannelFd(self.channel.clone())
    }

    pub(crate) fn inline_max(&self) -> usize {
        self.inline_max
    }

    pub(crate) fn sq_room(&self) -> usize {
        self.sq_depth - self.sq.len()
    }

    /// The control slot the next send-queue entry uses, to write its headers into.
    pub(crate) fn next_ctrl_slot(&mut self) -> &mut [u8] {
        let i = (self.next_seq as usize) % self.sq_depth;
        &mut self.ctrl.bytes_mut()[i * CTRL_SLOT..(i + 1) * CTRL_SLOT]
    }

    fn ctrl_sge(&self, seq: u64, len: usize) -> sys::ibv_sge {
        let i = (seq as usize) % self.sq_depth;
        sys::ibv_sge {
            addr: (self.ctrl.addr() + i * CTRL_SLOT) as u64,
            length: len as u32,
            lkey: self.ctrl.lkey(),
        }
    }

    /// Stages a SEND (posted by [`Endpoint::ring`]). Needs `sq_room() > 0`.
    /// `signal`: request a completion (otherwise one comes with a later signaled request).
    pub(crate) fn stage_send(&mut self, local: SqLocal, signal: bool) {
        assert!(self.sq_room() > 0, "send queue overrun");
        let seq = self.next_seq;
        self.next_seq += 1;
        let sge_start = self.sges.len();
        let mut flags = 0u32;
        match &local {
            SqLocal::Ctrl { len } => {
                let s = self.ctrl_sge(seq, *len);
                self.sges.push(s);
                if *len <= self.inline_max {
                    flags |= sys::ibv_send_flags::IBV_SEND_INLINE.0;
                }
            }
            SqLocal::CtrlPayload { len, payload } => {
                let s = self.ctrl_sge(seq, *len);
                self.sges.push(s);
                if !payload.bytes.is_empty() {
                    self.sges.push(sys::ibv_sge {
                        addr: payload.bytes.as_ptr() as u64,
                        length: payload.bytes.len() as u32,
                        lkey: payload.lkey,
                    });
                }
            }
            SqLocal::Inline { len, payload } => {
                let s = self.ctrl_sge(seq, *len);
                self.sges.push(s);
                if !payload.is_empty() {
                    self.sges.push(sys::ibv_sge {
                        addr: payload.as_ptr() as u64,
                        length: payload.len() as u32,
                        lkey: 0,
                    });
                }
                flags |= sys::ibv_send_flags::IBV_SEND_INLINE.0;
            }
            SqLocal::Buf { buf, len } => {
                self.sges.push(sys::ibv_sge {
                    addr: buf.addr() as u64,
                    length: *len as u32,
                    lkey: buf.lkey(),
                });
            }
        }
        // Signal at least every quarter of the queue so entries are released in time.
        self.unsignaled += 1;
        let signal = signal || self.unsignaled as usize >= (self.sq_depth / 4).max(1);
        if signal {
            flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
            self.unsignaled = 0;
        }
        self.staged.push(Staged {
            seq,
            opcode: sys::ibv_wr_opcode::IBV_WR_SEND,
            flags,
            sge_start,
            num_sge: self.sges.len() - sge_start,
            remote: None,
        });
        self.sq.push_back((seq, SqEntry::Send { _local: local }));
    }

    /// Stages an RDMA READ (always signaled). Needs `sq_room() > 0`.
    pub(crate) fn stage_read(&mut self, r: ReadSpec) {
        assert!(self.sq_room() > 0, "send queue overrun");
        assert!(r.offset + r.len <= r.target.len(), "READ past its target");
        let seq = self.next_seq;
        self.next_seq += 1;
        let sge_start = self.sges.len();
        self.sges.push(sys::ibv_sge {
            addr: (r.target.addr() + r.offset) as u64,
            length: r.len as u32,
            lkey: r.target.lkey(),
        });
        self.unsignaled = 0;
        self.staged.push(Staged {
            seq,
            opcode: sys::ibv_wr_opcode::IBV_WR_RDMA_READ,
            flags: sys::ibv_send_flags::IBV_SEND_SIGNALED.0,
            sge_start,
            num_sge: 1,
            remote: Some((r.remote_addr, r.rkey)),
        });
        self.sq.push_back((
            seq,
            SqEntry::Read {
                target: r.target,
                tag: r.tag,
                len: r.len,
            },
        ));
    }

    /// Stages a receive into `buf` (posted by [`Endpoint::ring`]). Needs a free receive slot.
    pub(crate) fn stage_recv(&mut self, buf: PoolBuf) {
        let slot = self.recv_free.pop().expect("receive table overrun");
        let sge = sys::ibv_sge {
            addr: buf.addr() as u64,
            length: buf.len() as u32,
            lkey: buf.lkey(),
        };
        self.recv[slot] = Some(buf);
        self.staged_recv.push((RECV_BIT | slot as u64, sge));
    }

    /// Posts everything staged: one `ibv_post_recv` and one `ibv_post_send` at most.
    /// Returns the number of doorbells rung.
    pub(crate) fn ring(&mut self) -> io::Result<u64> {
        let mut doorbells = 0;
        if !self.staged_recv.is_empty() {
            let mut sges: Vec<sys::ibv_sge> = self.staged_recv.iter().map(|(_, s)| *s).collect();
            let mut wrs: Vec<sys::ibv_recv_wr> = self
                .staged_recv
                .iter()
                .map(|(id, _)| sys::ibv_recv_wr {
                    wr_id: *id,
                    next: std::ptr::null_mut(),
                    sg_list: std::ptr::null_mut(),
                    num_sge: 1,
                })
                .collect();
            let n = wrs.len();
            for i in 0..n {
                wrs[i].sg_list = &mut sges[i];
                if i + 1 < n {
                    wrs[i].next = &mut wrs[i + 1] as *mut _;
                }
            }
            self.staged_recv.clear();
            let mut bad: *mut sys::ibv_recv_wr = std::ptr::null_mut();
            // SAFETY: `wrs` is a well-formed list whose SGEs (in `sges`, alive across the call)
            // each cover one whole pool buffer that `self.recv` now owns and keeps until the
            // receive's completion (or until the QP, dropped first, is destroyed). The QP handle
            // is valid while `self.qp` lives.
            let rc =
                unsafe { sys::ibv_post_recv(self.qp.qp().as_ptr(), wrs.as_mut_ptr(), &mut bad) };
            doorbells += 1;
            if rc != 0 {
                return Err(io::Error::from_raw_os_error(rc));
            }
        }
        if !self.staged.is_empty() {
            // The last request of every batch is signaled, so nothing waits for a later batch
            // to be released (the queue is also signaled every quarter, see `stage_send`).
            let last = self.staged.len() - 1;
            if self.staged[last].flags & sys::ibv_send_flags::IBV_SEND_SIGNALED.0 == 0 {
                self.staged[last].flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
                self.unsignaled = 0;
            }
            let n = self.staged.len();
            // SAFETY: an all-zero `ibv_send_wr` is a valid value of this plain C struct
            // (null pointers, zero counts, zeroed unions).
            let mut wrs: Vec<sys::ibv_send_wr> =
                (0..n).map(|_| unsafe { std::mem::zeroed() }).collect();
            for (i, s) in self.staged.iter().enumerate() {
                let wr = &mut wrs[i];
                wr.wr_id = s.seq;
                wr.opcode = s.opcode;
                wr.send_flags = s.flags;
                wr.num_sge = s.num_sge as i32;
                wr.sg_list = &mut self.sges[s.sge_start];
                if let Some((addr, rkey)) = s.remote {
                    wr.wr.rdma = sys::rdma_t {
                        remote_addr: addr,
                        rkey,
                    };
                }
            }
            for i in 0..n.saturating_sub(1) {
                let next: *mut sys::ibv_send_wr = &mut wrs[i + 1];
                wrs[i].next = next;
            }
            self.staged.clear();
            let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
            // SAFETY: `wrs` is a well-formed list; every SGE points either into the control
            // region (owned by `self`), into a pool buffer or payload held in `self.sq` until the
            // completion, or (inline) into a payload held in `self.sq` and copied by the
            // provider during this call. Lengths never exceed the memory they describe (checked
            // when staged). READ targets are pool buffers held in `self.sq`. The QP is valid.
            let rc =
                unsafe { sys::ibv_post_send(self.qp.qp().as_ptr(), wrs.as_mut_ptr(), &mut bad) };
            self.sges.clear();
            doorbells += 1;
            if rc != 0 {
                return Err(io::Error::from_raw_os_error(rc));
            }
        }
        Ok(doorbells)
    }

    /// Polls up to 32 completions into `out`; returns how many work completions were read.
    pub(crate) fn poll(&mut self, out: &mut Vec<Completion>) -> io::Result<usize> {
        self.wcs.clear();
        let cap = self.wcs.capacity();
        // SAFETY: `wcs` has room for `cap` entries; ibv_poll_cq writes at most that many and
        // returns how many it wrote (or a negative error). The CQ is valid while `self.cq` lives.
        let n =
            unsafe { sys::ibv_poll_cq(self.cq.cq().as_ptr(), cap as i32, self.wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(io::Error::from_raw_os_error(-n));
        }
        // SAFETY: the first `n` entries were initialised by ibv_poll_cq.
        unsafe { self.wcs.set_len(n as usize) };
        for i in 0..n as usize {
            let wc = self.wcs[i];
            let status = if wc.status == sys::ibv_wc_status::IBV_WC_SUCCESS {
                Ok(())
            } else {
                Err(WcError {
                    status: wc.status,
                    vendor_err: wc.vendor_err,
                })
            };
            if wc.wr_id & RECV_BIT != 0 {
                let slot = (wc.wr_id & !RECV_BIT) as usize;
                let Some(buf) = self.recv.get_mut(slot).and_then(Option::take) else {
                    continue; // not ours (cannot happen): ignore rather than crash
                };
                self.recv_free.push(slot);
                out.push(Completion::Recv {
                    buf,
                    len: wc.byte_len as usize,
                    status,
                });
            } else {
                // Send-queue completions come in order: release everything up to this one.
                let mut sent = false;
                while let Some((seq, _)) = self.sq.front() {
                    if *seq > wc.wr_id {
                        break;
                    }
                    let (seq, entry) = self.sq.pop_front().expect("front exists");
                    match entry {
                        SqEntry::Read { target, tag, len } => out.push(Completion::Read {
                            target,
                            tag,
                            len,
                            status: if seq == wc.wr_id {
                                status.clone()
                            } else {
                                Err(WcError {
                                    status: sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR,
                                    vendor_err: 0,
                                })
                            },
                        }),
                        SqEntry::Send { .. } => sent = true,
                    }
                }
                if sent {
                    out.push(Completion::Sent {
                        status: status.clone(),
                    });
                }
            }
        }
        Ok(n as usize)
    }

    /// Arms the CQ: the channel fd becomes readable at the next completion.
    pub(crate) fn arm(&mut self) -> io::Result<()> {
        // SAFETY: the CQ is valid while `self.cq` lives.
        let rc = unsafe { sys::ibv_req_notify_cq(self.cq.cq().as_ptr(), 0) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }

    /// Reads every pending completion event from the (non-blocking) channel and acknowledges it.
    pub(crate) fn take_events(&mut self) -> io::Result<u32> {
        let mut n = 0;
        loop {
            let mut cq: *mut sys::ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: the channel is valid while `self.channel` lives and is non-blocking; the
            // out-pointers are valid locals.
            let rc = unsafe {
                sys::ibv_get_cq_event(self.channel.comp_channel().as_ptr(), &mut cq, &mut ctx)
            };
            if rc != 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::WouldBlock {
                    break;
                }
                return Err(e);
            }
            n += 1;
            self.unacked_events += 1;
        }
        if self.unacked_events > 0 {
            // SAFETY: acknowledges events read above from this CQ's channel.
            unsafe { sys::ibv_ack_cq_events(self.cq.cq().as_ptr(), self.unacked_events) };
            self.unacked_events = 0;
        }
        Ok(n)
    }

    /// Moves the QP to the error state: every outstanding work request completes (flushed).
    pub(crate) fn set_error(&mut self) -> io::Result<()> {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        self.qp
            .modify(&attr)
            .map_err(|e| io::Error::other(e.to_string()))
    }

    /// Applies a state transition during connection setup.
    pub(crate) fn modify(
        &mut self,
        attr: &QueuePairAttribute,
    ) -> Result<(), sideway::ibverbs::queue_pair::ModifyQueuePairError> {
        self.qp.modify(attr)
    }

    pub(crate) fn qp_number(&self) -> u32 {
        self.qp.qp_number()
    }

    /// Entries still in the send queue (posted, not completed).
    pub(crate) fn outstanding(&self) -> usize {
        self.sq.len()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // Every event read from the channel must be acknowledged before the CQ is destroyed.
        if self.unacked_events > 0 {
            // SAFETY: the CQ is still alive (fields drop after this body).
            unsafe { sys::ibv_ack_cq_events(self.cq.cq().as_ptr(), self.unacked_events) };
        }
    }
}
