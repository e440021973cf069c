//! What a device can do, probed once per device, and the path each feature of the transport
//! takes on it.
//!
//! Providers differ in ways that decide how this transport must work (rdma-core and kernel
//! sources): mlx5, mlx4, rxe, ionic and mana bind type-2 memory windows; irdma binds them but
//! advertises only the type-1 flag; bnxt_re's userspace provider cannot allocate one; qedr, siw
//! and ocrdma have none; cxgb4 has type 1 only. iWARP devices (siw, cxgb4, qedr and irdma in
//! iWARP mode) have no receiver-not-ready retry and need the sink of an RDMA READ registered
//! for remote write. So nothing is assumed: `DeviceCaps::probe` asks the device (and binds a
//! window to a throw-away queue pair rather than trusting a flag), and [`Paths::choose`] turns
//! the answers and the [`VerbsConfig`] into the settings a connection uses.
//!
//! ```no_run
//! # fn main() -> Result<(), transport_verbs::VerbsError> {
//! for caps in transport_verbs::probe_devices()? {
//!     let paths = caps.paths(&transport_verbs::VerbsConfig::default());
//!     println!("{caps}\n{paths}");
//! }
//! # Ok(()) }
//! ```

use std::fmt;
use std::sync::Arc;

use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use crate::config::{Exposure, VerbsConfig};
use crate::device::{DeviceInfo, GidType, LinkLayer, PortState};

/// The transport a device speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaTransport {
    /// Native InfiniBand.
    InfiniBand,
    /// RDMA over Converged Ethernet (including soft-RoCE, `rdma_rxe`).
    Roce,
    /// iWARP (RDMA over TCP: siw, cxgb4, qedr and irdma in iWARP mode).
    Iwarp,
    /// Another transport type (`ibv_device.transport_type`).
    Other(i32),
}

impl RdmaTransport {
    /// Whether the device needs iWARP's rules: no receiver-not-ready retry, READ sinks
    /// registered for remote write, the connecting side sends first.
    pub fn is_iwarp(self) -> bool {
        self == RdmaTransport::Iwarp
    }
}

impl fmt::Display for RdmaTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RdmaTransport::InfiniBand => f.write_str("InfiniBand"),
            RdmaTransport::Roce => f.write_str("RoCE"),
            RdmaTransport::Iwarp => f.write_str("iWARP"),
            RdmaTransport::Other(t) => write!(f, "transport type {t}"),
        }
    }
}

/// A shared receive queue's limits on a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrqLimits {
    /// Work requests (receive buffers) one shared receive queue may hold.
    pub max_wr: u32,
    /// Scatter entries per receive.
    pub max_sge: u32,
}

/// What one device can do, as it answered when probed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceCaps {
    /// The device's name (`rxe0`, `siw0`, `mlx5_0`).
    pub device: String,
    /// Its transport.
    pub transport: RdmaTransport,
    /// Whether a type-2 memory window was allocated and bound to a queue pair: `Ok`, or why
    /// not (the step that failed and the device's answer).
    pub type2_windows: Result<(), String>,
    /// Shared receive queues, if the device has them.
    pub srq: Option<SrqLimits>,
    /// Inline data of a send (bytes), as a queue pair created with the transport's default
    /// request reported it (0: no inline sends).
    pub max_inline: u32,
    /// Scatter/gather entries per send work request.
    pub max_sge: u32,
    /// Work requests per queue.
    pub max_qp_wr: u32,
    /// RDMA READs a queue pair may keep outstanding and serve at once (the smaller of
    /// `max_qp_rd_atom` and `max_qp_init_rd_atom`).
    pub read_depth: u32,
    /// Largest memory registration, bytes.
    pub max_mr_size: u64,
    /// The vendor id the device reports (`0x626d74` for siw, `0x2c9` for Mellanox).
    pub vendor_id: u32,
}

/// The vendor id the soft-iWARP driver reports (`"bmt"`).
pub const SIW_VENDOR_ID: u32 = 0x62_6d74;

/// How rendezvous payloads are exposed to the peer's RDMA READ on a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExposurePath {
    /// A type-2 memory window bound to the connection's queue pair for one payload and
    /// invalidated when its FIN arrives; every connection of a device shares one protection
    /// domain, buffer pool and shared receive queue.
    MemoryWindow,
    /// A registration of exactly the payload's bytes, remote read only, made for the transfer
    /// and deregistered when its FIN arrives (or it times out, or the connection fails). A
    /// registration is valid for every queue pair of its protection domain, so each connection
    /// has a protection domain of its own (and its own buffers and receive queue).
    Registration,
}

impl fmt::Display for ExposurePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ExposurePath::MemoryWindow => "memory window",
            ExposurePath::Registration => "registration",
        })
    }
}

/// The path each feature takes on a device, from its [`DeviceCaps`] and a [`VerbsConfig`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Paths {
    /// How rendezvous payloads are exposed.
    pub exposure: ExposurePath,
    /// Why that path (the setting, or what the device lacks).
    pub exposure_why: String,
    /// Buffers the device's shared receive queue starts with, 0 when each connection posts
    /// its own.
    pub srq_depth: usize,
    /// Most buffers the shared receive queue grows to (`srq_max_depth` within the device, at
    /// least `srq_depth`); 0 without a shared queue.
    pub srq_max_depth: usize,
    /// Credits (and, without a shared queue, receive buffers posted) per connection.
    pub recv_depth: usize,
    /// Why (shared, or why not).
    pub receive_why: String,
    /// Inline data requested for each queue pair (what the device granted when probed).
    pub inline_size: usize,
    /// RDMA READs a queue pair keeps outstanding and serves (`read_depth` within the device).
    pub read_depth: u8,
    /// The sink of each RDMA READ is registered for remote write while its READ runs (iWARP).
    pub read_sink_remote_write: bool,
    /// Largest piece of a rendezvous READ (`rendezvous_chunk` within the device's largest
    /// registration).
    pub rendezvous_chunk: usize,
}

impl Paths {
    /// The paths a connection with `cfg` takes on a device with `caps`.
    pub fn choose(caps: &DeviceCaps, cfg: &VerbsConfig) -> Paths {
        let iwarp = caps.transport.is_iwarp();
        let (exposure, exposure_why) = match (cfg.exposure, &caps.type2_windows) {
            (Exposure::Registration, _) => (
                ExposurePath::Registration,
                "VerbsConfig::exposure = Registration".to_owned(),
            ),
            (Exposure::MemoryWindow, _) => (
                ExposurePath::MemoryWindow,
                "VerbsConfig::exposure = MemoryWindow".to_owned(),
            ),
            (Exposure::Auto, Ok(())) => (
                ExposurePath::MemoryWindow,
                "a type-2 window binds on this device".to_owned(),
            ),
            (Exposure::Auto, Err(why)) => (
                ExposurePath::Registration,
                format!("no type-2 memory window ({why})"),
            ),
        };
        let (srq_depth, srq_max_depth, receive_why) = if cfg.srq_depth == 0 {
            (0, 0, "srq_depth = 0".to_owned())
        } else if exposure == ExposurePath::Registration {
            (
                0,
                0,
                "a protection domain per connection (registration exposure), and a shared \
                 receive queue belongs to one"
                    .to_owned(),
            )
        } else if iwarp {
            (
                0,
                0,
                "iWARP has no receiver-not-ready retry: credits must match posted buffers \
                 exactly"
                    .to_owned(),
            )
        } else {
            match caps.srq {
                None => (0, 0, "the device has no shared receive queue".to_owned()),
                Some(l) => {
                    let most = l.max_wr as usize;
                    let depth = cfg.srq_depth.min(most);
                    let max = cfg.srq_max_depth.max(cfg.srq_depth).min(most);
                    let why = if depth < cfg.srq_depth {
                        format!("shared, {depth} buffers (the device's most)")
                    } else {
                        "shared by the device's connections".to_owned()
                    };
                    (depth, max, why)
                }
            }
        };
        // Where the settings asked for a shared queue and the device's paths have none, each
        // connection posts its own buffers: at most PER_CONNECTION_RECV_DEPTH of them, so a
        // connection registers 1 MiB for receiving rather than 4 (8 MiB is a common
        // RLIMIT_MEMLOCK). Asked for own buffers (`srq_depth = 0`), `recv_depth` as set.
        let recv_depth = if srq_depth == 0 && cfg.srq_depth > 0 {
            cfg.recv_depth.min(PER_CONNECTION_RECV_DEPTH)
        } else {
            cfg.recv_depth
        };
        Paths {
            exposure,
            exposure_why,
            srq_depth,
            srq_max_depth,
            recv_depth,
            receive_why,
            inline_size: cfg.inline_size.min(caps.max_inline as usize),
            // On iWARP the connection manager moves the queue pair to RTS with the READ depths
            // of the connection parameters, which this binding leaves at rdma_cm's 1: a second
            // READ in flight would overrun the responder's queue and end the connection.
            read_depth: if iwarp {
                IWARP_READ_DEPTH
            } else {
                cfg.read_depth.min(caps.read_depth as usize).clamp(1, 255) as u8
            },
            read_sink_remote_write: iwarp,
            rendezvous_chunk: cfg
                .rendezvous_chunk
                .min(usize::try_from(caps.max_mr_size).unwrap_or(usize::MAX))
                .max(1),
        }
    }
}

/// RDMA READs in flight per queue pair on iWARP (see [`Paths::choose`]).
pub const IWARP_READ_DEPTH: u8 = 1;

/// Receive buffers a connection posts for itself where the settings asked for a shared queue
/// but the device's paths have none (see [`Paths::choose`]).
pub const PER_CONNECTION_RECV_DEPTH: usize = 16;

impl Paths {
    /// `cfg` with every setting these paths decide: what one connection on the device uses.
    pub fn apply(&self, cfg: &VerbsConfig) -> VerbsConfig {
        let mut c = cfg.clone();
        c.srq_depth = self.srq_depth;
        c.srq_max_depth = self.srq_max_depth;
        c.recv_depth = self.recv_depth;
        c.inline_size = self.inline_size;
        c.read_depth = usize::from(self.read_depth);
        c.rendezvous_chunk = self.rendezvous_chunk;
        c.exposure = match self.exposure {
            ExposurePath::MemoryWindow => Exposure::MemoryWindow,
            ExposurePath::Registration => Exposure::Registration,
        };
        c
    }
}

impl fmt::Display for DeviceCaps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}; type-2 memory windows: {}; shared receive queue: {}; inline {} B; {} SGEs; \
             {} work requests per queue; {} READs outstanding; registrations up to {}",
            self.device,
            self.transport,
            match &self.type2_windows {
                Ok(()) => "yes".to_owned(),
                Err(why) => format!("no ({why})"),
            },
            match self.srq {
                Some(l) => format!("up to {} buffers", l.max_wr),
                None => "none".to_owned(),
            },
            self.max_inline,
            self.max_sge,
            self.max_qp_wr,
            self.read_depth,
            bytes(self.max_mr_size),
        )
    }
}

/// `n` bytes in the largest binary unit that keeps a whole number: `64 KiB`, `16 EiB`.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = n;
    let mut unit = 0;
    while unit + 1 < UNITS.len() && v >= 1024 {
        v /= 1024;
        unit += 1;
    }
    format!("{v} {}", UNITS[unit])
}

impl fmt::Display for Paths {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rendezvous exposure: {} ({}); receive buffers: {}; inline up to {} B; {} READs \
             in flight{}",
            self.exposure,
            self.exposure_why,
            if self.srq_depth > 0 {
                format!(
                    "{} in a shared queue growing to {} ({})",
                    self.srq_depth, self.srq_max_depth, self.receive_why
                )
            } else {
                format!("{} per connection ({})", self.recv_depth, self.receive_why)
            },
            self.inline_size,
            self.read_depth,
            if self.read_sink_remote_write {
                "; READ sinks registered for remote write while they run (iWARP)"
            } else {
                ""
            },
        )
    }
}

/// Probes every RDMA device of this machine (`DeviceCaps::probe`: attributes, a queue
/// pair's inline size, a type-2 window bound to a throw-away queue pair). Fails like
/// [`crate::list_devices`] without a device or rdma-core.
pub fn probe_devices() -> Result<Vec<DeviceCaps>, crate::VerbsError> {
    use crate::VerbsError;
    use sideway::ibverbs::device::DeviceInfo as _;
    crate::device::guarded("probe_devices", || {
        let list = crate::device::device_list()?;
        let mut out = Vec::with_capacity(list.len());
        for dev in &list {
            let name = dev.name();
            let ctx = dev
                .open()
                .map_err(|e| VerbsError::verbs("ibv_open_device", &name, e))?;
            let info = crate::device::describe(&name, &ctx)?;
            let pd = ctx
                .alloc_pd()
                .map_err(|e| VerbsError::verbs("ibv_alloc_pd", &name, e))?;
            let caps = DeviceCaps::probe(&name, &ctx, &pd, &info)
                .map_err(|e| VerbsError::verbs("probe", &name, e))?;
            out.push(caps);
        }
        Ok(out)
    })
}

/// The mean time `device` takes to register `len` bytes for remote read and deregister them
/// (over `iterations` rounds): what [`ExposurePath::Registration`] adds to each rendezvous
/// message, where a memory window costs two work requests posted with the message's RTS.
///
/// ```no_run
/// let t = transport_verbs::registration_cost("rxe0", 1 << 20, 200)?;
/// println!("register + deregister 1 MiB: {t:?}");
/// # Ok::<(), transport_verbs::VerbsError>(())
/// ```
pub fn registration_cost(
    device: &str,
    len: usize,
    iterations: u32,
) -> Result<std::time::Duration, crate::VerbsError> {
    use crate::VerbsError;
    let dev = crate::device::open_device(device)?;
    crate::device::guarded("registration_cost", || {
        let pd = dev
            .ctx
            .alloc_pd()
            .map_err(|e| VerbsError::verbs("ibv_alloc_pd", device, e))?;
        crate::ffi::probe::registration_round_trip(&pd, len, iterations)
            .map_err(|e| VerbsError::verbs("ibv_reg_mr", device, e))
    })
}

/// Inline data a queue pair is asked for when probing (what the transport asks by default).
const PROBE_INLINE: u32 = 256;

impl DeviceCaps {
    /// Asks the device behind `ctx` (called `name`) what it can do: its attributes, the inline
    /// size a queue pair gets, and whether a type-2 window binds (on `pd`).
    pub(crate) fn probe(
        name: &str,
        ctx: &Arc<DeviceContext>,
        pd: &Arc<ProtectionDomain>,
        info: &DeviceInfo,
    ) -> std::io::Result<DeviceCaps> {
        let attr = ctx.query_device().map_err(std::io::Error::other)?;
        let port = info
            .ports
            .iter()
            .find(|p| p.state == PortState::Active)
            .or_else(|| info.ports.first());
        let transport = match crate::ffi::probe::transport_type(ctx) {
            1 => RdmaTransport::Iwarp,
            0 if port.is_some_and(|p| p.link_layer == LinkLayer::Ethernet) => RdmaTransport::Roce,
            0 => RdmaTransport::InfiniBand,
            other => RdmaTransport::Other(other),
        };
        let nonneg = |v: i32| u32::try_from(v).unwrap_or(0);
        let srq = (attr.max_srq() > 0 && attr.max_srq_wr() > 0).then(|| SrqLimits {
            max_wr: nonneg(attr.max_srq_wr()),
            max_sge: nonneg(attr.max_srq_sge()),
        });
        let max_inline = crate::ffi::probe::granted_inline(ctx, pd, PROBE_INLINE);
        let type2_windows = match (transport, port) {
            (RdmaTransport::Iwarp, _) => Err(
                "not probed on iWARP: a queue pair binds only once connected through rdma_cm, \
                 and the iWARP providers but irdma have no type-2 windows"
                    .to_owned(),
            ),
            (_, None) => Err("the device has no port".to_owned()),
            (_, Some(p)) => {
                // RoCE needs a global route: prefer the IPv4 RoCE v2 GID, else any of the port.
                let gid = info
                    .gids
                    .iter()
                    .filter(|g| g.port_num == p.port_num)
                    .max_by_key(|g| (g.is_roce_v2_ipv4(), g.gid_type == GidType::RoceV2))
                    .map(|g| (g.index, g.gid));
                let path = crate::ffi::probe::SelfPath {
                    port: p.port_num,
                    mtu_code: p.active_mtu.map_or(3, |m| m.trailing_zeros() - 7),
                    lid: crate::ffi::probe::port_lid(ctx, p.port_num),
                    gid: if transport == RdmaTransport::Roce || gid.is_some() {
                        gid
                    } else {
                        None
                    },
                };
                crate::ffi::probe::type2_window_binds(ctx, pd, &path)
            }
        };
        Ok(DeviceCaps {
            device: name.to_owned(),
            transport,
            type2_windows,
            srq,
            max_inline,
            max_sge: nonneg(attr.max_sge()),
            max_qp_wr: nonneg(attr.max_qp_wr()),
            read_depth: nonneg(attr.max_qp_rd_atom().min(attr.max_qp_init_rd_atom())),
            max_mr_size: attr.max_mr_size(),
            vendor_id: attr.vendor_id(),
        })
    }

    /// The paths a connection with `cfg` takes on this device.
    pub fn paths(&self, cfg: &VerbsConfig) -> Paths {
        Paths::choose(self, cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(transport: RdmaTransport, windows: bool, srq: bool) -> DeviceCaps {
        DeviceCaps {
            device: "dev0".into(),
            transport,
            type2_windows: if windows {
                Ok(())
            } else {
                Err("ibv_alloc_mw(type 2): Operation not supported".into())
            },
            srq: srq.then_some(SrqLimits {
                max_wr: 64,
                max_sge: 1,
            }),
            max_inline: 64,
            max_sge: 6,
            max_qp_wr: 4096,
            read_depth: 8,
            max_mr_size: 1 << 30,
            vendor_id: 0,
        }
    }

    #[test]
    fn the_shared_queue_grows_from_srq_depth_to_srq_max_depth_within_the_device() {
        let mut cfg = VerbsConfig {
            srq_depth: 8,
            srq_max_depth: 32,
            ..VerbsConfig::default()
        };
        let p = caps(RdmaTransport::Roce, true, true).paths(&cfg);
        assert_eq!((p.srq_depth, p.srq_max_depth), (8, 32));
        assert_eq!(p.apply(&VerbsConfig::default()).srq_max_depth, 32);
        assert!(
            p.to_string().contains("8 in a shared queue growing to 32"),
            "{p}"
        );
        // A cap below the starting depth keeps the queue where it starts.
        cfg.srq_max_depth = 4;
        let p = caps(RdmaTransport::Roce, true, true).paths(&cfg);
        assert_eq!((p.srq_depth, p.srq_max_depth), (8, 8));
        // No shared queue, nothing to grow.
        cfg.srq_depth = 0;
        let p = caps(RdmaTransport::Roce, true, true).paths(&cfg);
        assert_eq!((p.srq_depth, p.srq_max_depth), (0, 0));
    }

    #[test]
    fn auto_takes_windows_where_they_bind_and_registrations_elsewhere() {
        let cfg = VerbsConfig::default();
        let rxe = caps(RdmaTransport::Roce, true, true).paths(&cfg);
        assert_eq!(rxe.exposure, ExposurePath::MemoryWindow);
        // The device holds 64 buffers per shared queue: the depth is cut to it.
        assert_eq!(rxe.srq_depth, 64);
        assert_eq!(
            rxe.srq_max_depth, 64,
            "the growth cap is cut to the device too"
        );
        assert!(rxe.receive_why.contains("device's most"), "{rxe}");
        assert_eq!(rxe.inline_size, 64);
        assert_eq!(rxe.read_depth, 8);
        assert!(!rxe.read_sink_remote_write);

        assert_eq!(rxe.recv_depth, cfg.recv_depth);

        let bnxt = caps(RdmaTransport::Roce, false, true).paths(&cfg);
        assert_eq!(bnxt.exposure, ExposurePath::Registration);
        assert!(
            bnxt.exposure_why.contains("Operation not supported"),
            "{bnxt}"
        );
        assert_eq!(
            bnxt.srq_depth, 0,
            "a protection domain per connection: no shared queue"
        );
        assert_eq!(bnxt.recv_depth, PER_CONNECTION_RECV_DEPTH);
        let eff = bnxt.apply(&cfg);
        assert_eq!(
            (
                eff.srq_depth,
                eff.recv_depth,
                eff.inline_size,
                eff.read_depth
            ),
            (0, PER_CONNECTION_RECV_DEPTH, 64, 8)
        );
        assert_eq!(eff.exposure, Exposure::Registration);
        // Own buffers asked for: as many as asked.
        let own = VerbsConfig {
            srq_depth: 0,
            ..VerbsConfig::default()
        };
        assert_eq!(
            caps(RdmaTransport::Roce, false, true)
                .paths(&own)
                .recv_depth,
            own.recv_depth
        );
    }

    #[test]
    fn iwarp_gets_exact_credits_and_remote_write_sinks() {
        let cfg = VerbsConfig::default();
        let siw = caps(RdmaTransport::Iwarp, false, true).paths(&cfg);
        assert_eq!(siw.exposure, ExposurePath::Registration);
        assert_eq!(siw.srq_depth, 0);
        assert!(siw.read_sink_remote_write);
        assert_eq!(
            siw.read_depth, IWARP_READ_DEPTH,
            "rdma_cm's READ depth on iWARP"
        );
        // Even with windows forced, iWARP keeps per-connection receive buffers.
        let forced = VerbsConfig {
            exposure: Exposure::MemoryWindow,
            ..VerbsConfig::default()
        };
        let p = caps(RdmaTransport::Iwarp, true, true).paths(&forced);
        assert_eq!(p.exposure, ExposurePath::MemoryWindow);
        assert_eq!(p.srq_depth, 0);
        assert!(p.receive_why.contains("iWARP"), "{p}");
    }

    #[test]
    fn the_setting_overrides_the_probe() {
        let reg = VerbsConfig {
            exposure: Exposure::Registration,
            ..VerbsConfig::default()
        };
        let p = caps(RdmaTransport::Roce, true, true).paths(&reg);
        assert_eq!(p.exposure, ExposurePath::Registration);
        assert!(p.exposure_why.contains("VerbsConfig::exposure"), "{p}");
        let none = VerbsConfig {
            srq_depth: 0,
            ..VerbsConfig::default()
        };
        assert_eq!(
            caps(RdmaTransport::Roce, true, true).paths(&none).srq_depth,
            0
        );
        // A device without a shared receive queue: per connection.
        let p = caps(RdmaTransport::InfiniBand, true, false).paths(&VerbsConfig::default());
        assert_eq!(p.srq_depth, 0);
        assert!(p.receive_why.contains("no shared receive queue"), "{p}");
    }

    #[test]
    fn the_summary_names_every_answer() {
        let c = caps(RdmaTransport::Iwarp, false, false);
        let s = c.to_string();
        for part in [
            "dev0",
            "iWARP",
            "no (ibv_alloc_mw",
            "shared receive queue: none",
            "inline 64 B",
            "8 READs",
        ] {
            assert!(s.contains(part), "{part} in {s}");
        }
        assert!(s.contains("registrations up to 1 GiB"), "{s}");
        assert_eq!(bytes(u64::MAX), "15 EiB");
        let p = c.paths(&VerbsConfig::default()).to_string();
        assert!(
            p.contains("registration") && p.contains("remote write"),
            "{p}"
        );
    }
}
