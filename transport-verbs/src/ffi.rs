//! The crate's only `unsafe` code: the calls into the verbs binding that the compiler cannot check.
//!
//! Everything here is small and commented; the rest of the crate is safe Rust. This module
//! depends on nothing else in the crate but the plain error enums: buffers come in through the
//! [`LocalMemory`] trait.
//!
//! The rules that make the data path sound are encoded in [`Endpoint`]:
//! - every work request is posted together with the owner of the memory it reads or writes (a
//!   buffer, a payload [`Bytes`] kept alive together with its registration), and the endpoint
//!   keeps that owner in its send FIFO or receive table until the work request's completion;
//! - a payload exposed to the peer (a memory window bound to it) is kept together with the
//!   window ([`Exposure`]): the window is invalidated (or deallocated) before the payload is
//!   released, so the peer can never read memory that has been reused;
//! - the queue pair is the first field of the endpoint, so on drop it is destroyed (no more DMA)
//!   before any memory it could touch is released, and windows go before their memory.
//!
//! What the peer can reach: registered memory carries no remote access (the memory regions are
//! registered for local access and window binding only, their rkeys grant nothing); the queue
//! pair accepts remote READs only; the one way in is a type-2 memory window, bound to this
//! connection's queue pair for one rendezvous payload and invalidated when the peer's FIN
//! arrives.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use bytes::Bytes;
use rdma_mummy_sys as sys;
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue};
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::memory_region::{MemoryRegion, RegisterMemoryRegionError};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{QueuePair, QueuePairAttribute, QueuePairState};
use sideway::ibverbs::AccessFlags;

use crate::error::WorkRequestKind;

pub(crate) mod cm_devices;
pub(crate) mod probe;
mod srq;
pub(crate) use srq::{FreshBuf, RawQp, RecvQueue, Srq};

/// What registered memory may be used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Access {
    /// Read by the device for sends only (the control slots).
    SendOnly,
    /// Also written by the device: receive buffers (never exposed to the peer).
    LocalWrite,
    /// Written by the device, and a memory window may expose it to the peer for reading:
    /// send buffers and rendezvous targets (a received payload may be sent on).
    Exposable,
    /// Written by the device, read for sends, exposed to the peer by a registration of its own
    /// (registration exposure, on devices without type-2 windows): no window binding.
    Sendable,
}

impl Access {
    fn flags(self) -> AccessFlags {
        match self {
            Access::SendOnly => AccessFlags::none(),
            Access::LocalWrite => AccessFlags::LocalWrite,
            Access::Exposable => AccessFlags::LocalWrite | AccessFlags::MemoryWindowBind,
            Access::Sendable => AccessFlags::LocalWrite,
        }
    }
}

/// The handle of a memory registration, as a memory-window bind needs it.
#[derive(Clone, Copy)]
pub(crate) struct MrHandle {
    mr: NonNull<sys::ibv_mr>,
    lkey: u32,
}

// SAFETY: the handle is an identifier the device and libibverbs accept from any thread; it is
// dereferenced only by libibverbs, under the lifetime rules of `HeldBytes`.
unsafe impl Send for MrHandle {}
// SAFETY: as above; nothing reads through it in this crate.
unsafe impl Sync for MrHandle {}

impl MrHandle {
    fn of(mr: &MemoryRegion) -> MrHandle {
        MrHandle {
            // SAFETY: only the pointer value is taken; it is used while the registration lives
            // (see `HeldBytes`).
            mr: unsafe { mr.mr() },
            lkey: mr.lkey(),
        }
    }
}

/// A heap buffer registered with a protection domain. The registration is dropped before the
/// memory (field order), so the device never holds a key to freed memory.
pub(crate) struct OwnedRegion {
    // Declared first: dropped first (ibv_dereg_mr), then `buf` is freed.
    mr: Arc<MemoryRegion>,
    buf: Box<[u8]>,
    access: Access,
}

impl OwnedRegion {
    /// Allocates `len` zeroed bytes and registers them for `access` (never remote access).
    pub(crate) fn new(
        pd: &Arc<ProtectionDomain>,
        len: usize,
        access: Access,
    ) -> Result<Self, RegisterMemoryRegionError> {
        let mut buf = vec![0u8; len].into_boxed_slice();
        // SAFETY: `buf` is a live heap allocation of exactly `len` bytes whose address does not
        // change when the Box moves into `Self`. The only handle to the registration (`mr`, never
        // cloned out of this struct) is dropped before `buf` (field order), so the memory stays
        // valid for as long as the memory region exists.
        let mr = unsafe { pd.reg_mr(buf.as_mut_ptr() as usize, buf.len(), access.flags())? };
        Ok(OwnedRegion { mr, buf, access })
    }

    pub(crate) fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    pub(crate) fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    pub(crate) fn access(&self) -> Access {
        self.access
    }

    /// The registration's handle (for memory-window binds).
    pub(crate) fn handle(&self) -> MrHandle {
        MrHandle::of(&self.mr)
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

/// User memory (a payload [`Bytes`]) registered so that a memory window can expose it, for
/// rendezvous sends of payloads that do not live in a pool buffer. Holds the `Bytes`, so the
/// memory cannot be freed or reused while registered; the registration is dropped first.
pub(crate) struct UserRegion {
    mr: Arc<MemoryRegion>,
    bytes: Bytes,
}

impl UserRegion {
    pub(crate) fn new(
        pd: &Arc<ProtectionDomain>,
        bytes: Bytes,
        windows: bool,
    ) -> Result<Self, RegisterMemoryRegionError> {
        // Window binding only (or nothing, where payloads are exposed by registrations of
        // their own): the device reads it for sends and through a bound window; nothing
        // writes it (so read-only pages work too) and its own rkey grants nothing.
        let access = if windows {
            AccessFlags::MemoryWindowBind
        } else {
            AccessFlags::none()
        };
        // SAFETY: `bytes` keeps its memory alive and unchanged (Bytes are immutable) for as long
        // as `Self` exists, and `mr` is dropped before `bytes`. Without local-write access the
        // device never writes it.
        let mr = unsafe { pd.reg_mr(bytes.as_ptr() as usize, bytes.len(), access)? };
        Ok(UserRegion { mr, bytes })
    }

    pub(crate) fn start(&self) -> usize {
        self.bytes.as_ptr() as usize
    }

    pub(crate) fn len(&self) -> usize {
        self.bytes.len()
    }

    pub(crate) fn handle(&self) -> MrHandle {
        MrHandle::of(&self.mr)
    }
}

/// A payload that lies inside registered memory, with the owners that keep both the bytes and
/// the registration alive.
pub(crate) struct HeldBytes {
    bytes: Bytes,
    mr: MrHandle,
    /// Whether the registration allows binding a memory window (rendezvous).
    exposable: bool,
    /// For user memory: the registration (pool buffers own theirs, kept alive by `bytes`).
    _reg: Option<Arc<UserRegion>>,
}

impl HeldBytes {
    /// A payload in a pool buffer.
    ///
    /// # Safety
    /// `bytes` must lie inside the memory registered as `mr`, and that registration must live
    /// for as long as `bytes` does (true when `bytes` is a view of the registered buffer that
    /// owns the registration).
    pub(crate) unsafe fn in_buffer(bytes: Bytes, mr: MrHandle, access: Access) -> HeldBytes {
        HeldBytes {
            bytes,
            mr,
            exposable: matches!(access, Access::Exposable | Access::Sendable),
            _reg: None,
        }
    }

    /// A payload inside a user registration, which is kept alive with it.
    pub(crate) fn in_user_region(bytes: Bytes, reg: Arc<UserRegion>) -> Option<HeldBytes> {
        let start = bytes.as_ptr() as usize;
        let inside = reg.start() <= start
            && start
                .checked_add(bytes.len())
                .is_some_and(|end| end <= reg.start() + reg.len());
        inside.then(|| HeldBytes {
            mr: reg.handle(),
            bytes,
            exposable: true,
            _reg: Some(reg),
        })
    }

    /// Whether it may be exposed to the peer (a send buffer or user memory, not a receive
    /// buffer); on the window path its registration also allows binding.
    pub(crate) fn exposable(&self) -> bool {
        self.exposable
    }
}

/// Memory registered for local access that work requests may read and write.
///
/// # Safety
/// `addr()..addr() + len()` must be memory registered under `lkey()` with local write access,
/// valid and at the same address for as long as the value lives.
pub(crate) unsafe trait LocalMemory: Send + Sync + 'static {
    fn addr(&self) -> usize;
    fn len(&self) -> usize;
    fn lkey(&self) -> u32;
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
#[cfg(feature = "test-hooks")]
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

/// The capability sets of the calling thread (`capget`, version 3).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
const CAP_IPC_LOCK: u32 = 14;

fn capget() -> io::Result<(CapHeader, [CapData; 2])> {
    let mut h = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut d = [CapData::default(); 2];
    // SAFETY: capget reads the header and writes two `CapData` entries (version 3), both
    // valid and exclusively borrowed.
    if unsafe { libc::syscall(libc::SYS_capget, &mut h as *mut CapHeader, d.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((h, d))
}

/// The locked memory this thread may register: the soft `RLIMIT_MEMLOCK` in bytes, `None`
/// when unlimited or when the thread has `CAP_IPC_LOCK` (which lifts the limit). The shared
/// receive queue is fitted to half of it; an application sizing how much it keeps in flight
/// (registered payloads, the peer's READ targets) can ask the same.
///
/// ```
/// if let Some(bytes) = transport_verbs::memlock_budget() {
///     println!("at most {bytes} bytes of registered memory");
/// }
/// ```
pub fn memlock_budget() -> Option<u64> {
    let limit = memlock_limit()?;
    match capget() {
        Ok((_, d)) if d[0].effective & (1 << CAP_IPC_LOCK) != 0 => None,
        _ => Some(limit),
    }
}

/// Drops `CAP_IPC_LOCK` from the calling thread's effective and permitted capabilities, so that
/// `RLIMIT_MEMLOCK` applies even to root (tests use it; threads created afterwards inherit it).
#[cfg(feature = "test-hooks")]
pub fn drop_ipc_lock_capability() -> io::Result<()> {
    let (mut h, mut d) = capget()?;
    d[0].effective &= !(1 << CAP_IPC_LOCK);
    d[0].permitted &= !(1 << CAP_IPC_LOCK);
    // SAFETY: capset reads the header and two `CapData` entries, all valid.
    if unsafe { libc::syscall(libc::SYS_capset, &mut h as *mut CapHeader, d.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Bit set in the `wr_id` of receive work requests.
const RECV_BIT: u64 = 1 << 63;
/// The receive slot in a receive `wr_id` (bits 32..62 carry the shared receive queue's
/// generation of the slot, [`srq::Srq::peek_posted`]).
const SLOT_MASK: u64 = 0xffff_ffff;

/// The receive slot a receive `wr_id` names.
fn recv_slot(wr_id: u64) -> usize {
    (wr_id & SLOT_MASK) as usize
}
/// Bytes of one control slot (transport header + message header).
pub(crate) const CTRL_SLOT: usize = 128;

/// What a send-queue SEND reads. Kept until its completion.
pub(crate) enum SqLocal<B> {
    /// The control slot of this work request only (`len` bytes of it; sent inline when it
    /// fits, a small message's payload copied in after its headers).
    Ctrl { len: usize },
    /// The control slot, then a registered payload (two SGEs, no copy).
    CtrlPayload { len: usize, payload: HeldBytes },
    /// A buffer holding the whole message (copied in).
    Buf { buf: B, len: usize },
}

/// An RDMA READ of `len` bytes at `remote_addr`/`rkey` into `target[offset..]`.
pub(crate) struct ReadSpec<B> {
    pub(crate) target: Arc<B>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    pub(crate) tag: u64,
}

/// A type-2 memory window: the only way the peer can reach this side's memory.
struct Window {
    mw: NonNull<sys::ibv_mw>,
    /// The rkey of the current (or last) binding.
    rkey: u32,
    /// Keeps the protection domain alive while the window exists.
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: a memory window handle may be used from any thread; `Window` is the only owner.
unsafe impl Send for Window {}
// SAFETY: `&Window` exposes nothing that dereferences the handle.
unsafe impl Sync for Window {}

impl Window {
    fn alloc(pd: &Arc<ProtectionDomain>) -> io::Result<Window> {
        // SAFETY: the PD handle is valid while `pd` lives (the window keeps it alive). A null
        // result means failure, with errno set.
        let mw = unsafe { sys::ibv_alloc_mw(pd.pd().as_ptr(), sys::ibv_mw_type::IBV_MW_TYPE_2) };
        let mw = NonNull::new(mw).ok_or_else(io::Error::last_os_error)?;
        // SAFETY: `mw` was just returned by ibv_alloc_mw and is valid.
        let rkey = unsafe { mw.as_ref().rkey };
        Ok(Window {
            mw,
            rkey,
            _pd: pd.clone(),
        })
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // SAFETY: the window was allocated by ibv_alloc_mw and is deallocated once, here.
        // Deallocating invalidates any binding: no peer can use its rkey afterwards.
        unsafe { sys::ibv_dealloc_mw(self.mw.as_ptr()) };
    }
}

/// How an endpoint exposes rendezvous payloads to the peer (see `caps::ExposurePath`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExposeBy {
    /// A type-2 memory window bound to this endpoint's queue pair.
    Window,
    /// A registration of exactly the payload, remote read only, in this endpoint's own
    /// protection domain.
    Registration,
}

/// A payload exposed to the peer. Field order is drop order: the window goes (deallocated, so
/// invalidated) or the registration is deregistered before the payload is released.
enum Exposure {
    Window {
        window: Window,
        held: HeldBytes,
    },
    Registered {
        _mr: Arc<MemoryRegion>,
        _held: HeldBytes,
    },
}

enum SqEntry<B> {
    /// Kept only so the memory outlives the work request.
    Send { _local: SqLocal<B> },
    Read {
        /// The sink's registration for remote write (iWARP), deregistered with the entry,
        /// before the target is released (field order).
        _sink: Option<Arc<MemoryRegion>>,
        target: Arc<B>,
        tag: u64,
        len: usize,
    },
    /// A zero-length RDMA READ ([`Endpoint::stage_probe`]): nothing to keep alive.
    Probe,
    /// A window bind; the exposure itself lives in `Endpoint::exposed`.
    Bind,
    /// A window invalidation: the window and its payload are released when it completes.
    Invalidate { exposure: Exposure },
}

impl<B> SqEntry<B> {
    fn kind(&self) -> WorkRequestKind {
        match self {
            SqEntry::Send { .. } => WorkRequestKind::Send,
            SqEntry::Read { .. } | SqEntry::Probe => WorkRequestKind::RdmaRead,
            SqEntry::Bind => WorkRequestKind::BindWindow,
            SqEntry::Invalidate { .. } => WorkRequestKind::InvalidateWindow,
        }
    }
}

enum StagedOp {
    Sge {
        opcode: u32,
        sge_start: usize,
        num_sge: usize,
        remote: Option<(u64, u32)>,
    },
    Bind {
        mw: MwPtr,
        rkey: u32,
        mr: MrHandle,
        addr: u64,
        len: u64,
    },
    Invalidate {
        rkey: u32,
    },
}

/// A window's handle in a staged bind (the window itself lives in `Endpoint::exposed`).
#[derive(Clone, Copy)]
struct MwPtr(NonNull<sys::ibv_mw>);

// SAFETY: an identifier passed to libibverbs only; the window outlives the staged request.
unsafe impl Send for MwPtr {}
// SAFETY: as above.
unsafe impl Sync for MwPtr {}

struct Staged {
    seq: u64,
    flags: u32,
    op: StagedOp,
}

/// A failed work completion: its raw `ibv_wc_status` and the device's own code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WcFailure {
    pub(crate) status: u32,
    pub(crate) vendor_err: u32,
}

impl WcFailure {
    /// The typed error of this failed completion of a `kind` work request.
    pub(crate) fn into_error(self, kind: WorkRequestKind) -> crate::error::VerbsError {
        crate::error::VerbsError::WorkCompletion {
            op: kind,
            status: crate::error::WcStatus::from_raw(self.status),
            vendor_err: self.vendor_err,
        }
    }

    pub(crate) fn is_flush(&self) -> bool {
        self.status == sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR
    }

    /// See [`crate::error::WcStatus::is_peer_side`].
    pub(crate) fn is_peer_side(&self) -> bool {
        crate::error::WcStatus::from_raw(self.status).is_peer_side()
    }
}

/// A completion, with the memory owner it released.
pub(crate) enum Completion<B> {
    /// A receive landed in `buf` (`len` bytes), or failed.
    Recv {
        buf: B,
        len: usize,
        status: Result<(), WcFailure>,
    },
    /// An RDMA READ into the target of `tag` finished (or failed).
    Read {
        tag: u64,
        len: usize,
        status: Result<(), WcFailure>,
    },
    /// Send-queue work up to a signaled request finished (`status` and kind of that one).
    Sent {
        status: Result<(), WcFailure>,
        kind: WorkRequestKind,
    },
}

/// Waits up to `timeout` for `fd` to become readable (poll(2)): `Ok(false)` on timeout.
pub(crate) fn wait_readable(
    fd: std::os::fd::RawFd,
    timeout: std::time::Duration,
) -> io::Result<bool> {
    wait_readable_any([fd], timeout).map(|[readable]| readable)
}

/// Waits until one of `fds` is readable or `timeout` passes: which are readable (none on
/// timeout).
pub(crate) fn wait_readable_any<const N: usize>(
    fds: [std::os::fd::RawFd; N],
    timeout: std::time::Duration,
) -> io::Result<[bool; N]> {
    let mut p = fds.map(|fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    });
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: `p` is an array of N valid, writable pollfds for the duration of the call; an
    // invalid fd is reported in `revents` (POLLNVAL, turned into an error).
    let rc = unsafe { libc::poll(p.as_mut_ptr(), N as libc::nfds_t, ms) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    if p.iter()
        .any(|p| p.revents & (libc::POLLNVAL | libc::POLLERR) != 0)
    {
        return Err(io::Error::new(
            io::ErrorKind::BrokenPipe,
            "poll(2): a descriptor is invalid or in error",
        ));
    }
    Ok(p.map(|p| p.revents & libc::POLLIN != 0))
}

/// One completion event read from a completion channel that several CQs share: names its CQ
/// and acknowledges the event when dropped.
///
/// `ibv_destroy_cq` waits until every event read for the CQ has been acknowledged, so the CQ
/// this event names stays alive (and its address names no other CQ) for as long as the event
/// lives: look the CQ up, then drop the event.
pub(crate) struct CqEvent {
    cq: NonNull<sys::ibv_cq>,
}

// SAFETY: the event only carries the CQ's address and acknowledges it once; libibverbs
// acknowledges under the CQ's own mutex, from any thread.
unsafe impl Send for CqEvent {}

impl CqEvent {
    /// Reads the next event from a non-blocking channel: `Ok(None)` when there is none.
    pub(crate) fn next(channel: &CompletionChannel) -> io::Result<Option<CqEvent>> {
        let mut cq: *mut sys::ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the channel is valid while `channel` is borrowed; the out-pointers are valid
        // locals. A non-blocking channel returns -1 with EAGAIN when it holds no event.
        let rc =
            unsafe { sys::ibv_get_cq_event(channel.comp_channel().as_ptr(), &mut cq, &mut ctx) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock => Ok(None),
                _ => Err(e),
            };
        }
        match NonNull::new(cq) {
            Some(cq) => Ok(Some(CqEvent { cq })),
            None => Err(io::Error::other("ibv_get_cq_event returned no CQ")),
        }
    }

    /// The CQ the event is for, as the key [`Endpoint::cq_key`] gives.
    pub(crate) fn cq_key(&self) -> usize {
        self.cq.as_ptr() as usize
    }
}

impl Drop for CqEvent {
    fn drop(&mut self) {
        // SAFETY: the event was read for this CQ and not yet acknowledged, so the CQ cannot
        // have been destroyed (its destruction waits for this acknowledgement).
        unsafe { sys::ibv_ack_cq_events(self.cq.as_ptr(), 1) };
    }
}

/// The asynchronous events of one device context (`ibv_get_async_event`): a shared receive
/// queue that ran below its limit, a queue pair or CQ that failed, a port that changed.
/// Several transports in a process share a device's context (rdma_cm opens each device once),
/// and with it this one queue of events.
pub(crate) struct AsyncEvents {
    ctx: Arc<DeviceContext>,
}

impl AsyncEvents {
    /// Makes the context's event descriptor non-blocking (for poll(2)) and reads from it.
    pub(crate) fn new(ctx: &Arc<DeviceContext>) -> io::Result<AsyncEvents> {
        let ev = AsyncEvents { ctx: ctx.clone() };
        let fd = ev.fd();
        // SAFETY: `fd` is the context's open descriptor (it lives while the context does);
        // F_GETFL/F_SETFL only read and set its status flags.
        let rc = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags < 0 {
                flags
            } else {
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK)
            }
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(ev)
    }

    /// The descriptor to poll(2) for events; open while `self` lives.
    pub(crate) fn fd(&self) -> std::os::fd::RawFd {
        // SAFETY: the context is valid while `self.ctx` lives; only the descriptor is read.
        unsafe { self.ctx.context().as_ref().async_fd }
    }

    /// Reads the next event: `Ok(None)` when there is none.
    pub(crate) fn next(&self) -> io::Result<Option<AsyncEvent>> {
        let mut raw = RawAsyncEvent {
            element: 0,
            event_type: 0,
        };
        // SAFETY: the context is valid while `self.ctx` lives; `raw` has the layout of
        // `ibv_async_event` (checked below) and is writable for the call. The descriptor is
        // non-blocking: no event is -1 with EAGAIN.
        let rc = unsafe {
            sys::ibv_get_async_event(
                self.ctx.context().as_ptr(),
                (&mut raw as *mut RawAsyncEvent).cast(),
            )
        };
        if rc != 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock => Ok(None),
                _ => Err(e),
            };
        }
        Ok(Some(AsyncEvent { raw }))
    }
}

/// `struct ibv_async_event` with its event type read as a plain number (a type this binding
/// does not know must not become an invalid enum value).
#[repr(C)]
struct RawAsyncEvent {
    /// The union of the CQ, QP, SRQ or WQ pointer and the port number.
    element: u64,
    event_type: u32,
}

const _: () = assert!(
    std::mem::size_of::<RawAsyncEvent>() == std::mem::size_of::<sys::ibv_async_event>()
        && std::mem::align_of::<RawAsyncEvent>() == std::mem::align_of::<sys::ibv_async_event>()
);

/// One asynchronous event, acknowledged when dropped. The object it names (an SRQ, a QP, a
/// CQ) cannot be destroyed before that (its destruction waits for the acknowledgement): look
/// it up, then drop the event.
pub(crate) struct AsyncEvent {
    raw: RawAsyncEvent,
}

// SAFETY: the event only carries an object's address and is acknowledged once, which
// libibverbs allows from any thread.
unsafe impl Send for AsyncEvent {}

impl AsyncEvent {
    /// The key ([`Srq::key`]) of the shared receive queue whose limit was reached, if that is
    /// what the event says.
    pub(crate) fn srq_limit_reached(&self) -> Option<usize> {
        (self.raw.event_type == sys::ibv_event_type::IBV_EVENT_SRQ_LIMIT_REACHED as u32)
            .then_some(self.raw.element as usize)
    }

    /// The event's type, a value of `enum ibv_event_type` (`ibv_event_type_str` names it).
    pub(crate) fn event_type(&self) -> u32 {
        self.raw.event_type
    }
}

impl Drop for AsyncEvent {
    fn drop(&mut self) {
        // SAFETY: the event was read by `ibv_get_async_event` and not yet acknowledged.
        unsafe { sys::ibv_ack_async_event((&mut self.raw as *mut RawAsyncEvent).cast()) };
    }
}

/// A work completion's status: success, or the failure it reports.
fn wc_status(wc: &sys::ibv_wc) -> Result<(), WcFailure> {
    if wc.status == sys::ibv_wc_status::IBV_WC_SUCCESS {
        Ok(())
    } else {
        Err(WcFailure {
            status: wc.status,
            vendor_err: wc.vendor_err,
        })
    }
}

/// Work-request lists built for one post and kept for the next: once they have grown to the
/// largest batch, posting allocates nothing (an allocation and its release cost more than the
/// rest of a small send's path in the soft-RoCE guest;
/// docs/notes/2026-12-03-verbs-where-a-round-trip-goes.md). Empty between posts.
#[derive(Default)]
struct WrLists {
    send: Vec<sys::ibv_send_wr>,
    recv: Vec<sys::ibv_recv_wr>,
    recv_sges: Vec<sys::ibv_sge>,
}

// SAFETY: the lists are emptied after every post, so the raw pointers their entries hold
// during a post (into this endpoint's SGE lists and buffers) are never kept or dereferenced
// afterwards, on any thread: only the allocations move with the endpoint.
unsafe impl Send for WrLists {}

impl WrLists {
    /// Chains `recv` into a list, each entry pointing at its SGE in `recv_sges`.
    fn link_recv(&mut self) {
        let n = self.recv.len();
        for i in 0..n {
            self.recv[i].sg_list = &mut self.recv_sges[i];
            if i + 1 < n {
                self.recv[i].next = &mut self.recv[i + 1] as *mut _;
            }
        }
    }

    fn clear(&mut self) {
        self.send.clear();
        self.recv.clear();
        self.recv_sges.clear();
    }
}

/// Work completions read by one [`Endpoint::poll`], at most.
pub(crate) const POLL_BATCH: usize = 32;

/// What [`Endpoint::poll_recv_in_place`] found.
pub(crate) enum InPlace<R> {
    /// The CQ was empty.
    Empty,
    /// A receive its caller took: the buffer is posted again.
    Taken(R),
    /// A completion for the generic path, pushed to `others` (or, never expected, one that
    /// names no buffer of ours, ignored).
    Other,
}

/// A connected RC queue pair with its completion queue and channel, the owners of every
/// buffer the device may still be using, and the memory windows that expose payloads.
pub(crate) struct Endpoint<B: LocalMemory> {
    // Field order is drop order: the QP goes first (`Drop` destroys it before anything else),
    // so no work request can touch memory below; then the windows (deallocated, so
    // invalidated) before the payloads they exposed.
    qp: Option<RawQp>,
    exposed: HashMap<u32, Exposure>,
    free_windows: Vec<Window>,
    /// Holds its completion channel (shared by the device's CQs) until it is destroyed.
    cq: Arc<BasicCompletionQueue>,
    pd: Arc<ProtectionDomain>,
    ctrl: OwnedRegion,
    sq: VecDeque<(u64, SqEntry<B>)>,
    next_seq: u64,
    sq_depth: usize,
    recv: Vec<Option<B>>,
    recv_free: Vec<usize>,
    /// The device's shared receive queue, if this QP receives through it (then `recv` is
    /// empty and receive buffers given back go to the SRQ).
    srq: Option<Arc<Srq<B>>>,
    /// Buffers given back for the SRQ, posted by the next `ring`.
    srq_staged: Vec<B>,
    /// A completion took an SRQ buffer since the last `ring`: refill the SRQ.
    srq_took: bool,
    staged: Vec<Staged>,
    /// Window binds among `staged` (their keys are recorded after the post).
    staged_binds: usize,
    sges: Vec<sys::ibv_sge>,
    staged_recv: Vec<(u64, sys::ibv_sge)>,
    /// The lists `ring` hands to the provider, kept for their capacity.
    lists: WrLists,
    wcs: Vec<sys::ibv_wc>,
    inline_max: usize,
    unsignaled: u32,
    /// How payloads are exposed to the peer.
    expose_by: ExposeBy,
    /// Each RDMA READ's sink is registered for remote write while the READ runs (iWARP).
    sink_remote_write: bool,
}

impl<B: LocalMemory> Endpoint<B> {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        qp: RawQp,
        cq: Arc<BasicCompletionQueue>,
        pd: Arc<ProtectionDomain>,
        ctrl: OwnedRegion,
        sq_depth: usize,
        recv: RecvQueue<B>,
        inline_max: usize,
        expose_by: ExposeBy,
        sink_remote_write: bool,
    ) -> Endpoint<B> {
        let (recv_depth, srq) = match recv {
            RecvQueue::Own(depth) => (depth, None),
            RecvQueue::Shared(srq) => (0, Some(srq)),
        };
        Endpoint {
            qp: Some(qp),
            exposed: HashMap::new(),
            free_windows: Vec::new(),
            cq,
            pd,
            ctrl,
            sq: VecDeque::with_capacity(sq_depth),
            next_seq: 0,
            sq_depth,
            recv: (0..recv_depth).map(|_| None).collect(),
            recv_free: (0..recv_depth).rev().collect(),
            srq,
            srq_staged: Vec::new(),
            srq_took: false,
            staged: Vec::new(),
            staged_binds: 0,
            sges: Vec::new(),
            staged_recv: Vec::new(),
            lists: WrLists::default(),
            wcs: Vec::with_capacity(POLL_BATCH),
            // An inline message is built in its control slot: never more than one slot.
            inline_max: inline_max.min(CTRL_SLOT),
            unsignaled: 0,
            expose_by,
            sink_remote_write,
        }
    }

    /// Names this endpoint's CQ among the CQs of its completion channel ([`CqEvent::cq_key`]).
    pub(crate) fn cq_key(&self) -> usize {
        // SAFETY: only the address is taken; nothing is dereferenced.
        unsafe { self.cq.cq() }.as_ptr() as usize
    }

    pub(crate) fn inline_max(&self) -> usize {
        self.inline_max
    }

    /// Whether this QP receives through the device's shared receive queue.
    pub(crate) fn receives_shared(&self) -> bool {
        self.srq.is_some()
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
            length: len.min(CTRL_SLOT) as u32,
            lkey: self.ctrl.lkey(),
        }
    }

    fn push_sq(&mut self, flags: u32, op: StagedOp, entry: SqEntry<B>) {
        assert!(self.sq_room() > 0, "send queue overrun");
        let seq = self.next_seq;
        self.next_seq += 1;
        // Signal at least every quarter of the queue so entries are released in time.
        self.unsignaled += 1;
        let mut flags = flags;
        if flags & sys::ibv_send_flags::IBV_SEND_SIGNALED.0 != 0
            || self.unsignaled as usize >= (self.sq_depth / 4).max(1)
        {
            flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
            self.unsignaled = 0;
        }
        self.staged.push(Staged { seq, flags, op });
        self.sq.push_back((seq, entry));
    }

    /// Stages a SEND (posted by [`Endpoint::ring`]). Needs `sq_room() > 0`.
    pub(crate) fn stage_send(&mut self, local: SqLocal<B>) {
        let seq = self.next_seq;
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
                        lkey: payload.mr.lkey,
                    });
                }
            }
            SqLocal::Buf { buf, len } => {
                self.sges.push(sys::ibv_sge {
                    addr: buf.addr() as u64,
                    length: (*len).min(buf.len()) as u32,
                    lkey: buf.lkey(),
                });
            }
        }
        let op = StagedOp::Sge {
            opcode: sys::ibv_wr_opcode::IBV_WR_SEND,
            sge_start,
            num_sge: self.sges.len() - sge_start,
            remote: None,
        };
        self.push_sq(flags, op, SqEntry::Send { _local: local });
    }

    /// Stages an RDMA READ (always signaled). Needs `sq_room() > 0`. A READ outside its
    /// target is refused (no work request is staged).
    pub(crate) fn stage_read(&mut self, r: ReadSpec<B>) -> io::Result<()> {
        let end = r.offset.checked_add(r.len);
        if end.is_none_or(|e| e > r.target.len()) || r.len > u32::MAX as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "RDMA READ outside its target",
            ));
        }
        let addr = r.target.addr() + r.offset;
        // iWARP writes a READ's response into its sink as the peer's tagged writes: the sink
        // must allow remote write, so exactly its span is registered so for this READ only.
        let sink = if self.sink_remote_write && r.len > 0 {
            // SAFETY: the span lies inside `r.target` (checked above), registered memory that
            // the entry below keeps alive, at the same address, for as long as this
            // registration lives: the entry drops the registration before the target.
            Some(unsafe {
                self.pd
                    .reg_mr(
                        addr,
                        r.len,
                        AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
                    )
                    .map_err(io::Error::other)?
            })
        } else {
            None
        };
        let sge_start = self.sges.len();
        self.sges.push(sys::ibv_sge {
            addr: addr as u64,
            length: r.len as u32,
            lkey: sink.as_ref().map_or_else(|| r.target.lkey(), |m| m.lkey()),
        });
        let op = StagedOp::Sge {
            opcode: sys::ibv_wr_opcode::IBV_WR_RDMA_READ,
            sge_start,
            num_sge: 1,
            remote: Some((r.remote_addr, r.rkey)),
        };
        let entry = SqEntry::Read {
            _sink: sink,
            target: r.target,
            tag: r.tag,
            len: r.len,
        };
        self.push_sq(sys::ibv_send_flags::IBV_SEND_SIGNALED.0, op, entry);
        Ok(())
    }

    /// Stages a zero-length RDMA READ, signaled: it reads nothing, and the peer answers it
    /// without touching its memory (rkey 0; IBA C9-88 and iWARP's RTR READ need no key for
    /// zero bytes). Sent on iWARP to make soft-iWARP read what it left in the peer's socket
    /// (`Work::Probe`). Its sink is a control slot's address with no length. Needs
    /// `sq_room() > 0`.
    pub(crate) fn stage_probe(&mut self) {
        let sge_start = self.sges.len();
        self.sges.push(sys::ibv_sge {
            addr: self.ctrl.addr() as u64,
            length: 0,
            lkey: self.ctrl.lkey(),
        });
        let op = StagedOp::Sge {
            opcode: sys::ibv_wr_opcode::IBV_WR_RDMA_READ,
            sge_start,
            num_sge: 1,
            remote: Some((0, 0)),
        };
        self.push_sq(sys::ibv_send_flags::IBV_SEND_SIGNALED.0, op, SqEntry::Probe);
    }

    /// Whether this queue pair follows iWARP's rules (its READ sinks allow remote write).
    pub(crate) fn on_iwarp(&self) -> bool {
        self.sink_remote_write
    }

    /// Exposes `held` to the peer for RDMA READ, through a type-2 memory window bound to this
    /// queue pair (staged; posted by [`Endpoint::ring`] ahead of the RTS that announces it).
    /// Returns the address and rkey to announce. Needs `sq_room() > 0`.
    pub(crate) fn stage_expose(&mut self, id: u32, held: HeldBytes) -> io::Result<(u64, u32)> {
        if !held.exposable {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "memory registered without window binding",
            ));
        }
        if self.exposed.contains_key(&id) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "rendezvous id already exposed",
            ));
        }
        let addr = held.bytes.as_ptr() as u64;
        if self.expose_by == ExposeBy::Registration {
            // SAFETY: `held` keeps the payload's memory alive and unchanged (`Bytes` are
            // immutable) and is kept with the registration, which is dropped first (field
            // order of `Exposure::Registered`). Remote read only: the device never writes it.
            let mr = unsafe {
                self.pd
                    .reg_mr(addr as usize, held.bytes.len(), AccessFlags::RemoteRead)
                    .map_err(io::Error::other)?
            };
            let rkey = mr.rkey();
            self.exposed.insert(
                id,
                Exposure::Registered {
                    _mr: mr,
                    _held: held,
                },
            );
            return Ok((addr, rkey));
        }
        let mut window = match self.free_windows.pop() {
            Some(w) => w,
            None => Window::alloc(&self.pd)?,
        };
        // A new key for every binding: the previous transfer's rkey no longer matches.
        // SAFETY: plain arithmetic on the key's low byte (an `unsafe fn` in the binding).
        window.rkey = unsafe { sys::ibv_inc_rkey(window.rkey) };
        let op = StagedOp::Bind {
            mw: MwPtr(window.mw),
            rkey: window.rkey,
            mr: held.mr,
            addr,
            len: held.bytes.len() as u64,
        };
        let rkey = window.rkey;
        self.push_sq(0, op, SqEntry::Bind);
        self.staged_binds += 1;
        self.exposed.insert(id, Exposure::Window { window, held });
        Ok((addr, rkey))
    }

    /// Revokes the peer's access to rendezvous `id` (a local invalidation of its window,
    /// staged); the payload is released when the invalidation completes. Needs `sq_room() > 0`.
    pub(crate) fn stage_unexpose(&mut self, id: u32) {
        let Some(exposure) = self.exposed.remove(&id) else {
            return;
        };
        let rkey = match &exposure {
            Exposure::Window { window, .. } => window.rkey,
            // Deregistered now (`ibv_dereg_mr` returns once the device no longer accepts the
            // key), then the payload is released.
            Exposure::Registered { .. } => return drop(exposure),
        };
        let op = StagedOp::Invalidate { rkey };
        self.push_sq(0, op, SqEntry::Invalidate { exposure });
    }

    /// Stages a receive into `buf` (posted by [`Endpoint::ring`]). Fails when the receive table
    /// is full (more buffers than the queue's depth).
    pub(crate) fn stage_recv(&mut self, buf: B) -> Result<(), B> {
        if self.srq.is_some() {
            self.srq_staged.push(buf);
            return Ok(());
        }
        let Some(slot) = self.recv_free.pop() else {
            return Err(buf);
        };
        let sge = sys::ibv_sge {
            addr: buf.addr() as u64,
            length: buf.len().min(u32::MAX as usize) as u32,
            lkey: buf.lkey(),
        };
        self.recv[slot] = Some(buf);
        self.staged_recv.push((RECV_BIT | slot as u64, sge));
        Ok(())
    }

    /// Posts everything staged: one `ibv_post_recv` and one `ibv_post_send` at most.
    /// Returns the number of doorbells rung.
    pub(crate) fn ring(&mut self) -> io::Result<u64> {
        let mut doorbells = 0;
        if let Some(srq) = &self.srq {
            // Buffers given back, then fresh ones for slots a completion took and no buffer
            // came back for: one lock to learn both.
            let gave_back = !self.srq_staged.is_empty();
            if std::mem::take(&mut self.srq_took) {
                let fresh = srq.post_and_refill(&mut self.srq_staged)?;
                doorbells += u64::from(gave_back) + u64::from(fresh > 0);
            } else if gave_back {
                srq.post(&mut self.srq_staged)?;
                doorbells += 1;
            }
        }
        // Taken before the work-request lists are borrowed.
        // SAFETY: only the handle is read here; it stays valid while `self.qp` lives (until
        // drop), and it is used only by the two posts below.
        let qp = unsafe { self.qp().qp() }.as_ptr();
        if !self.staged_recv.is_empty() {
            let lists = &mut self.lists;
            lists.recv_sges.clear();
            lists
                .recv_sges
                .extend(self.staged_recv.iter().map(|(_, s)| *s));
            lists.recv.clear();
            lists
                .recv
                .extend(self.staged_recv.iter().map(|(id, _)| sys::ibv_recv_wr {
                    wr_id: *id,
                    next: std::ptr::null_mut(),
                    sg_list: std::ptr::null_mut(),
                    num_sge: 1,
                }));
            lists.link_recv();
            self.staged_recv.clear();
            let mut bad: *mut sys::ibv_recv_wr = std::ptr::null_mut();
            // SAFETY: `lists.recv` is a well-formed list whose SGEs (in `lists.recv_sges`, not
            // touched across the call) each cover one whole buffer (`LocalMemory`: registered,
            // local write) that `self.recv` now owns and keeps until the receive's completion
            // (or until the QP, dropped first, is destroyed). The QP handle is valid while
            // `self.qp` lives.
            let rc = unsafe { sys::ibv_post_recv(qp, lists.recv.as_mut_ptr(), &mut bad) };
            lists.clear();
            doorbells += 1;
            if rc != 0 {
                return Err(io::Error::from_raw_os_error(rc));
            }
        }
        if !self.staged.is_empty() {
            // The last request of every batch is signaled, so nothing waits for a later batch
            // to be released (the queue is also signaled every quarter, see `push_sq`).
            let last = self.staged.len() - 1;
            if self.staged[last].flags & sys::ibv_send_flags::IBV_SEND_SIGNALED.0 == 0 {
                self.staged[last].flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
                self.unsignaled = 0;
            }
            let n = self.staged.len();
            let wrs = &mut self.lists.send;
            wrs.clear();
            // SAFETY: an all-zero `ibv_send_wr` is a valid value of this plain C struct
            // (null pointers, zero counts, zeroed unions).
            wrs.resize_with(n, || unsafe { std::mem::zeroed() });
            for (i, s) in self.staged.iter().enumerate() {
                let wr = &mut wrs[i];
                wr.wr_id = s.seq;
                wr.send_flags = s.flags;
                match s.op {
                    StagedOp::Sge {
                        opcode,
                        sge_start,
                        num_sge,
                        remote,
                    } => {
                        wr.opcode = opcode;
                        wr.num_sge = num_sge as i32;
                        wr.sg_list = &mut self.sges[sge_start];
                        if let Some((addr, rkey)) = remote {
                            wr.wr.rdma = sys::rdma_t {
                                remote_addr: addr,
                                rkey,
                            };
                        }
                    }
                    StagedOp::Bind {
                        mw,
                        rkey,
                        mr,
                        addr,
                        len,
                    } => {
                        wr.opcode = sys::ibv_wr_opcode::IBV_WR_BIND_MW;
                        wr.bind_mw_tso_union.bind_mw = sys::bind_mw_t {
                            mw: mw.0.as_ptr(),
                            rkey,
                            bind_info: sys::ibv_mw_bind_info {
                                mr: mr.mr.as_ptr(),
                                addr,
                                length: len,
                                mw_access_flags: sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
                            },
                        };
                    }
                    StagedOp::Invalidate { rkey } => {
                        wr.opcode = sys::ibv_wr_opcode::IBV_WR_LOCAL_INV;
                        wr.imm_data_invalidated_rkey_union.invalidated_rkey = rkey;
                    }
                }
            }
            for i in 0..n.saturating_sub(1) {
                let next: *mut sys::ibv_send_wr = &mut wrs[i + 1];
                wrs[i].next = next;
            }
            let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
            // SAFETY: `wrs` is a well-formed list; every SGE points either into the control
            // region (owned by `self`), into a buffer or payload held in `self.sq` until the
            // completion, or (inline) into a payload held in `self.sq` and copied by the
            // provider during this call. Lengths never exceed the memory they describe (checked
            // when staged). READ targets are buffers held in `self.sq`. A window bind names a
            // window and a registration that `self.exposed` keeps alive (the window until it is
            // invalidated or deallocated, the registration through the payload it exposes),
            // and a range inside that registration (`HeldBytes`). The QP is valid.
            let rc = unsafe { sys::ibv_post_send(qp, wrs.as_mut_ptr(), &mut bad) };
            self.lists.clear();
            // A type-2 window's new key is the application's to track: the provider names the
            // window by the key in `ibv_mw` (checked against the device's), so the next bind or
            // invalidation must find the key this bind installs. (Most batches hold no bind.)
            if self.staged_binds > 0 {
                for s in &self.staged {
                    if let StagedOp::Bind { mw, rkey, .. } = s.op {
                        // SAFETY: the window is alive (kept in `self.exposed`) and only this
                        // endpoint uses it; the provider read the old key during the post.
                        unsafe { (*mw.0.as_ptr()).rkey = rkey };
                    }
                }
            }
            self.staged.clear();
            self.staged_binds = 0;
            self.sges.clear();
            doorbells += 1;
            if rc != 0 {
                return Err(io::Error::from_raw_os_error(rc));
            }
        }
        Ok(doorbells)
    }

    /// Posts `msg` as one inline SEND at once (the link's ping-pong, after perftest's
    /// `ib_send_lat`): no staging, one work request built on the stack, signaled only every
    /// quarter of the send queue (perftest signals one in 100). Whatever was staged goes first.
    /// Needs `sq_room() > 0` and `msg.len() <= inline_max()`.
    pub(crate) fn post_inline_now(&mut self, msg: &[u8]) -> io::Result<()> {
        if msg.len() > self.inline_max || self.sq_room() == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "inline send: too long, or no room in the send queue",
            ));
        }
        if self.has_staged() {
            self.ring()?;
        }
        self.post_one_inline(msg.as_ptr() as u64, msg.len())
    }

    /// Whether work is staged for the next [`Endpoint::ring`].
    pub(crate) fn has_staged(&self) -> bool {
        !self.staged.is_empty() || !self.staged_recv.is_empty() || !self.srq_staged.is_empty()
    }

    /// Posts the first `len` bytes of the next control slot (see [`Endpoint::next_ctrl_slot`])
    /// as one inline SEND at once, as [`Endpoint::post_inline_now`] posts a message: the fast
    /// path of a small message. Needs `sq_room() > 0`, `len <= inline_max()` and nothing
    /// staged (else it refuses, posting nothing).
    pub(crate) fn post_slot_inline_now(&mut self, len: usize) -> io::Result<()> {
        if len > self.inline_max || self.sq_room() == 0 || self.has_staged() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "inline send: too long, no room in the send queue, or work staged before it",
            ));
        }
        let sge = self.ctrl_sge(self.next_seq, len);
        self.post_one_inline(sge.addr, len)
    }

    /// One inline SEND of `len` bytes at `addr`, signaled every quarter of the send queue.
    /// The caller checked room, the inline limit and that `addr..addr + len` is readable
    /// memory that lives across this call.
    fn post_one_inline(&mut self, addr: u64, len: usize) -> io::Result<()> {
        let seq = self.next_seq;
        self.unsignaled += 1;
        let mut flags = sys::ibv_send_flags::IBV_SEND_INLINE.0;
        if self.unsignaled as usize >= (self.sq_depth / 4).max(1) {
            flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
            self.unsignaled = 0;
        }
        let mut sge = sys::ibv_sge {
            addr,
            length: len as u32,
            lkey: 0,
        };
        // SAFETY: an all-zero `ibv_send_wr` is a valid value of this plain C struct.
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = seq;
        wr.opcode = sys::ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = flags;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: one well-formed request whose SGE points at `len` readable bytes (a message
        // borrowed by the caller, or a control slot of `self.ctrl`), which the provider copies
        // into the request during this call (IBV_SEND_INLINE: no lkey, nothing to keep). The QP
        // handle is valid while `self.qp` lives.
        let rc = unsafe { sys::ibv_post_send(self.qp().qp().as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        self.next_seq += 1;
        // Nothing is held for an inline send: the entry only keeps the queue's accounting.
        self.sq.push_back((
            seq,
            SqEntry::Send {
                _local: SqLocal::Ctrl { len: 0 },
            },
        ));
        Ok(())
    }

    /// Polls one completion (the link's ping-pong, after perftest's `ib_send_lat`). A received
    /// message on this QP's own receive queue is copied into `into` (as much as fits) and its
    /// buffer posted again at once, in place; its length is returned. Anything else (a send
    /// completion, a failed receive) goes to `others` as [`Endpoint::poll`] would report it.
    /// Fails on a QP that receives through the shared queue.
    pub(crate) fn poll_one(
        &mut self,
        into: &mut [u8],
        others: &mut Vec<Completion<B>>,
    ) -> io::Result<Option<usize>> {
        if self.srq.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "poll_one: the QP receives through the shared queue",
            ));
        }
        let copy = |got: &[u8]| {
            let k = got.len().min(into.len());
            into[..k].copy_from_slice(&got[..k]);
            Some(got.len())
        };
        Ok(match self.poll_recv_in_place(copy, others)? {
            InPlace::Taken(len) => Some(len),
            InPlace::Empty | InPlace::Other => None,
        })
    }

    /// Polls one completion: the receiving half's fast path for a small message (poll, check,
    /// copy, post again, in one go). A successful receive's bytes are shown to `take`; when it
    /// returns a value (it copied what it needs), the same buffer is posted again at once in
    /// place, on the QP's own receive queue or the shared one, and the value is returned.
    /// Anything else (`take` declines, a send completion, a failed receive) goes to `others`
    /// as [`Endpoint::poll`] would report it.
    pub(crate) fn poll_recv_in_place<R>(
        &mut self,
        take: impl FnOnce(&[u8]) -> Option<R>,
        others: &mut Vec<Completion<B>>,
    ) -> io::Result<InPlace<R>> {
        let mut wc = std::mem::MaybeUninit::<sys::ibv_wc>::uninit();
        // SAFETY: room for one entry; ibv_poll_cq writes at most that many and returns how
        // many it wrote (or a negative error). The CQ is valid while `self.cq` lives.
        let n = unsafe { sys::ibv_poll_cq(self.cq.cq().as_ptr(), 1, wc.as_mut_ptr()) };
        if n < 0 {
            return Err(io::Error::from_raw_os_error(-n));
        }
        if n == 0 {
            return Ok(InPlace::Empty);
        }
        // SAFETY: ibv_poll_cq initialised the one entry it reported.
        let wc = unsafe { wc.assume_init() };
        let status = wc_status(&wc);
        if wc.wr_id & RECV_BIT == 0 {
            self.complete_sq(wc.wr_id, status, others);
            return Ok(InPlace::Other);
        }
        let slot = recv_slot(wc.wr_id);
        // The buffer's memory, left where it is: only a completion naming its slot takes it
        // out, and this is that completion.
        let mem = match &self.srq {
            Some(srq) => srq.peek_posted(wc.wr_id),
            None => self
                .recv
                .get(slot)
                .and_then(Option::as_ref)
                .map(|b| (b.addr(), b.len(), b.lkey())),
        };
        let Some((addr, cap, lkey)) = mem else {
            return Ok(InPlace::Other); // not ours (cannot happen): ignore rather than crash
        };
        let taken = if status.is_ok() {
            let len = (wc.byte_len as usize).min(cap);
            // SAFETY: `addr..addr + cap` is the registered memory of the buffer in `slot`
            // (`LocalMemory`), which stays in its table (the SRQ's, kept alive by `self.srq`, or
            // `self.recv`) until a completion naming the slot takes it; `len <= cap`; the device
            // wrote it before this completion and writes it again only after the post below.
            let got = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
            take(got)
        } else {
            None
        };
        let Some(r) = taken else {
            // The generic path, as `poll` reports it.
            let buf = self.take_recv(slot);
            if let Some(buf) = buf {
                let len = (wc.byte_len as usize).min(buf.len());
                others.push(Completion::Recv { buf, len, status });
            }
            return Ok(InPlace::Other);
        };
        let sge = sys::ibv_sge {
            addr: addr as u64,
            length: cap.min(u32::MAX as usize) as u32,
            lkey,
        };
        match &self.srq {
            Some(srq) => {
                if let Err(e) = srq.repost(wc.wr_id, sge) {
                    self.srq_took = true;
                    return Err(e);
                }
            }
            None => {
                let mut sge = sge;
                let mut rwr = sys::ibv_recv_wr {
                    wr_id: wc.wr_id,
                    next: std::ptr::null_mut(),
                    sg_list: &mut sge,
                    num_sge: 1,
                };
                let mut bad: *mut sys::ibv_recv_wr = std::ptr::null_mut();
                // SAFETY: the buffer stays in `self.recv[slot]` (registered, local write, owned
                // by the table until its next completion or until the QP, dropped first, is
                // destroyed); `take` copied out what it kept before the device may write into
                // it again. The QP handle is valid while `self.qp` lives.
                let rc = unsafe { sys::ibv_post_recv(self.qp().qp().as_ptr(), &mut rwr, &mut bad) };
                if rc != 0 {
                    // Not posted: the buffer leaves the table (back to the pool), its slot free.
                    if self.recv.get_mut(slot).and_then(Option::take).is_some() {
                        self.recv_free.push(slot);
                    }
                    return Err(io::Error::from_raw_os_error(rc));
                }
            }
        }
        Ok(InPlace::Taken(r))
    }

    /// Takes the buffer of the receive completion that names `slot` out of its table (the
    /// shared queue's, which a later `ring` refills, or the QP's own).
    fn take_recv(&mut self, slot: usize) -> Option<B> {
        match &self.srq {
            Some(srq) => {
                self.srq_took = true;
                srq.take(slot)
            }
            None => self.recv.get_mut(slot).and_then(Option::take).inspect(|_| {
                self.recv_free.push(slot);
            }),
        }
    }

    /// Polls up to [`POLL_BATCH`] completions into `out`; returns how many work completions were read.
    pub(crate) fn poll(&mut self, out: &mut Vec<Completion<B>>) -> io::Result<usize> {
        let n = self.poll_wcs()?;
        for i in 0..n {
            let wc = self.wcs[i];
            let status = wc_status(&wc);
            if wc.wr_id & RECV_BIT != 0 {
                let slot = recv_slot(wc.wr_id);
                let buf = self.take_recv(slot);
                let Some(buf) = buf else {
                    continue; // not ours (cannot happen): ignore rather than crash
                };
                let len = (wc.byte_len as usize).min(buf.len());
                out.push(Completion::Recv { buf, len, status });
            } else {
                self.complete_sq(wc.wr_id, status, out);
            }
        }
        Ok(n)
    }

    /// Reads up to [`POLL_BATCH`] work completions into `self.wcs`; returns how many.
    fn poll_wcs(&mut self) -> io::Result<usize> {
        self.wcs.clear();
        let cap = POLL_BATCH.min(self.wcs.capacity());
        // SAFETY: `wcs` has room for `cap` entries; ibv_poll_cq writes at most that many and
        // returns how many it wrote (or a negative error). The CQ is valid while `self.cq` lives
        // (also in `Drop`, whose body runs before the fields drop).
        let n =
            unsafe { sys::ibv_poll_cq(self.cq.cq().as_ptr(), cap as i32, self.wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(io::Error::from_raw_os_error(-n));
        }
        // SAFETY: the first `n` entries were initialised by ibv_poll_cq.
        unsafe { self.wcs.set_len(n as usize) };
        Ok(n as usize)
    }

    /// Send-queue completions come in order: every entry before the completed one finished
    /// successfully (an error always produces its own completion); release them all. Except
    /// an RDMA READ: it finishes when its response has arrived, and iWARP devices (siw) report
    /// the SENDs posted after it as soon as they are sent. A READ is always signaled, so it
    /// stays until its own completion.
    fn complete_sq(
        &mut self,
        wr_id: u64,
        status: Result<(), WcFailure>,
        out: &mut Vec<Completion<B>>,
    ) {
        let mut sent: Option<WorkRequestKind> = None;
        let mut reads_pending: Vec<(u64, SqEntry<B>)> = Vec::new();
        while let Some((seq, _)) = self.sq.front() {
            if *seq > wr_id {
                break;
            }
            let (seq, entry) = self.sq.pop_front().expect("front exists");
            let this = seq == wr_id;
            if !this && matches!(entry, SqEntry::Read { .. } | SqEntry::Probe) {
                reads_pending.push((seq, entry));
                continue;
            }
            let st = if this { status } else { Ok(()) };
            let kind = entry.kind();
            match entry {
                SqEntry::Read {
                    _sink,
                    target,
                    tag,
                    len,
                } => {
                    drop(_sink);
                    drop(target);
                    out.push(Completion::Read {
                        tag,
                        len,
                        status: st,
                    });
                }
                SqEntry::Invalidate { exposure } => {
                    if st.is_ok() {
                        // Invalidated: the window can expose the next payload.
                        if let Exposure::Window { window, held } = exposure {
                            drop(held);
                            self.free_windows.push(window);
                        }
                    } else {
                        // Not invalidated (QP in error): deallocate the window, then release.
                        drop(exposure);
                    }
                    if this {
                        sent = Some(kind);
                    }
                }
                SqEntry::Send { .. } | SqEntry::Bind | SqEntry::Probe => {
                    if this {
                        sent = Some(kind);
                    }
                }
            }
        }
        // Back in front, in their order, to wait for their own completions.
        for e in reads_pending.into_iter().rev() {
            self.sq.push_front(e);
        }
        if let Some(kind) = sent {
            out.push(Completion::Sent { status, kind });
        }
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

    /// Moves the QP to the error state: every outstanding work request completes (flushed).
    /// A QP that receives through a shared receive queue has no receives of its own to flush,
    /// so a signaled empty SEND is posted after the transition: its flushed completion tells
    /// the driver, even when nothing else was outstanding.
    pub(crate) fn set_error(&mut self) -> io::Result<()> {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        self.qp_mut().modify(&attr).map_err(io::Error::other)?;
        if self.srq.is_some() && self.sq_room() > 0 {
            self.stage_send(SqLocal::Ctrl { len: 0 });
            self.ring()?;
        }
        Ok(())
    }

    /// Applies a state transition during connection setup.
    pub(crate) fn modify(
        &mut self,
        attr: &QueuePairAttribute,
    ) -> Result<(), sideway::ibverbs::queue_pair::ModifyQueuePairError> {
        self.qp_mut().modify(attr)
    }

    pub(crate) fn qp_number(&self) -> u32 {
        self.qp().qp_number()
    }

    /// The queue pair (present until the endpoint drops).
    fn qp(&self) -> &RawQp {
        self.qp
            .as_ref()
            .expect("the QP lives until the endpoint drops")
    }

    fn qp_mut(&mut self) -> &mut RawQp {
        self.qp
            .as_mut()
            .expect("the QP lives until the endpoint drops")
    }

    /// Entries still in the send queue (posted, not completed).
    pub(crate) fn outstanding(&self) -> usize {
        self.sq.len()
    }
}

impl<B: LocalMemory> Drop for Endpoint<B> {
    fn drop(&mut self) {
        // Exposures still outstanding lose their windows and registrations first, so the peer
        // can read nothing more (and rxe, which holds a queue pair while a window bound
        // through it lives, lets the queue pair go at once); their payloads are kept until
        // the queue pair is gone.
        let mut payloads = Vec::with_capacity(self.exposed.len());
        for (_, exposure) in self.exposed.drain() {
            match exposure {
                Exposure::Window { window, held } => {
                    drop(window);
                    payloads.push(held);
                }
                Exposure::Registered { _mr, _held } => {
                    drop(_mr);
                    payloads.push(_held);
                }
            }
        }
        // Then the QP: no more DMA into anything below, and no more completions.
        drop(self.qp.take());
        drop(payloads);
        if let Some(srq) = self.srq.take() {
            // Receives this QP consumed whose completions were never polled: their SRQ slots
            // are posted again (the same buffers; what they hold is not needed), or the SRQ
            // would shrink by one buffer each.
            let mut bufs = std::mem::take(&mut self.srq_staged);
            while let Ok(1..) = self.poll_wcs() {
                for wc in &self.wcs {
                    if wc.wr_id & RECV_BIT != 0 {
                        bufs.extend(srq.take(recv_slot(wc.wr_id)));
                    }
                }
            }
            let _ = srq.post_and_refill(&mut bufs);
        }
    }
}
