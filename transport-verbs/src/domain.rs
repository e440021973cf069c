//! Resources that belong to a device, not to a connection (libfabric's domain, UCX's worker):
//! per device and transport, the device's probed capabilities ([`DeviceCaps`]), one completion
//! channel and its pump thread, and the protection domain with its registered buffer pool,
//! registration cache and shared receive queue.
//!
//! With memory-window exposure (the default where a type-2 window binds) every connection of
//! the transport on the device shares one protection domain: isolation between them does not
//! rest on it, since no memory region grants remote access (local access and window binding
//! only) and a payload is exposed only through a window bound to its own connection's queue
//! pair and invalidated after its FIN. With registration exposure a payload is exposed by a
//! registration, which every queue pair of its protection domain could use: each connection
//! then gets a protection domain of its own (with its own pool and receive buffers), so that
//! another connection's peer cannot read it even with the key (see the crate docs' security
//! model).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use crate::caps::{DeviceCaps, ExposurePath, Paths};
use crate::config::VerbsConfig;
use crate::cq_pump::CqPump;
use crate::ffi::Srq;
use crate::pool::{PoolBuf, SharedPool};
use crate::siw_keys::KeyGuard;

/// A protection domain and what lives in it: shared by the transport's connections on a
/// device (memory-window exposure), or one connection's own (registration exposure).
pub(crate) struct Domain {
    pub(crate) pd: Arc<ProtectionDomain>,
    pub(crate) pool: SharedPool,
    /// The shared receive queue of the transport's connections on this device (`srq_depth`
    /// buffers of `recv_buf_size()` from the pool), if its paths have one.
    pub(crate) srq: Option<Arc<Srq<PoolBuf>>>,
    /// The path each feature takes for the transport's settings on this device.
    pub(crate) paths: Paths,
    /// The completion channel of every connection's CQ on this device, and its pump.
    pub(crate) cq_pump: Arc<CqPump>,
    /// Bytes registered by connections for themselves (their send slots), right now.
    own: AtomicUsize,
    /// Bytes of pool buffers posted as receive buffers by connections, right now.
    posted: AtomicUsize,
    /// Connections on this domain right now.
    connections: AtomicUsize,
    /// On siw, the mmap key guard of the device context (see `siw_keys`), held by every
    /// domain and so by every connection.
    _siw_guard: Option<Arc<KeyGuard>>,
}

impl Domain {
    /// Counts a connection, `own` bytes it registered for itself and `posted` bytes of pool
    /// buffers it keeps posted for receiving, until the returned guard drops (with the
    /// connection's endpoint). The guard keeps the domain alive: a connection's own domain
    /// (registration exposure) lives exactly as long as the connection.
    pub(crate) fn join(self: &Arc<Self>, own: usize, posted: usize) -> Member {
        self.own.fetch_add(own, Ordering::Relaxed);
        self.posted.fetch_add(posted, Ordering::Relaxed);
        self.connections.fetch_add(1, Ordering::Relaxed);
        Member {
            own_bytes: own,
            posted_bytes: posted,
            domain: self.clone(),
        }
    }
}

/// A connection's membership of its domain (see [`Domain::join`]).
pub(crate) struct Member {
    own_bytes: usize,
    posted_bytes: usize,
    domain: Arc<Domain>,
}

impl Drop for Member {
    fn drop(&mut self) {
        let d = &self.domain;
        d.own.fetch_sub(self.own_bytes, Ordering::Relaxed);
        d.posted.fetch_sub(self.posted_bytes, Ordering::Relaxed);
        d.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One device's part of a transport: probed once, then shared by its domains.
struct DeviceEntry {
    caps: Arc<DeviceCaps>,
    siw_guard: Option<Arc<KeyGuard>>,
    cq_pump: Arc<CqPump>,
    /// The domain every connection shares (memory-window exposure), made on first use.
    shared: Option<Arc<Domain>>,
    /// The connections' own domains (registration exposure), while they live.
    private: Vec<Weak<Domain>>,
}

/// How long the transport re-reads librdmacm's device list after a device's removal, waiting
/// for the kernel to take the device off it (see [`Domains::device_removed`]).
const RELEASE_WATCH: std::time::Duration = std::time::Duration::from_secs(120);

/// Weak handles on what a removed device's entry held: gone once every connection, buffer
/// and pump on the device has let go.
struct Held {
    pump: Weak<CqPump>,
    pds: Vec<Weak<ProtectionDomain>>,
    guard: Option<Weak<KeyGuard>>,
}

impl Held {
    fn of(e: &DeviceEntry) -> Held {
        let domains = e
            .shared
            .iter()
            .cloned()
            .chain(e.private.iter().filter_map(Weak::upgrade));
        Held {
            pump: Arc::downgrade(&e.cq_pump),
            pds: domains.map(|d| Arc::downgrade(&d.pd)).collect(),
            guard: e.siw_guard.as_ref().map(Arc::downgrade),
        }
    }

    fn all_gone(&self) -> bool {
        self.pump.strong_count() == 0
            && self.pds.iter().all(|p| p.strong_count() == 0)
            && self.guard.as_ref().is_none_or(|g| g.strong_count() == 0)
    }
}

/// Waits (bounded) until everything of ours on the removed `device` is gone, then re-reads
/// librdmacm's device list until the device is off it: librdmacm then closes its context of
/// the device, and the kernel can finish the removal.
fn give_back(device: &str, held: &Held) {
    let start = std::time::Instant::now();
    let step = std::time::Duration::from_millis(50);
    while !held.all_gone() {
        if start.elapsed() > RELEASE_WATCH {
            tracing::warn!(
                device,
                "the removed device's resources are still in use after {RELEASE_WATCH:?} \
                 (a connection or received payload the application holds); it is not given back"
            );
            return;
        }
        std::thread::sleep(step);
    }
    while start.elapsed() < RELEASE_WATCH {
        if !crate::ffi::cm_devices::rdma_cm_devices()
            .iter()
            .any(|d| d == device)
        {
            tracing::debug!(device, "removed device given back to librdmacm");
            return;
        }
        std::thread::sleep(step);
    }
    tracing::warn!(
        device,
        "the removed device is still listed after {RELEASE_WATCH:?}"
    );
}

/// The domains of one transport, by device context.
#[derive(Default)]
pub(crate) struct Domains {
    by_context: Mutex<HashMap<usize, DeviceEntry>>,
}

/// What a transport has registered and how many connections it has, across its devices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryUse {
    /// Connections open right now.
    pub connections: usize,
    /// Bytes registered with the devices right now: the shared pools' buffers (posted
    /// receive buffers, buffers in use, idle ones kept for reuse), cached user registrations
    /// and the connections' send slots.
    pub registered_bytes: usize,
    /// The part of `registered_bytes` that connections hold for themselves while they live,
    /// busy or idle: their send slots (`send_depth` × 128 bytes), plus, without a shared
    /// receive queue (`srq_depth` 0), their posted receive buffers (`recv_depth + 1`
    /// × `recv_buf_size()`: one spare beyond the credits).
    pub per_connection_bytes: usize,
    /// The part of `registered_bytes` posted to the devices' shared receive queues right now
    /// (`shared_receive_buffers` × `recv_buf_size()` once every buffer is back), shared by
    /// every connection: it does not grow with the number of connections.
    pub shared_receive_bytes: usize,
    /// Buffers the devices' shared receive queues keep posted: `srq_depth` per device once
    /// its first connection was made, more where a queue grew (up to `srq_max_depth`).
    pub shared_receive_buffers: usize,
    /// The part of `registered_bytes` in pool buffers taken from the pools and not returned,
    /// other than posted receive buffers (those of the shared receive queues and the
    /// connections' own): buffers held by messages in flight, send buffers from
    /// [`transport_core::MessageSender::buffer_pool`], received payloads the application still
    /// holds (handed over in place, or read by rendezvous), and READ targets of transfers
    /// under way. With no connection open and no received payload held it is 0: a buffer that
    /// is never returned (a leak) stays counted here. The counters it is made of are read
    /// without stopping the connections, so a reading taken while buffers come and go may be
    /// off by those buffers (never below 0). Registration exposure gives each connection a
    /// pool of its own, counted only while the connection lives: a payload it received and
    /// the application still holds after it closed is no longer counted.
    pub lent_bytes: usize,
}

/// Fewest buffers a shared receive queue is made smaller to (the least `srq_depth` allowed).
pub(crate) const MIN_SRQ_DEPTH: usize = 4;

/// The shared receive queue depth to use: `depth` buffers of `size` bytes, or fewer when a
/// locked-memory `budget` (see [`crate::ffi::memlock_budget`]) would not hold them in its
/// half (the other half is left for send buffers and rendezvous registrations), but never
/// fewer than [`MIN_SRQ_DEPTH`] (if even those do not fit, registering them fails with the
/// typed error that names the limit).
pub(crate) fn srq_depth_within(depth: usize, size: usize, budget: Option<u64>) -> usize {
    match budget {
        Some(limit) => {
            let fits = (limit / 2) / size.max(1) as u64;
            depth.min(
                usize::try_from(fits)
                    .unwrap_or(usize::MAX)
                    .max(MIN_SRQ_DEPTH),
            )
        }
        None => depth,
    }
}

impl Domains {
    /// The domain for a new connection on `ctx`'s device (`device` names it in errors): the
    /// device's shared one, or with registration exposure a new one of the connection's own.
    /// The device is probed on its first connection.
    pub(crate) fn for_context(
        &self,
        ctx: &Arc<DeviceContext>,
        device: &str,
        cfg: &VerbsConfig,
    ) -> std::io::Result<Arc<Domain>> {
        // rdma_cm opens each device once per process, and sideway keeps one `DeviceContext`
        // per opened context: the pointer names the device.
        let key = Arc::as_ptr(ctx) as usize;
        let mut map = self.by_context.lock().unwrap_or_else(|p| p.into_inner());
        let entry = match map.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(probe(ctx, device)?),
        };
        let paths = entry.caps.paths(cfg);
        if paths.exposure == ExposurePath::MemoryWindow {
            if let Some(d) = &entry.shared {
                return Ok(d.clone());
            }
        }
        let d = new_domain(
            ctx,
            device,
            cfg,
            paths,
            &entry.cq_pump,
            entry.siw_guard.clone(),
        )?;
        if d.paths.exposure == ExposurePath::MemoryWindow {
            entry.shared = Some(d.clone());
        } else {
            entry.private.retain(|w| w.strong_count() > 0);
            entry.private.push(Arc::downgrade(&d));
        }
        Ok(d)
    }

    /// rdma_cm reported `ctx`'s device removed: forgets the device's entry (its probed
    /// capabilities, completion channel and shared domain), so that its resources go as soon
    /// as the connections on it (each failed by its own removal event) and the buffers the
    /// application still holds let go of them, and a device of the same name added later is
    /// probed afresh. Then, on a thread of its own, re-reads librdmacm's device list until the
    /// device is gone from it, so that librdmacm closes its context too (see
    /// [`crate::ffi::cm_devices`]): the kernel finishes the removal only then.
    pub(crate) fn device_removed(&self, ctx: &Arc<DeviceContext>) {
        let key = Arc::as_ptr(ctx) as usize;
        let entry = {
            let mut map = self.by_context.lock().unwrap_or_else(|p| p.into_inner());
            map.remove(&key)
        };
        let Some(entry) = entry else {
            return; // already forgotten (every identifier on the device reports it)
        };
        let device = entry.caps.device.clone();
        tracing::warn!(%device, "RDMA device removed: its connections and listeners fail");
        // What must be gone before librdmacm may close the device's context: every verbs
        // object of ours on it (a context closed under them leaves their queues mapped, and
        // the mappings hold the device).
        let held = Held::of(&entry);
        drop(entry);
        let spawned = std::thread::Builder::new()
            .name(format!("verbs-gone-{device}"))
            .spawn(move || give_back(&device, &held));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread to give the removed device back");
        }
    }

    /// Test hook: breaks the queue pair of one live connection (the `turn`-th, in no
    /// particular order); whether there was one.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn break_one_qp(&self, turn: usize) -> bool {
        let pumps: Vec<Arc<CqPump>> = {
            let map = self.by_context.lock().unwrap_or_else(|p| p.into_inner());
            map.values().map(|e| e.cq_pump.clone()).collect()
        };
        pumps.iter().any(|p| p.break_one_qp(turn))
    }

    /// What each device this transport has connected through can do.
    pub(crate) fn caps(&self) -> Vec<Arc<DeviceCaps>> {
        let map = self.by_context.lock().unwrap_or_else(|p| p.into_inner());
        map.values().map(|e| e.caps.clone()).collect()
    }

    /// Memory and connections across every domain of the transport.
    pub(crate) fn memory_use(&self) -> MemoryUse {
        let map = self.by_context.lock().unwrap_or_else(|p| p.into_inner());
        let mut m = MemoryUse::default();
        let domains = map.values().flat_map(|e| {
            e.shared
                .iter()
                .cloned()
                .chain(e.private.iter().filter_map(Weak::upgrade))
        });
        for d in domains {
            let own = d.own.load(Ordering::Relaxed);
            let posted = d.posted.load(Ordering::Relaxed);
            let shared_posted = d.srq.as_ref().map_or(0, |s| s.posted_bytes());
            m.shared_receive_buffers += d.srq.as_ref().map_or(0, |s| s.depth());
            m.connections += d.connections.load(Ordering::Relaxed);
            m.per_connection_bytes += own + posted;
            m.registered_bytes += own + d.pool.registered_bytes();
            m.shared_receive_bytes += shared_posted;
            // Per domain: its pool's buffers out, less those posted to receive into.
            m.lent_bytes += d
                .pool
                .taken_bytes()
                .saturating_sub(shared_posted)
                .saturating_sub(posted);
        }
        m
    }
}

/// Probes the device (on a protection domain of its own, released after) and starts its
/// completion channel's pump.
fn probe(ctx: &Arc<DeviceContext>, device: &str) -> std::io::Result<DeviceEntry> {
    let info = crate::device::describe(device, ctx).map_err(std::io::Error::other)?;
    let pd = ctx.alloc_pd().map_err(std::io::Error::other)?;
    let caps = DeviceCaps::probe(device, ctx, &pd, &info)?;
    drop(pd);
    tracing::debug!(%caps, "verbs device probed");
    let siw_guard = crate::siw_keys::guard(ctx, &caps)?;
    Ok(DeviceEntry {
        caps: Arc::new(caps),
        siw_guard,
        cq_pump: CqPump::start(ctx, device)?,
        shared: None,
        private: Vec::new(),
    })
}

/// A protection domain with its pool and, where `paths` has one, shared receive queue.
fn new_domain(
    ctx: &Arc<DeviceContext>,
    device: &str,
    cfg: &VerbsConfig,
    paths: Paths,
    cq_pump: &Arc<CqPump>,
    siw_guard: Option<Arc<KeyGuard>>,
) -> std::io::Result<Arc<Domain>> {
    let pd = ctx.alloc_pd().map_err(std::io::Error::other)?;
    let pool = SharedPool::new(
        pd.clone(),
        device.to_owned(),
        cfg.pool_keep_bytes,
        cfg.registration_cache_bytes,
        paths.exposure == ExposurePath::MemoryWindow,
    );
    let srq = if paths.srq_depth > 0 {
        let pool = pool.for_connection(Arc::default());
        let size = cfg.recv_buf_size();
        let budget = crate::ffi::memlock_budget();
        let depth = srq_depth_within(paths.srq_depth, size, budget);
        let max = srq_depth_within(paths.srq_max_depth, size, budget).max(depth);
        if depth < paths.srq_depth || max < paths.srq_max_depth {
            tracing::warn!(
                device,
                configured = paths.srq_depth,
                configured_max = paths.srq_max_depth,
                depth,
                max,
                memlock_limit = crate::ffi::memlock_limit(),
                "shared receive queue made smaller to fit in half of RLIMIT_MEMLOCK; \
                 raise the limit (ulimit -l) for the configured depths"
            );
        }
        let fresh: crate::ffi::FreshBuf<PoolBuf> =
            Box::new(move || pool.get_recv(size).map_err(std::io::Error::other));
        Some(Srq::new(&pd, depth, max, size, fresh)?)
    } else {
        None
    };
    if let Some(srq) = &srq {
        // A device that cannot report the queue low still works: buffers then come back
        // only as each connection polls its CQ.
        if let Err(e) = cq_pump.watch(srq.clone()) {
            tracing::warn!(device, error = %e, "the shared receive queue's limit cannot be armed; it is not watched");
        }
    }
    Ok(Arc::new(Domain {
        pd,
        pool,
        srq,
        paths,
        cq_pump: cq_pump.clone(),
        own: AtomicUsize::new(0),
        posted: AtomicUsize::new(0),
        connections: AtomicUsize::new(0),
        _siw_guard: siw_guard,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shared_queue_fits_in_half_of_the_locked_memory_limit() {
        let size = 64 << 10;
        // Unlimited (or CAP_IPC_LOCK): as configured.
        assert_eq!(srq_depth_within(128, size, None), 128);
        // 8 MiB, a common default: 4 MiB for the queue, 64 buffers.
        assert_eq!(srq_depth_within(128, size, Some(8 << 20)), 64);
        // Room for more than configured: as configured.
        assert_eq!(srq_depth_within(128, size, Some(1 << 30)), 128);
        // A tiny limit: the least depth allowed (its registration then fails, typed).
        assert_eq!(srq_depth_within(128, size, Some(64 << 10)), MIN_SRQ_DEPTH);
        assert_eq!(srq_depth_within(128, 0, Some(8 << 20)), 128);
    }
}
