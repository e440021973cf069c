//! The registered buffer pool and the registration cache.
//!
//! - Buffers are registered once, when the pool grows, and recycled: a [`PoolBuf`] goes back to
//!   its size class when dropped (when the last `Bytes` view of a payload built on it is dropped).
//!   The pool keeps up to [`crate::VerbsConfig::pool_keep_bytes`] of idle buffers; beyond that an
//!   idle buffer is deregistered and freed.
//! - Every live buffer is in an address registry, so a payload `Bytes` that points into one (a
//!   send buffer from [`transport_core::MessageSender::buffer_pool`], or a received payload sent
//!   on) is recognised and sent without a copy and without a registration.
//! - User `Bytes` above the rendezvous threshold are registered through a small LRU cache that
//!   holds the `Bytes` (so the memory cannot be freed and reused while its registration lives).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use transport_core::{BackendRegion, BufferPool, Metrics, SendBuffer};

use crate::error::VerbsError;
use crate::ffi::{
    memlock_limit, Access, HeldBytes, LocalMemory, MrHandle, OwnedRegion, UserRegion,
};

/// Size class of a buffer able to hold `n` bytes: powers of two from 4 KiB to 1 MiB, then
/// multiples of 1 MiB.
pub(crate) fn class_of(n: usize) -> usize {
    const MIB: usize = 1 << 20;
    if n <= 4096 {
        4096
    } else if n <= MIB {
        n.next_power_of_two()
    } else {
        n.div_ceil(MIB) * MIB
    }
}

pub(crate) struct PoolInner {
    pd: Arc<ProtectionDomain>,
    device: String,
    keep_bytes: usize,
    /// Payloads are exposed through memory windows (send buffers registered for binding);
    /// else through registrations of their own.
    windows: bool,
    /// Bytes of pool buffers registered right now (in use or idle).
    registered: AtomicUsize,
    state: Mutex<PoolState>,
    cache: Mutex<RegCache>,
}

#[derive(Default)]
struct PoolState {
    /// Idle buffers by (size, access).
    free: HashMap<(usize, Access), Vec<OwnedRegion>>,
    idle_bytes: usize,
    /// start address -> (len, registration, access) of every live pool buffer.
    registry: BTreeMap<usize, (usize, MrHandle, Access)>,
}

struct RegCache {
    capacity: usize,
    bytes: usize,
    entries: VecDeque<Arc<UserRegion>>,
}

/// The registered buffers and the registration cache of one device's protection domain,
/// shared by every connection of a transport on that device (see `domain.rs`).
#[derive(Clone)]
pub(crate) struct SharedPool {
    inner: Arc<PoolInner>,
}

impl SharedPool {
    pub(crate) fn new(
        pd: Arc<ProtectionDomain>,
        device: String,
        keep_bytes: usize,
        cache_bytes: usize,
        windows: bool,
    ) -> SharedPool {
        SharedPool {
            inner: Arc::new(PoolInner {
                pd,
                device,
                keep_bytes,
                windows,
                registered: AtomicUsize::new(0),
                state: Mutex::new(PoolState::default()),
                cache: Mutex::new(RegCache {
                    capacity: cache_bytes,
                    bytes: 0,
                    entries: VecDeque::new(),
                }),
            }),
        }
    }

    /// One connection's handle on the pool: what it registers is counted in its `metrics`.
    pub(crate) fn for_connection(&self, metrics: Arc<Metrics>) -> Pool {
        Pool {
            inner: self.inner.clone(),
            metrics,
        }
    }

    /// Bytes registered right now: pool buffers (in use or idle) and cached user memory.
    pub(crate) fn registered_bytes(&self) -> usize {
        let cached = self.inner.cache.lock().map(|c| c.bytes).unwrap_or(0);
        self.inner.registered.load(Ordering::Relaxed) + cached
    }

    /// Bytes of pool buffers taken from the pool and not returned, right now: registered
    /// and not idle (posted receive buffers among them; the domain tells those apart). The
    /// two counters are read one after the other while buffers come and go, so a reading
    /// taken during a change may be off by that buffer; it never goes below 0.
    pub(crate) fn taken_bytes(&self) -> usize {
        let idle = self.inner.state.lock().map(|s| s.idle_bytes).unwrap_or(0);
        self.inner
            .registered
            .load(Ordering::Relaxed)
            .saturating_sub(idle)
    }
}

/// One connection's handle on its device's [`SharedPool`].
#[derive(Clone)]
pub(crate) struct Pool {
    inner: Arc<PoolInner>,
    metrics: Arc<Metrics>,
}

impl Pool {
    /// A buffer of exactly `size` bytes for `access`, from the free list or newly registered.
    fn get(&self, size: usize, access: Access) -> Result<PoolBuf, VerbsError> {
        {
            let mut st = self.inner.state.lock().expect("pool lock");
            if let Some(region) = st.free.get_mut(&(size, access)).and_then(Vec::pop) {
                st.idle_bytes -= size;
                return Ok(PoolBuf {
                    region: Some(region),
                    pool: self.inner.clone(),
                });
            }
        }
        let region = OwnedRegion::new(&self.inner.pd, size, access)
            .map_err(|e| registration_error(&self.inner.device, size, e))?;
        self.metrics.registrations.incr();
        self.inner.registered.fetch_add(size, Ordering::Relaxed);
        {
            let mut st = self.inner.state.lock().expect("pool lock");
            st.registry
                .insert(region.addr(), (size, region.handle(), access));
        }
        Ok(PoolBuf {
            region: Some(region),
            pool: self.inner.clone(),
        })
    }

    /// A receive buffer of exactly `size` bytes: written by the device, never exposed.
    pub(crate) fn get_recv(&self, size: usize) -> Result<PoolBuf, VerbsError> {
        self.get(size, Access::LocalWrite)
    }

    /// A buffer for at least `n` bytes, of `n`'s size class, that may be sent from or exposed
    /// to the peer by a memory window (send buffers, rendezvous targets).
    pub(crate) fn get_for(&self, n: usize) -> Result<PoolBuf, VerbsError> {
        let access = if self.inner.windows {
            Access::Exposable
        } else {
            Access::Sendable
        };
        self.get(class_of(n), access)
    }

    /// The registration covering `bytes`, if it lies inside a live pool buffer (no copy, no
    /// registration needed to send it eagerly; see [`HeldBytes::exposable`] for rendezvous).
    pub(crate) fn lookup(&self, bytes: &Bytes) -> Option<HeldBytes> {
        let start = bytes.as_ptr() as usize;
        let st = self.inner.state.lock().expect("pool lock");
        let (&base, &(len, mr, access)) = st.registry.range(..=start).next_back()?;
        let end = start.checked_add(bytes.len())?;
        if end <= base + len {
            // SAFETY: `bytes` lies inside the live pool buffer at `base`, registered as `mr`
            // for `access`. That buffer is in the registry, so it is alive; memory inside it can
            // only be reached through views of it, so `bytes` keeps the buffer (and its
            // registration, dropped only with the buffer) alive as long as the `HeldBytes` lives.
            Some(unsafe { HeldBytes::in_buffer(bytes.clone(), mr, access) })
        } else {
            None
        }
    }

    /// `bytes` with a registration a memory window can expose: an exposable pool buffer, a
    /// cached user registration, or a new one (counted, and cached).
    pub(crate) fn register(&self, bytes: &Bytes) -> Result<HeldBytes, VerbsError> {
        if let Some(h) = self.lookup(bytes).filter(HeldBytes::exposable) {
            return Ok(h);
        }
        let start = bytes.as_ptr() as usize;
        let end = start + bytes.len();
        let mut cache = self.inner.cache.lock().expect("cache lock");
        if let Some(pos) = cache
            .entries
            .iter()
            .position(|r| r.start() <= start && end <= r.start() + r.len())
        {
            let reg = cache.entries.remove(pos).expect("position is valid");
            cache.entries.push_back(reg.clone());
            if let Some(h) = HeldBytes::in_user_region(bytes.clone(), reg) {
                return Ok(h);
            }
        }
        let reg = Arc::new(
            UserRegion::new(&self.inner.pd, bytes.clone(), self.inner.windows)
                .map_err(|e| registration_error(&self.inner.device, bytes.len(), e))?,
        );
        self.metrics.registrations.incr();
        if reg.len() <= cache.capacity {
            cache.bytes += reg.len();
            cache.entries.push_back(reg.clone());
            while cache.bytes > cache.capacity {
                let old = cache.entries.pop_front().expect("non-empty");
                cache.bytes -= old.len();
            }
        }
        HeldBytes::in_user_region(bytes.clone(), reg).ok_or(VerbsError::Internal(
            "a registration does not cover its bytes".into(),
        ))
    }

    /// The `BufferPool` handed to users: send buffers in registered memory.
    pub(crate) fn buffer_pool(&self) -> Arc<dyn BufferPool> {
        Arc::new(VerbsBufferPool { pool: self.clone() })
    }
}

pub(crate) fn registration_error(
    device: &str,
    len: usize,
    e: sideway::ibverbs::memory_region::RegisterMemoryRegionError,
) -> VerbsError {
    use sideway::ibverbs::memory_region::RegisterMemoryRegionErrorKind as Kind;
    let limit = memlock_limit();
    match e.0 {
        // ENOMEM from ibv_reg_mr is the locked-memory limit (or the machine's memory); any
        // failure under a limit is reported with it.
        Kind::Ibverbs(io) if io.raw_os_error() == Some(12) || limit.is_some() => {
            VerbsError::Registration {
                device: device.to_owned(),
                len,
                memlock_limit: limit,
                source: Box::new(io),
            }
        }
        other => VerbsError::verbs(
            "ibv_reg_mr",
            device,
            sideway::ibverbs::memory_region::RegisterMemoryRegionError::from(other),
        ),
    }
}

/// A registered buffer of the pool; returns to its size class when dropped.
pub(crate) struct PoolBuf {
    region: Option<OwnedRegion>,
    pool: Arc<PoolInner>,
}

impl PoolBuf {
    fn region(&self) -> &OwnedRegion {
        self.region.as_ref().expect("present until drop")
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        self.region().bytes()
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        self.region
            .as_mut()
            .expect("present until drop")
            .bytes_mut()
    }
}

// SAFETY: the region is registered (local write for every `Access` a `PoolBuf` is made with:
// receive buffers and exposable buffers) and its heap memory does not move; it is freed only
// after the `PoolBuf` is gone (returned to the free list, or deregistered then freed).
unsafe impl LocalMemory for PoolBuf {
    fn addr(&self) -> usize {
        self.region().addr()
    }
    fn len(&self) -> usize {
        self.region().bytes().len()
    }
    fn lkey(&self) -> u32 {
        self.region().lkey()
    }
}

impl AsRef<[u8]> for PoolBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl BackendRegion for PoolBuf {
    fn as_slice(&self) -> &[u8] {
        PoolBuf::as_slice(self)
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        PoolBuf::as_mut_slice(self)
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        let Some(region) = self.region.take() else {
            return;
        };
        let size = region.bytes().len();
        let Ok(mut st) = self.pool.state.lock() else {
            return;
        };
        if st.idle_bytes + size <= self.pool.keep_bytes {
            st.idle_bytes += size;
            st.free
                .entry((size, region.access()))
                .or_default()
                .push(region);
        } else {
            st.registry.remove(&region.addr());
            drop(st);
            drop(region); // deregistered, then freed
            self.pool.registered.fetch_sub(size, Ordering::Relaxed);
        }
    }
}

struct VerbsBufferPool {
    pool: Pool,
}

impl BufferPool for VerbsBufferPool {
    fn alloc(&self, capacity: usize) -> SendBuffer {
        match self.pool.get_for(capacity) {
            Ok(buf) => SendBuffer::from_region(Box::new(buf)),
            // Registration failed (memlock?): plain memory still works, at the cost of a copy
            // or a cached registration when sent.
            Err(_) => SendBuffer::heap(capacity),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::class_of;

    #[test]
    fn size_classes() {
        assert_eq!(class_of(0), 4096);
        assert_eq!(class_of(4097), 8192);
        assert_eq!(class_of(65536), 65536);
        assert_eq!(class_of(1 << 20), 1 << 20);
        assert_eq!(class_of((1 << 20) + 1), 2 << 20);
        assert_eq!(class_of(96 << 20), 96 << 20);
    }
}
