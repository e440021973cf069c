//! The device probes that need raw verbs calls: the device's transport type, and whether a
//! type-2 memory window can be allocated and bound to a queue pair (a window is only known to
//! work once a bind has completed: irdma binds them but advertises only the type-1 flag, and
//! bnxt_re advertises them while its userspace provider cannot allocate one).
//!
//! The bind test uses a throw-away RC queue pair connected to itself (InfiniBand and RoCE
//! allow that without a peer: the bind is a local operation, nothing is sent), a 4 KiB
//! registration and one window; everything is released before the probe returns.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_mummy_sys as sys;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionQueue};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{QueuePair, QueuePairAttribute, QueuePairState};
use sideway::ibverbs::AccessFlags;

use super::{RawQp, RecvQueue, Window};

/// The receive buffer type of the probe's queue pairs, which never receive.
enum NoBuffer {}

// SAFETY: no value of this type exists, so no address is ever handed to the device.
unsafe impl super::LocalMemory for NoBuffer {
    fn addr(&self) -> usize {
        match *self {}
    }
    fn len(&self) -> usize {
        match *self {}
    }
    fn lkey(&self) -> u32 {
        match *self {}
    }
}

/// The device's transport as libibverbs reports it (`ibv_device.transport_type`): 0 InfiniBand
/// (also RoCE), 1 iWARP, other values as they are.
pub(crate) fn transport_type(ctx: &DeviceContext) -> i32 {
    // SAFETY: the context and its device are valid while `ctx` lives; one integer is read.
    unsafe { (*ctx.context().as_ref().device).transport_type }
}

/// Where the probe's queue pair talks to itself.
pub(crate) struct SelfPath {
    /// The port (an ACTIVE one).
    pub(crate) port: u8,
    /// The port's active MTU code (1..=5: 256..4096).
    pub(crate) mtu_code: u32,
    /// The port's LID (InfiniBand), 0 on Ethernet.
    pub(crate) lid: u16,
    /// A GID of the port and its index (RoCE needs a global route; InfiniBand may use one).
    pub(crate) gid: Option<(u32, std::net::Ipv6Addr)>,
}

/// Allocates a type-2 memory window and binds it to a registered buffer through a queue pair
/// connected to itself on `path`; `Ok` only when the bind completed successfully within a
/// second. The error says which step failed, with the device's answer.
pub(crate) fn type2_window_binds(
    ctx: &Arc<DeviceContext>,
    pd: &Arc<ProtectionDomain>,
    path: &SelfPath,
) -> Result<(), String> {
    let window = Window::alloc(pd).map_err(|e| format!("ibv_alloc_mw(type 2): {e}"))?;
    let cq = ctx
        .create_cq_builder()
        .setup_cqe(8)
        .build()
        .map_err(|e| format!("ibv_create_cq: {e}"))?;
    let recv: RecvQueue<NoBuffer> = RecvQueue::Own(1);
    let (mut qp, _) =
        RawQp::create(pd, &cq, 4, &recv, 0).map_err(|e| format!("ibv_create_qp: {e}"))?;
    connect_to_self(&mut qp, path)?;
    let mut region = super::OwnedRegion::new(pd, 4096, super::Access::Exposable)
        .map_err(|e| format!("ibv_reg_mr: {e}"))?;
    let addr = region.bytes_mut().as_mut_ptr() as u64;
    let mr = region.handle();
    // SAFETY: plain arithmetic on the key's low byte.
    let rkey = unsafe { sys::ibv_inc_rkey(window.rkey) };
    // SAFETY: an all-zero `ibv_send_wr` is a valid value of this plain C struct.
    let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = 1;
    wr.opcode = sys::ibv_wr_opcode::IBV_WR_BIND_MW;
    wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
    wr.bind_mw_tso_union.bind_mw = sys::bind_mw_t {
        mw: window.mw.as_ptr(),
        rkey,
        bind_info: sys::ibv_mw_bind_info {
            mr: mr.mr.as_ptr(),
            addr,
            length: 4096,
            mw_access_flags: sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
        },
    };
    let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
    // SAFETY: `wr` is one well-formed request; the window, the registration (inside `region`)
    // and the queue pair outlive the call and the completion polled below (all are dropped at
    // the end of this function, the queue pair first).
    let rc = unsafe { sys::ibv_post_send(qp.qp().as_ptr(), &mut wr, &mut bad) };
    if rc != 0 {
        return Err(format!(
            "posting a window bind: {}",
            io::Error::from_raw_os_error(rc)
        ));
    }
    let status = poll_one(&cq, Duration::from_secs(1))?;
    if status != sys::ibv_wc_status::IBV_WC_SUCCESS {
        return Err(format!("the window bind completed with status {status}"));
    }
    // The window goes first: rxe holds its queue pair until a window bound through it is
    // deallocated, and destroying the queue pair first waits for that (~50 s under
    // emulation). Then the
    // queue pair (no request can reach the memory), then the memory.
    drop(window);
    drop(qp);
    drop(region);
    Ok(())
}

/// Moves `qp` through INIT, RTR and RTS with itself as the destination.
fn connect_to_self(qp: &mut RawQp, path: &SelfPath) -> Result<(), String> {
    let modify = |qp: &mut RawQp, attr: &QueuePairAttribute, step: &str| {
        qp.modify(attr)
            .map_err(|e| format!("ibv_modify_qp({step}): {e}"))
    };
    let mut init = QueuePairAttribute::new();
    init.setup_state(QueuePairState::Init)
        .setup_pkey_index(0)
        .setup_port(path.port)
        .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteRead);
    modify(qp, &init, "INIT")?;
    let mut ah = AddressHandleAttribute::new();
    ah.setup_port(path.port).setup_dest_lid(path.lid);
    if let Some((index, gid)) = path.gid {
        let index = u8::try_from(index).map_err(|_| format!("GID index {index} out of range"))?;
        ah.setup_grh(&Gid::from(gid), 0, index, 1, 0);
    }
    let mtu = match path.mtu_code {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        5 => Mtu::Mtu4096,
        _ => Mtu::Mtu1024,
    };
    let qpn = qp.qp_number();
    let mut rtr = QueuePairAttribute::new();
    rtr.setup_state(QueuePairState::ReadyToReceive)
        .setup_path_mtu(mtu)
        .setup_dest_qp_num(qpn)
        .setup_rq_psn(0)
        .setup_max_dest_read_atomic(1)
        .setup_min_rnr_timer(12)
        .setup_address_vector(&ah);
    modify(qp, &rtr, "RTR")?;
    let mut rts = QueuePairAttribute::new();
    rts.setup_state(QueuePairState::ReadyToSend)
        .setup_sq_psn(0)
        .setup_timeout(14)
        .setup_retry_cnt(1)
        .setup_rnr_retry(1)
        .setup_max_read_atomic(1);
    modify(qp, &rts, "RTS")
}

/// Polls `cq` for one completion for at most `within`: its status.
fn poll_one(cq: &BasicCompletionQueue, within: Duration) -> Result<u32, String> {
    let until = Instant::now() + within;
    loop {
        let mut wc = std::mem::MaybeUninit::<sys::ibv_wc>::uninit();
        // SAFETY: room for one entry; the CQ is valid while `cq` lives.
        let n = unsafe { sys::ibv_poll_cq(cq.cq().as_ptr(), 1, wc.as_mut_ptr()) };
        if n < 0 {
            return Err(format!("ibv_poll_cq: {}", io::Error::from_raw_os_error(-n)));
        }
        if n > 0 {
            // SAFETY: ibv_poll_cq initialised the entry it reported.
            return Ok(unsafe { wc.assume_init() }.status);
        }
        if Instant::now() >= until {
            return Err("the window bind did not complete within 1 s".into());
        }
        std::thread::yield_now();
    }
}

/// The inline data a queue pair gets when it asks for `want` bytes: what the provider writes
/// back, trying smaller requests (128, 64, 0) where a device refuses the larger one.
pub(crate) fn granted_inline(
    ctx: &Arc<DeviceContext>,
    pd: &Arc<ProtectionDomain>,
    want: u32,
) -> u32 {
    let Ok(cq) = ctx.create_cq_builder().setup_cqe(8).build() else {
        return 0;
    };
    let recv: RecvQueue<NoBuffer> = RecvQueue::Own(1);
    for ask in [want, 128, 64, 0] {
        if ask > want {
            continue;
        }
        if let Ok((_qp, caps)) = RawQp::create(pd, &cq, 4, &recv, ask) {
            return caps.max_inline_data;
        }
    }
    0
}

/// The LID of `port` (InfiniBand; 0 on Ethernet or when the port cannot be queried).
pub(crate) fn port_lid(ctx: &DeviceContext, port: u8) -> u16 {
    ctx.query_port(port).map_or(0, |p| p.attr.lid)
}

/// The mean time to register `len` bytes of heap memory for remote read and deregister them,
/// over `iterations` rounds: what registration exposure adds to a rendezvous message (the
/// memory is touched first, so page faults are not counted).
pub(crate) fn registration_round_trip(
    pd: &Arc<ProtectionDomain>,
    len: usize,
    iterations: u32,
) -> io::Result<Duration> {
    let buf = vec![0x5au8; len.max(1)];
    let started = Instant::now();
    for _ in 0..iterations.max(1) {
        // SAFETY: `buf` is live, unmoved and not freed while the registration exists: the
        // region is dropped (deregistered) at the end of this iteration, before `buf`.
        let mr = unsafe {
            pd.reg_mr(buf.as_ptr() as usize, buf.len(), AccessFlags::RemoteRead)
                .map_err(io::Error::other)?
        };
        drop(mr);
    }
    Ok(started.elapsed() / iterations.max(1))
}
