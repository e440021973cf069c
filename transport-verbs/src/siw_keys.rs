//! A guard against soft-iWARP's mmap key collision.
//!
//! siw maps each user queue (send, receive, completion) into the process at an offset the
//! kernel allocates per device context (`rdma_user_mmap_entry_insert`, the lowest free range of
//! pages), and hands the offset back as the queue's key. Its user-space provider treats the key
//! `0x90000` (`SIW_INVAL_UOBJ_KEY`, an old object-id limit) as "no mapping": the queue that the
//! kernel places at page 144 fails to be created (`libsiw: prepare CQ mapping failed`,
//! `ibv_create_cq` or `ibv_create_qp` returns `EAGAIN`), and so does every queue after it,
//! since the next lowest free range starts at page 144 again. With a few pages per queue, a
//! process could open only about a dozen connections.
//!
//! The guard is one completion queue of [`GUARD_CQE`] entries (1 MiB, 257 pages), created on a
//! siw device context before the transport's first connection and kept while any transport or
//! connection of the process uses that context: it covers page 144, so no queue starts there.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};

use sideway::ibverbs::completion::BasicCompletionQueue;
use sideway::ibverbs::device_context::DeviceContext;

use crate::caps::{DeviceCaps, SIW_VENDOR_ID};

/// Entries of the guard queue: 32 bytes each, so its mapping spans 257 pages and covers page
/// 144 wherever below it the context's lowest free range starts.
pub(crate) const GUARD_CQE: u32 = 32 * 1024;

/// A completion queue held only for the pages it occupies in the context's mmap offsets.
pub(crate) struct KeyGuard {
    _cq: Arc<BasicCompletionQueue>,
}

impl std::fmt::Debug for KeyGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyGuard")
    }
}

/// The guards alive, by device context (rdma_cm opens a device once per process).
static GUARDS: Mutex<BTreeMap<usize, Weak<KeyGuard>>> = Mutex::new(BTreeMap::new());

/// The guard of `ctx` on a siw device (made on first call, shared while anyone holds it);
/// `None` on other devices.
pub(crate) fn guard(
    ctx: &Arc<DeviceContext>,
    caps: &DeviceCaps,
) -> std::io::Result<Option<Arc<KeyGuard>>> {
    if caps.vendor_id != SIW_VENDOR_ID {
        return Ok(None);
    }
    let key = Arc::as_ptr(ctx) as usize;
    let mut map = GUARDS.lock().unwrap_or_else(|p| p.into_inner());
    map.retain(|_, w| w.strong_count() > 0);
    if let Some(g) = map.get(&key).and_then(Weak::upgrade) {
        return Ok(Some(g));
    }
    let cq = ctx
        .create_cq_builder()
        .setup_cqe(GUARD_CQE)
        .build()
        .map_err(|e| std::io::Error::other(format!("siw mmap key guard (ibv_create_cq): {e}")))?;
    let g = Arc::new(KeyGuard { _cq: cq });
    map.insert(key, Arc::downgrade(&g));
    Ok(Some(g))
}
