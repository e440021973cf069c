//! RDMA device discovery: list devices with their ports and GID tables, open one, allocate a
//! protection domain and register memory.
//!
//! ```no_run
//! match transport_verbs::list_devices() {
//!     Ok(devices) => {
//!         for d in &devices {
//!             println!("{}: {} port(s), RoCE v2 IPv4 GID index {:?}",
//!                 d.name, d.ports.len(), d.roce_v2_ipv4_gid().map(|g| g.index));
//!         }
//!     }
//!     // "no RDMA device found; see README for soft-RoCE (...)"
//!     Err(e) if e.is_no_device() => eprintln!("{e}"),
//!     Err(e) => eprintln!("verbs error: {e}"),
//! }
//! ```
//!
//! The binding can panic on values it does not know (port speed, MTU, GID type...). Every public
//! function here catches that at the boundary and returns [`VerbsError::Internal`] instead, and
//! reads port and GID attributes from their raw values so an odd answer never crashes a caller.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use sideway::ibverbs::device::{DeviceInfo as _, DeviceList, GetDeviceListErrorKind};
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::protection_domain::ProtectionDomain as RawPd;

use crate::error::VerbsError;
use crate::ffi::{Access, OwnedRegion};

/// Logical state of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    /// Reserved value.
    Nop,
    /// Link down.
    Down,
    /// Link up, not yet configured.
    Init,
    /// Configured, not yet active.
    Armed,
    /// Ready for traffic.
    Active,
    /// Was active; physical link lost, may recover.
    ActiveDefer,
    /// A value this crate does not know.
    Unknown(u32),
}

impl PortState {
    fn from_raw(raw: u32) -> Self {
        match raw {
            0 => PortState::Nop,
            1 => PortState::Down,
            2 => PortState::Init,
            3 => PortState::Armed,
            4 => PortState::Active,
            5 => PortState::ActiveDefer,
            other => PortState::Unknown(other),
        }
    }
}

/// Link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// Not reported (older InfiniBand drivers).
    Unspecified,
    /// Native InfiniBand.
    InfiniBand,
    /// Ethernet: RoCE (including soft-RoCE, `rdma_rxe`).
    Ethernet,
    /// A value this crate does not know.
    Unknown(u8),
}

impl LinkLayer {
    fn from_raw(raw: u8) -> Self {
        match raw {
            0 => LinkLayer::Unspecified,
            1 => LinkLayer::InfiniBand,
            2 => LinkLayer::Ethernet,
            other => LinkLayer::Unknown(other),
        }
    }
}

/// Type of a GID table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidType {
    /// InfiniBand GID.
    InfiniBand,
    /// RoCE v1 (Ethernet, no IP header).
    RoceV1,
    /// RoCE v2 (UDP/IP encapsulated; routable).
    RoceV2,
    /// A value this crate does not know.
    Unknown(u32),
}

/// One port of a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number (ports count from 1).
    pub port_num: u8,
    /// Logical state.
    pub state: PortState,
    /// Active MTU in bytes (256 … 4096), `None` when the value is not a known MTU.
    pub active_mtu: Option<u32>,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Number of entries of the port's GID table.
    pub gid_table_len: u32,
}

/// One populated entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidInfo {
    /// Port the entry belongs to.
    pub port_num: u8,
    /// Index in the port's GID table (pass this to address handles / QP attributes).
    pub index: u32,
    /// The GID as an IPv6 address (an IPv4 RoCE GID is `::ffff:a.b.c.d`).
    pub gid: Ipv6Addr,
    /// Entry type.
    pub gid_type: GidType,
}

impl GidInfo {
    /// The IPv4 address of an IPv4-mapped GID.
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        self.gid.to_ipv4_mapped()
    }

    /// True for a RoCE v2 GID carrying an IPv4 address (what rdma_cm over IPv4 uses).
    pub fn is_roce_v2_ipv4(&self) -> bool {
        self.gid_type == GidType::RoceV2 && self.ipv4().is_some()
    }
}

/// What [`list_devices`] reports about one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name of the device, e.g. `mlx5_0` or `rxe0`.
    pub name: String,
    /// Its ports.
    pub ports: Vec<PortInfo>,
    /// Populated GID table entries of all ports.
    pub gids: Vec<GidInfo>,
}

impl DeviceInfo {
    /// The first port in state [`PortState::Active`].
    pub fn active_port(&self) -> Option<&PortInfo> {
        self.ports.iter().find(|p| p.state == PortState::Active)
    }

    /// The first RoCE v2 IPv4 GID (looked up, never assumed to be at a fixed index).
    pub fn roce_v2_ipv4_gid(&self) -> Option<&GidInfo> {
        self.gids.iter().find(|g| g.is_roce_v2_ipv4())
    }
}

/// Runs `f`, turning a panic inside the binding into [`VerbsError::Internal`].
pub(crate) fn guarded<T>(
    what: &str,
    f: impl FnOnce() -> Result<T, VerbsError>,
) -> Result<T, VerbsError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_owned());
            Err(VerbsError::Internal(format!("{what}: {msg}")))
        }
    }
}

pub(crate) fn device_list() -> Result<DeviceList, VerbsError> {
    let list = DeviceList::new().map_err(|e| match e.0 {
        GetDeviceListErrorKind::Ibverbs(io) => VerbsError::from_device_list_error(io),
        #[allow(unreachable_patterns)] // the enum is non_exhaustive
        other => VerbsError::Internal(format!("ibv_get_device_list: {other}")),
    })?;
    if list.is_empty() {
        return Err(VerbsError::NoDevice);
    }
    Ok(list)
}

/// Lists the RDMA devices with their ports and GID tables.
///
/// Fails with [`VerbsError::NoDevice`] when there is none and [`VerbsError::RdmaCoreMissing`]
/// when libibverbs cannot be loaded; both print "no RDMA device found; see README for soft-RoCE".
pub fn list_devices() -> Result<Vec<DeviceInfo>, VerbsError> {
    guarded("list_devices", || {
        let list = device_list()?;
        let mut out = Vec::with_capacity(list.len());
        for dev in &list {
            let name = dev.name();
            let ctx = dev
                .open()
                .map_err(|e| VerbsError::verbs("ibv_open_device", &name, e))?;
            out.push(describe(&name, &ctx)?);
        }
        Ok(out)
    })
}

pub(crate) fn describe(name: &str, ctx: &DeviceContext) -> Result<DeviceInfo, VerbsError> {
    let attr = ctx
        .query_device()
        .map_err(|e| VerbsError::verbs("ibv_query_device_ex", name, e))?;
    let mut ports = Vec::new();
    for port_num in 1..=attr.phys_port_cnt() {
        let p = ctx
            .query_port(port_num)
            .map_err(|e| VerbsError::verbs("ibv_query_port", name, e))?;
        let raw = &p.attr;
        ports.push(PortInfo {
            port_num,
            state: PortState::from_raw(raw.state),
            active_mtu: match raw.active_mtu {
                m @ 1..=5 => Some(128u32 << m),
                _ => None,
            },
            link_layer: LinkLayer::from_raw(raw.link_layer),
            gid_table_len: u32::try_from(raw.gid_tbl_len).unwrap_or(0),
        });
    }
    let mut gids = Vec::new();
    for entry in ctx
        .query_gid_table()
        .map_err(|e| VerbsError::verbs("ibv_query_gid_table", name, e))?
    {
        let Ok(port_num) = u8::try_from(entry.port_num()) else {
            continue;
        };
        let index = entry.gid_index();
        let gid = Ipv6Addr::from(entry.gid());
        if gid.is_unspecified() {
            continue;
        }
        // ibv_query_gid_type's raw answer: 0 = IB or RoCE v1 (by link layer), 1 = RoCE v2.
        let link = ports
            .iter()
            .find(|p| p.port_num == port_num)
            .map(|p| p.link_layer);
        let gid_type = match ctx.query_gid_type(port_num, index) {
            Ok(0) if link == Some(LinkLayer::Ethernet) => GidType::RoceV1,
            Ok(0) => GidType::InfiniBand,
            Ok(1) => GidType::RoceV2,
            Ok(other) => GidType::Unknown(other),
            Err(e) => return Err(VerbsError::verbs("ibv_query_gid_type", name, e)),
        };
        gids.push(GidInfo {
            port_num,
            index,
            gid,
            gid_type,
        });
    }
    Ok(DeviceInfo {
        name: name.to_owned(),
        ports,
        gids,
    })
}

/// An open RDMA device (a verbs context).
pub struct Device {
    name: String,
    pub(crate) ctx: Arc<DeviceContext>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("name", &self.name).finish()
    }
}

/// Opens the first RDMA device (see [`list_devices`] for the errors).
pub fn open_first_device() -> Result<Device, VerbsError> {
    open_matching(None)
}

/// Opens the RDMA device called `name`.
pub fn open_device(name: &str) -> Result<Device, VerbsError> {
    open_matching(Some(name))
}

fn open_matching(wanted: Option<&str>) -> Result<Device, VerbsError> {
    guarded("open_device", || {
        let list = device_list()?;
        for dev in &list {
            let name = dev.name();
            if wanted.is_some_and(|w| w != name) {
                continue;
            }
            let ctx = dev
                .open()
                .map_err(|e| VerbsError::verbs("ibv_open_device", &name, e))?;
            return Ok(Device { name, ctx });
        }
        Err(VerbsError::DeviceNotFound(
            wanted.unwrap_or_default().to_owned(),
        ))
    })
}

impl Device {
    /// The device's kernel name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Ports and GID table of this device.
    pub fn info(&self) -> Result<DeviceInfo, VerbsError> {
        guarded("query device", || describe(&self.name, &self.ctx))
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain, VerbsError> {
        guarded("alloc_pd", || {
            let pd = self
                .ctx
                .alloc_pd()
                .map_err(|e| VerbsError::verbs("ibv_alloc_pd", &self.name, e))?;
            Ok(ProtectionDomain {
                device: self.name.clone(),
                pd,
            })
        })
    }
}

/// A protection domain: registered memory and queue pairs live in one.
pub struct ProtectionDomain {
    device: String,
    pd: Arc<RawPd>,
}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.device)
            .finish()
    }
}

impl ProtectionDomain {
    /// Allocates `len` zeroed bytes and registers them for local access only (the device may
    /// read and write them for this process's work requests; no peer can reach them).
    pub fn register(&self, len: usize) -> Result<RegisteredBuffer, VerbsError> {
        guarded("register", || {
            let region = OwnedRegion::new(&self.pd, len, Access::LocalWrite)
                .map_err(|e| VerbsError::verbs("ibv_reg_mr", &self.device, e))?;
            Ok(RegisteredBuffer { region })
        })
    }
}

/// Memory owned by this crate and registered with a protection domain.
pub struct RegisteredBuffer {
    region: OwnedRegion,
}

impl std::fmt::Debug for RegisteredBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuffer")
            .field("len", &self.len())
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}

impl RegisteredBuffer {
    /// Local key (for scatter/gather entries of local work requests).
    pub fn lkey(&self) -> u32 {
        self.region.lkey()
    }

    /// Remote key of the registration. It grants no remote access: the buffer is registered
    /// for local access only.
    pub fn rkey(&self) -> u32 {
        self.region.rkey()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.bytes().len()
    }

    /// True when the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.region.bytes()
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.region.bytes_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_values_never_panic() {
        assert_eq!(PortState::from_raw(4), PortState::Active);
        assert_eq!(PortState::from_raw(77), PortState::Unknown(77));
        assert_eq!(LinkLayer::from_raw(2), LinkLayer::Ethernet);
        assert_eq!(LinkLayer::from_raw(9), LinkLayer::Unknown(9));
    }

    #[test]
    fn ipv4_roce_v2_gid_is_recognised() {
        let g = GidInfo {
            port_num: 1,
            index: 1,
            gid: Ipv4Addr::new(10, 77, 0, 1).to_ipv6_mapped(),
            gid_type: GidType::RoceV2,
        };
        assert!(g.is_roce_v2_ipv4());
        assert_eq!(g.ipv4(), Some(Ipv4Addr::new(10, 77, 0, 1)));
        let link_local = GidInfo {
            gid: "fe80::1".parse().unwrap(),
            index: 0,
            ..g
        };
        assert!(!link_local.is_roce_v2_ipv4());
    }

    #[test]
    fn a_panic_in_the_binding_becomes_an_error() {
        let r: Result<(), _> = guarded("probe", || panic!("Unknown MTU value: 9"));
        match r {
            Err(VerbsError::Internal(msg)) => assert!(msg.contains("Unknown MTU value")),
            other => panic!("expected Internal, got {other:?}"),
        }
    }
}
