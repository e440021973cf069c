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
        "registering {len} bytes with RDMA device `{device}` failed ({source}); \
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
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The configuration cannot work.
    #[error("invalid verbs configuration: {0}")]
    Config(&'static str),
    /// A setting read from the environment is invalid (its variable and what is wrong).
    #[error("invalid verbs setting: {0}")]
    Setting(String),
    /// Connection setup through rdma_cm failed.
    #[error("rdma_cm {op} failed for {addr}: {source}")]
    Cm {
        /// The step ("resolve address", "connect", "accept", ...).
        op: &'static str,
        /// The address involved.
        addr: String,
        /// What went wrong.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The binding panicked (for example on a value it does not know); caught at the boundary.
    #[error("the verbs binding failed unexpectedly: {0}")]
    Internal(String),
    /// The peer broke a rule of the verbs protocol; the connection was failed (see
    /// [`ProtocolViolation`]).
    #[error("the RDMA peer broke the verbs protocol: {0}")]
    Protocol(#[from] ProtocolViolation),
    /// A work request completed with an error: the queue pair is in the error state and the
    /// connection is failed.
    #[error(
        "{op} work request failed: {status} (ibv_wc_status {}, vendor error {vendor_err:#x}); \
         the queue pair entered the error state",
        status.raw()
    )]
    WorkCompletion {
        /// What the failed work request did.
        op: WorkRequestKind,
        /// Its completion status.
        status: WcStatus,
        /// The device's own error code.
        vendor_err: u32,
    },
    /// The RDMA device was removed while in use (`rdma link delete`, a hot-unplugged NIC, its
    /// driver unloaded): every connection and listener of the transport on it failed with
    /// this error, and the transport gave the device back (see the crate docs, "Device
    /// removal"). Its other devices, and the process's other transports, go on.
    #[error("RDMA device `{device}` was removed; its connections and listeners are closed")]
    DeviceRemoved {
        /// The device name.
        device: String,
    },
    /// The peer did not do something within its time limit; the connection was failed.
    #[error("{what} within {after:?}")]
    Timeout {
        /// What did not happen ("no HELLO from the RDMA peer", ...).
        what: &'static str,
        /// The limit (a [`crate::VerbsConfig`] setting).
        after: std::time::Duration,
    },
}

/// What a failed work request was doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorkRequestKind {
    /// A SEND (a message or a control message).
    Send,
    /// A posted receive buffer.
    Receive,
    /// An RDMA READ of a rendezvous payload.
    RdmaRead,
    /// Binding a memory window that exposes a rendezvous payload to the peer.
    BindWindow,
    /// Invalidating such a window after the peer's FIN.
    InvalidateWindow,
}

impl std::fmt::Display for WorkRequestKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WorkRequestKind::Send => "send",
            WorkRequestKind::Receive => "receive",
            WorkRequestKind::RdmaRead => "RDMA READ",
            WorkRequestKind::BindWindow => "memory window bind",
            WorkRequestKind::InvalidateWindow => "memory window invalidation",
        })
    }
}

/// The status of a failed work completion (`enum ibv_wc_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WcStatus {
    /// `IBV_WC_LOC_LEN_ERR`: a message longer than the receive buffer, or a local length error.
    LocalLength,
    /// `IBV_WC_LOC_QP_OP_ERR`: the work request was inconsistent with the queue pair.
    LocalQpOperation,
    /// `IBV_WC_LOC_EEC_OP_ERR`.
    LocalEecOperation,
    /// `IBV_WC_LOC_PROT_ERR`: a local key did not allow the access.
    LocalProtection,
    /// `IBV_WC_WR_FLUSH_ERR`: flushed because the queue pair is in the error state.
    Flushed,
    /// `IBV_WC_MW_BIND_ERR`: a memory window could not be bound.
    MemoryWindowBind,
    /// `IBV_WC_BAD_RESP_ERR`.
    BadResponse,
    /// `IBV_WC_LOC_ACCESS_ERR`.
    LocalAccess,
    /// `IBV_WC_REM_INV_REQ_ERR`: the peer found the request invalid.
    RemoteInvalidRequest,
    /// `IBV_WC_REM_ACCESS_ERR`: the peer's memory key did not allow the access (a stale or
    /// foreign rkey).
    RemoteAccess,
    /// `IBV_WC_REM_OP_ERR`: the peer could not complete the operation.
    RemoteOperation,
    /// `IBV_WC_RETRY_EXC_ERR`: no answer from the peer (unreachable or gone).
    RetryExceeded,
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: the peer had no receive buffer posted, for too long.
    RnrRetryExceeded,
    /// `IBV_WC_REM_ABORT_ERR`.
    RemoteAborted,
    /// `IBV_WC_FATAL_ERR`.
    Fatal,
    /// `IBV_WC_RESP_TIMEOUT_ERR`.
    ResponseTimeout,
    /// `IBV_WC_GENERAL_ERR`.
    General,
    /// Any other value.
    Other(u32),
}

impl WcStatus {
    /// The status of a raw `ibv_wc_status` value other than success.
    pub fn from_raw(raw: u32) -> WcStatus {
        match raw {
            1 => WcStatus::LocalLength,
            2 => WcStatus::LocalQpOperation,
            3 => WcStatus::LocalEecOperation,
            4 => WcStatus::LocalProtection,
            5 => WcStatus::Flushed,
            6 => WcStatus::MemoryWindowBind,
            7 => WcStatus::BadResponse,
            8 => WcStatus::LocalAccess,
            9 => WcStatus::RemoteInvalidRequest,
            10 => WcStatus::RemoteAccess,
            11 => WcStatus::RemoteOperation,
            12 => WcStatus::RetryExceeded,
            13 => WcStatus::RnrRetryExceeded,
            16 => WcStatus::RemoteAborted,
            19 => WcStatus::Fatal,
            20 => WcStatus::ResponseTimeout,
            21 => WcStatus::General,
            other => WcStatus::Other(other),
        }
    }

    /// Whether the work request failed on the peer's side or on the way to it (its memory key
    /// or queue pair refused or went away, or it stopped answering), or was flushed after
    /// such a failure put the queue pair in the error state, rather than through this side's
    /// own keys, lengths or queue pair. An RDMA READ that fails so while a message streams in
    /// has cut that message: a peer killed mid-transfer tears down its memory keys and its
    /// queue pair in an order the reader cannot choose, so its READ can end with any of these.
    pub fn is_peer_side(self) -> bool {
        matches!(
            self,
            WcStatus::Flushed
                | WcStatus::RemoteInvalidRequest
                | WcStatus::RemoteAccess
                | WcStatus::RemoteOperation
                | WcStatus::RetryExceeded
                | WcStatus::RnrRetryExceeded
                | WcStatus::RemoteAborted
                | WcStatus::ResponseTimeout
        )
    }

    /// The raw `ibv_wc_status` value.
    pub fn raw(self) -> u32 {
        match self {
            WcStatus::LocalLength => 1,
            WcStatus::LocalQpOperation => 2,
            WcStatus::LocalEecOperation => 3,
            WcStatus::LocalProtection => 4,
            WcStatus::Flushed => 5,
            WcStatus::MemoryWindowBind => 6,
            WcStatus::BadResponse => 7,
            WcStatus::LocalAccess => 8,
            WcStatus::RemoteInvalidRequest => 9,
            WcStatus::RemoteAccess => 10,
            WcStatus::RemoteOperation => 11,
            WcStatus::RetryExceeded => 12,
            WcStatus::RnrRetryExceeded => 13,
            WcStatus::RemoteAborted => 16,
            WcStatus::Fatal => 19,
            WcStatus::ResponseTimeout => 20,
            WcStatus::General => 21,
            WcStatus::Other(raw) => raw,
        }
    }
}

impl std::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WcStatus::LocalLength => "local length error",
            WcStatus::LocalQpOperation => "local QP operation error",
            WcStatus::LocalEecOperation => "local EEC operation error",
            WcStatus::LocalProtection => "local protection error",
            WcStatus::Flushed => "work request flushed (QP in error state)",
            WcStatus::MemoryWindowBind => "memory window bind error",
            WcStatus::BadResponse => "bad response",
            WcStatus::LocalAccess => "local access error",
            WcStatus::RemoteInvalidRequest => "remote invalid request",
            WcStatus::RemoteAccess => "remote access error",
            WcStatus::RemoteOperation => "remote operation error",
            WcStatus::RetryExceeded => "transport retry counter exceeded (peer unreachable)",
            WcStatus::RnrRetryExceeded => "RNR retry counter exceeded",
            WcStatus::RemoteAborted => "remote aborted",
            WcStatus::Fatal => "fatal error",
            WcStatus::ResponseTimeout => "response timeout",
            WcStatus::General => "general error",
            WcStatus::Other(_) => "work completion error",
        })
    }
}

/// A rule of the verbs protocol that the peer broke. Each one fails the connection (every
/// pending and later call gets [`VerbsError::Protocol`]) before it changes any state: nothing the
/// peer announces is allocated, read or trusted without these checks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolViolation {
    /// A message shorter than the transport header.
    #[error("a message of {len} bytes, shorter than the 32-byte transport header")]
    ShortMessage {
        /// Bytes received.
        len: usize,
    },
    /// An unknown message kind.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// A message-header length above the maximum or beyond the bytes received.
    #[error("message header length {hlen} is above 64 or beyond the {len} bytes received")]
    HeaderLength {
        /// The announced header length.
        hlen: u8,
        /// Bytes received.
        len: usize,
    },
    /// An eager message whose payload length differs from its header's.
    #[error("an eager message announces {announced} payload bytes but carries {carried}")]
    EagerLength {
        /// Announced in the header.
        announced: u64,
        /// Actually received.
        carried: u64,
    },
    /// A HELLO with another protocol version.
    #[error("protocol version {got} from the peer, this side speaks {want}")]
    Version {
        /// The peer's version.
        got: u64,
        /// Ours.
        want: u64,
    },
    /// A HELLO announcing a receive buffer size outside the accepted range (a tiny one would
    /// force every message into rendezvous).
    #[error(
        "the peer's HELLO announces receive buffers of {size} bytes (accepted: {min}..={max})"
    )]
    PeerBufferSize {
        /// Announced.
        size: u64,
        /// Smallest accepted.
        min: u64,
        /// Largest accepted.
        max: u64,
    },
    /// A HELLO announcing a receive queue depth outside the accepted range.
    #[error("the peer's HELLO announces {depth} receive buffers (accepted: {min}..={max})")]
    PeerDepth {
        /// Announced.
        depth: u32,
        /// Smallest accepted.
        min: u32,
        /// Largest accepted.
        max: u32,
    },
    /// A HELLO announcing rendezvous limits of zero or beyond the accepted range.
    #[error(
        "the peer's HELLO announces rendezvous limits of {count} transfers and {kib} KiB \
         (accepted: 1..={max_count} transfers, at least 1 KiB)"
    )]
    PeerRendezvousLimits {
        /// Announced transfers.
        count: u32,
        /// Announced KiB.
        kib: u32,
        /// Largest accepted count.
        max_count: u32,
    },
    /// A HELLO announcing that the peer serves no RDMA READ, or more than a queue pair can.
    #[error("the peer's HELLO announces {reads} RDMA READs served at once (accepted: 1..={max})")]
    PeerReadDepth {
        /// Announced READs.
        reads: u32,
        /// Largest accepted.
        max: u32,
    },
    /// Anything but a HELLO as the peer's first message.
    #[error("a {kind} message before the peer's HELLO")]
    BeforeHello {
        /// The message kind.
        kind: &'static str,
    },
    /// A second HELLO.
    #[error("a second HELLO")]
    DuplicateHello,
    /// Credits granted beyond the receive buffers the peer announced.
    #[error(
        "the peer grants {granted} credits while this side holds {held}: more than its \
         {depth} receive buffers"
    )]
    CreditOverflow {
        /// Credits held before the grant.
        held: u32,
        /// Credits granted by the message.
        granted: u16,
        /// The peer's announced receive queue depth.
        depth: u32,
    },
    /// A message sent without a credit (into a buffer this side had not granted).
    #[error("a message sent without a credit")]
    NoCredit,
    /// A rendezvous whose address range wraps around the address space.
    #[error("a rendezvous of {len} bytes at address {addr:#x} wraps around the address space")]
    AddressWraps {
        /// Announced address.
        addr: u64,
        /// Announced length.
        len: u64,
    },
    /// A rendezvous of zero bytes (a sender uses an eager message for that).
    #[error("a rendezvous of zero bytes")]
    EmptyRendezvous,
    /// A rendezvous id that is already outstanding.
    #[error("rendezvous id {0} is already outstanding")]
    DuplicateRendezvous(u32),
    /// A rendezvous beyond the limits this side announced in its HELLO.
    #[error(
        "a rendezvous of {len} bytes with {outstanding} outstanding ({bytes} bytes) exceeds the \
         announced limit of {max_count} transfers and {max_bytes} bytes"
    )]
    RendezvousLimit {
        /// Announced length of the new one.
        len: u64,
        /// Transfers outstanding before it.
        outstanding: u32,
        /// Their bytes.
        bytes: u64,
        /// The announced count limit.
        max_count: u32,
        /// The announced byte limit.
        max_bytes: u64,
    },
    /// A FIN for a rendezvous id that is not outstanding.
    #[error("a FIN for rendezvous id {0}, which is not outstanding")]
    UnknownFin(u32),
    /// A message after the peer's CLOSE.
    #[error("a {kind} message after the peer's CLOSE")]
    AfterClose {
        /// The message kind.
        kind: &'static str,
    },
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
    /// Keeps the typed error: `e.backend_error::<VerbsError>()` gets it back.
    fn from(e: VerbsError) -> Self {
        transport_core::TransportError::backend(e)
    }
}

/// Linux errno values (the crate targets Linux; rdma-core exists nowhere else).
const ENOSYS: i32 = 38;
const EOPNOTSUPP: i32 = 95;

#[cfg(test)]
mod tests {
    use super::*;

    /// A READ cut by the peer's side (its keys or queue pair gone, no answer, or the flush
    /// after that) is told apart from one this side's own work request caused.
    #[test]
    fn peer_side_failures_are_told_from_local_ones() {
        for s in [
            WcStatus::Flushed,
            WcStatus::RemoteInvalidRequest,
            WcStatus::RemoteAccess,
            WcStatus::RemoteOperation,
            WcStatus::RetryExceeded,
            WcStatus::RnrRetryExceeded,
            WcStatus::RemoteAborted,
            WcStatus::ResponseTimeout,
        ] {
            assert!(s.is_peer_side(), "{s:?}");
            assert!(
                WcStatus::from_raw(s.raw()).is_peer_side(),
                "{s:?} through its raw value"
            );
        }
        for s in [
            WcStatus::LocalLength,
            WcStatus::LocalQpOperation,
            WcStatus::LocalProtection,
            WcStatus::LocalAccess,
            WcStatus::MemoryWindowBind,
            WcStatus::BadResponse,
            WcStatus::Fatal,
            WcStatus::General,
            WcStatus::Other(99),
        ] {
            assert!(!s.is_peer_side(), "{s:?}");
        }
    }

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
