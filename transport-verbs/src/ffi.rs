//! The crate's only `unsafe` code: the calls into the verbs binding that the compiler cannot check.
//!
//! Everything here is small and commented; the rest of the crate is safe Rust.

use std::sync::Arc;

use sideway::ibverbs::memory_region::{MemoryRegion, RegisterMemoryRegionError};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::AccessFlags;

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

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buf
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}
