//! The crate's error type.

use std::io;

/// Text shared by the two "nothing to talk to" errors, so a user sees one clear message.
#[cfg(test)]
pub(crate) const NO_DEVICE_HINT: &str = "no RDMA device found; see README for soft-RoCE";

/// Errors of the verbs backend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// libibverbs is present but the kernel has no RDMA device (or no RDMA support at all:
    /// `ibv_get_device_list` fails with `ENOSYS`, or returns an empty list).
    #[error("no RDMA device found; see README for soft-RoCE (the kernel exposes no verbs device)")]
    NoDevice,
    /// rdma-core's libibverbs could not be loaded (`EOPNOTSUPP` from the run-time loader).
    #[error(
        "no RDMA device found; see README for soft-RoCE (rdma-core / libibverbs is not installed)"
    )]
    RdmaCoreMissing,
    /// No device of that name.
    #[error("no RDMA device named `{0}`")]
    DeviceNotFound(String),
    /// A verbs call failed.
    #[error("{op} failed on RDMA device `{device}`: {source}")]
    Verbs {
        /// The operation, e.g. "ibv_open_device".
        op: &'static str,
        /// The device name.
        device: String,
        /// The underlying error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Listing the devices failed for another reason than "none" or "no rdma-core".
    #[error("listing RDMA devices failed: {0}")]
    DeviceList(#[source] io::Error),
    /// Registering memory with the device failed, typically because the locked-memory limit
    /// (`RLIMIT_MEMLOCK`) is too low.
    #[error(
        "registering {len} bytes with RDMA device `{device}` failed ({reason}); \
         locked-memory limit RLIMIT_MEMLOCK is {}: raise it (`ulimit -l unlimited`, or memlock \
         in /etc/security/limits.conf / LimitMEMLOCK= for systemd services)",
        match memlock_limit { Some(b) => format!("{b} bytes"), None => "unlimited".to_owned() }
    )]
    Registration {
        /// The device name.
        device: String,
        /// Bytes that were being registered.
        len: usize,
        /// The soft `RLIMIT_MEMLOCK` at the time, `None` for unlimited.
        memlock_limit: Option<u64>,
        /// What the device said.
        reason: String,
    },
    /// The configuration cannot work.
    #[error("invalid verbs configuration: {0}")]
    Config(&'static str),
    /// Connection setup through rdma_cm failed.
    #[error("rdma_cm {op} failed for {addr}: {reason}")]
    Cm {
        /// The step ("resolve address", "connect", "accept", ...).
        op: &'static str,
        /// The address involved.
        addr: String,
        /// What went wrong.
        reason: String,
    },
    /// The binding panicked (for example on a value it does not know); caught at the boundary.
    #[error("the verbs binding failed unexpectedly: {0}")]
    Internal(String),
}

impl VerbsError {
    /// True for [`VerbsError::NoDevice`] and [`VerbsError::RdmaCoreMissing`]: nothing to run on.
    pub fn is_no_device(&self) -> bool {
        matches!(self, VerbsError::NoDevice | VerbsError::RdmaCoreMissing)
    }

    /// Classifies the error of `ibv_get_device_list`: `ENOSYS` means no device (no kernel
    /// support), `EOPNOTSUPP` means the libraries could not be loaded.
    pub(crate) fn from_device_list_error(err: io::Error) -> Self {
        match err.raw_os_error() {
            Some(code) if code == ENOSYS => VerbsError::NoDevice,
            Some(code) if code == EOPNOTSUPP => VerbsError::RdmaCoreMissing,
            _ => VerbsError::DeviceList(err),
        }
    }

    pub(crate) fn verbs(
        op: &'static str,
        device: &str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        VerbsError::Verbs {
            op,
            device: device.to_owned(),
            source: Box::new(source),
        }
    }
}

impl From<VerbsError> for transport_core::TransportError {
    fn from(e: VerbsError) -> Self {
        transport_core::TransportError::Backend(e.to_string())
    }
}

/// Linux errno values (the crate targets Linux; rdma-core exists nowhere else).
const ENOSYS: i32 = 38;
const EOPNOTSUPP: i32 = 95;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enosys_means_no_device_and_eopnotsupp_means_no_rdma_core() {
        let e = VerbsError::from_device_list_error(io::Error::from_raw_os_error(ENOSYS));
        assert!(matches!(e, VerbsError::NoDevice));
        assert!(e.to_string().starts_with(NO_DEVICE_HINT));
        let e = VerbsError::from_device_list_error(io::Error::from_raw_os_error(EOPNOTSUPP));
        assert!(matches!(e, VerbsError::RdmaCoreMissing));
        assert!(e.to_string().starts_with(NO_DEVICE_HINT));
        assert!(e.is_no_device());
        let e = VerbsError::from_device_list_error(io::Error::from_raw_os_error(13));
        assert!(matches!(e, VerbsError::DeviceList(_)));
        assert!(!e.is_no_device());
    }
}
