//! Resources that belong to a device, not to a connection (libfabric's domain, UCX's worker):
//! one protection domain per device per transport, with its registered buffer pool and
//! registration cache, shared by every connection of the transport (and its clones) on that
//! device. Memory that was per connection (up to `pool_keep_bytes` of idle buffers and
//! `registration_cache_bytes` of cached registrations each) is now per device.
//!
//! Isolation between the connections of one domain does not rest on the protection domain:
//! no memory region grants remote access (local access and window binding only), and a
//! payload is exposed only through a type-2 memory window bound to its own connection's queue
//! pair and invalidated after its FIN (see the crate docs' security model).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use crate::config::VerbsConfig;
use crate::cq_pump::CqPump;
use crate::ffi::Srq;
use crate::pool::{PoolBuf, SharedPool};

/// One device's shared resources.
pub(crate) struct Domain {
    pub(crate) pd: Arc<ProtectionDomain>,
    pub(crate) pool: SharedPool,
    /// The shared receive queue of the transport's connections on this device (`srq_depth`
    /// buffers of `recv_buf_size()` from the pool), if configured.
    pub(crate) srq: Option<Arc<Srq<PoolBuf>>>,
    /// RDMA READs a queue pair keeps outstanding and serves at once: `read_depth` within the
    /// device's limits.
    pub(crate) read_depth: u8,
    /// The completion channel of every connection's CQ on this device, and its pump.
    pub(crate) cq_pump: Arc<CqPump>,
    /// Bytes registered by connections for themselves (their send slots), right now.
    own: Arc<AtomicUsize>,
    /// Bytes of pool buffers posted as receive buffers by connections, right now.
    posted: Arc<AtomicUsize>,
    /// Connections on this domain right now.
    connections: Arc<AtomicUsize>,
}

impl Domain {
    /// Counts a connection, `own` bytes it registered for itself and `posted` bytes of pool
    /// buffers it keeps posted for receiving, until the returned guard drops (with the
    /// connection's endpoint).
    pub(crate) fn join(&self, own: usize, posted: usize) -> Member {
        self.own.fetch_add(own, Ordering::Relaxed);
        self.posted.fetch_add(posted, Ordering::Relaxed);
        self.connections.fetch_add(1, Ordering::Relaxed);
        Member {
            own_bytes: own,
            posted_bytes: posted,
            own: self.own.clone(),
            posted: self.posted.clone(),
            connections: self.connections.clone(),
        }
    }
}

/// A connection's membership of its domain (see [`Domain::join`]).
pub(crate) struct Member {
    own_bytes: usize,
    posted_bytes: usize,
    own: Arc<AtomicUsize>,
    posted: Arc<AtomicUsize>,
    connections: Arc<AtomicUsize>,
}

impl Drop for Member {
    fn drop(&mut self) {
        self.own.fetch_sub(self.own_bytes, Ordering::Relaxed);
        self.posted.fetch_sub(self.posted_bytes, Ordering::Relaxed);
        self.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The domains of one transport, by device context.
#[derive(Default)]
pub(crate) struct Domains {
    by_context: Mutex<HashMap<usize, Arc<Domain>>>,
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
    /// receive queue (`srq_depth` 0), their posted receive buffers (`recv_depth` ×
    /// `recv_buf_size()`).
    pub per_connection_bytes: usize,
    /// The part of `registered_bytes` posted to the devices' shared receive queues right now
    /// (`srq_depth` × `recv_buf_size()` per device once its first connection was made), shared
    /// by every connection: it does not grow with the number of connections.
    pub shared_receive_bytes: usize,
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
    /// The domain of `ctx`'s device, made on first use (`device` names it in errors).
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
        if let Some(d) = map.get(&key) {
            return Ok(d.clone());
        }
        let pd = ctx.alloc_pd().map_err(std::io::Error::other)?;
        let pool = SharedPool::new(
            pd.clone(),
            device.to_owned(),
            cfg.pool_keep_bytes,
            cfg.registration_cache_bytes,
        );
        let srq = if cfg.srq_depth > 0 {
            let pool = pool.for_connection(Arc::default());
            let size = cfg.recv_buf_size();
            let depth = srq_depth_within(cfg.srq_depth, size, crate::ffi::memlock_budget());
            if depth < cfg.srq_depth {
                tracing::warn!(
                    device,
                    configured = cfg.srq_depth,
                    depth,
                    memlock_limit = crate::ffi::memlock_limit(),
                    "shared receive queue made smaller to fit in half of RLIMIT_MEMLOCK; \
                     raise the limit (ulimit -l) for the configured depth"
                );
            }
            let fresh: crate::ffi::FreshBuf<PoolBuf> =
                Box::new(move || pool.get_recv(size).map_err(std::io::Error::other));
            Some(Srq::new(&pd, depth, size, fresh)?)
        } else {
            None
        };
        let attr = ctx.query_device().map_err(std::io::Error::other)?;
        let device_reads = attr.max_qp_rd_atom().min(attr.max_qp_init_rd_atom());
        let read_depth = cfg
            .read_depth
            .min(usize::try_from(device_reads).unwrap_or(1))
            .clamp(1, 255) as u8;
        let cq_pump = CqPump::start(ctx, device)?;
        if let Some(srq) = &srq {
            // A device that cannot report the queue low still works: buffers then come back
            // only as each connection polls its CQ.
            if let Err(e) = cq_pump.watch(srq.clone()) {
                tracing::warn!(device, error = %e, "the shared receive queue's limit cannot be armed; it is not watched");
            }
        }
        let d = Arc::new(Domain {
            pd,
            pool,
            srq,
            read_depth,
            cq_pump,
            own: Arc::default(),
            posted: Arc::default(),
            connections: Arc::default(),
        });
        map.insert(key, d.clone());
        Ok(d)
    }

    /// Memory and connections across every domain of the transport.
    pub(crate) fn memory_use(&self) -> MemoryUse {
        let map = self.by_context.lock().unwrap_or_else(|p| p.into_inner());
        let mut m = MemoryUse::default();
        for d in map.values() {
            let own = d.own.load(Ordering::Relaxed);
            m.connections += d.connections.load(Ordering::Relaxed);
            m.per_connection_bytes += own + d.posted.load(Ordering::Relaxed);
            m.registered_bytes += own + d.pool.registered_bytes();
            m.shared_receive_bytes += d.srq.as_ref().map_or(0, |s| s.posted_bytes());
        }
        m
    }
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
