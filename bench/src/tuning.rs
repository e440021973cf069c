//! The tuning flags of every bench command, declared once and flattened where needed: the
//! verbs settings ([`VerbsArgs`], in `bench local`, `client`, `server`, `count` and
//! `scenario`), turned into one `VerbsConfig` value, and with them the runtimes' spin
//! ([`TuningArgs`], in `bench local`, `client` and `server`). The values are passed down to
//! what they tune: the bench keeps no process-wide settings.

use std::time::Duration;

use transport_verbs::{Exposure, VerbsConfig};

/// `--spin-us` when not given: the library's suggested budget (`transport_core::spin`).
pub const DEFAULT_SPIN_US: u64 = transport_core::spin::DEFAULT_BUDGET.as_micros() as u64;

/// The tuning flags of the commands that run transports and their servers.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct TuningArgs {
    /// Before a runtime thread sleeps, poll its waiting sockets for up to this many µs
    /// (`transport_core::spin`; 0: never); with `--rpc-io blocking`, also the blocking client
    /// and server before they block in recv (`BlockingConfig::spin`). Helps when client and
    /// server run on different CPUs; ignored where the process may use one CPU only, and
    /// backs off by itself where spins do not pay (the peer shares the CPU, or is slow).
    #[arg(long, default_value_t = DEFAULT_SPIN_US)]
    pub spin_us: u64,
    #[command(flatten)]
    pub verbs: VerbsArgs,
}

impl TuningArgs {
    /// `--spin-us` as a duration.
    pub fn spin(&self) -> Duration {
        Duration::from_micros(self.spin_us)
    }
}

/// The `--verbs-*` options.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct VerbsArgs {
    /// Verbs adaptive polling: poll the completion queue for this many µs after activity
    /// before sleeping on the completion channel (`VerbsConfig::poll_spin`; default: the
    /// library's).
    #[arg(long)]
    pub verbs_poll_us: Option<u64>,
    /// Verbs receive buffers in the device's shared receive queue (`VerbsConfig::srq_depth`;
    /// 0: each connection posts its own; default: the library's).
    #[arg(long)]
    pub verbs_srq_depth: Option<usize>,
    /// Most buffers the shared receive queue grows to when it runs low
    /// (`VerbsConfig::srq_max_depth`; up to `--verbs-srq-depth`: no growth; default: the
    /// library's).
    #[arg(long)]
    pub verbs_srq_max_depth: Option<usize>,
    /// Verbs receivers spinning at once on one thread from which the thread polls them
    /// together (`VerbsConfig::poll_together_from`; default: the library's).
    #[arg(long)]
    pub verbs_poll_together: Option<usize>,
    /// How rendezvous payloads are exposed to the peer (`VerbsConfig::exposure`): `auto`
    /// (memory windows where the device binds them, else registrations), `window` or
    /// `registration` (default: the library's, which TRANSPORT_VERBS_EXPOSURE may set).
    #[arg(long, value_parser = parse_exposure)]
    pub verbs_exposure: Option<Exposure>,
    /// The RDMA device to measure (`rxe0`, `siw0`, `mlx5_0`): the bench listens on the IPv4
    /// address rdma_cm maps to it (default: the first device with an address).
    #[arg(long)]
    pub verbs_device: Option<String>,
    /// Largest verbs payload sent eagerly, e.g. `32K` (`VerbsConfig::eager_limit`; above it
    /// a rendezvous; it also sizes each receive buffer; default: the library's).
    #[arg(long, value_parser = crate::args::parse_bytes)]
    pub verbs_eager_limit: Option<usize>,
}

fn parse_exposure(s: &str) -> Result<Exposure, String> {
    s.parse()
}

impl VerbsArgs {
    /// The library's defaults with these options applied.
    pub fn config(&self) -> VerbsConfig {
        let mut c = VerbsConfig::default();
        if let Some(us) = self.verbs_poll_us {
            c.poll_spin = Duration::from_micros(us);
        }
        if let Some(d) = self.verbs_srq_depth {
            c.srq_depth = d;
        }
        if let Some(d) = self.verbs_srq_max_depth {
            c.srq_max_depth = d;
        }
        if let Some(n) = self.verbs_poll_together {
            c.poll_together_from = n;
        }
        if let Some(e) = self.verbs_exposure {
            c.exposure = e;
        }
        if let Some(n) = self.verbs_eager_limit {
            c.eager_limit = n;
        }
        c
    }

    /// The address to listen on for verbs in local mode: `--verbs-device`'s, or the first
    /// RDMA address of this machine.
    pub fn local_ip(&self) -> Result<std::net::IpAddr, String> {
        match &self.verbs_device {
            Some(name) => transport_verbs::device_ip(name).map_err(|e| e.to_string()),
            None => transport_verbs::local_rdma_ip().map_err(|e| e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_option_lands_in_the_config() {
        let a = VerbsArgs {
            verbs_poll_us: Some(250),
            verbs_srq_depth: Some(0),
            verbs_srq_max_depth: Some(512),
            verbs_poll_together: Some(64),
            verbs_exposure: Some(Exposure::Registration),
            verbs_device: None,
            verbs_eager_limit: Some(32 << 10),
        };
        let c = a.config();
        assert_eq!(c.poll_spin, Duration::from_micros(250));
        assert_eq!(c.srq_depth, 0);
        assert_eq!(c.srq_max_depth, 512);
        assert_eq!(c.poll_together_from, 64);
        assert_eq!(c.exposure, Exposure::Registration);
        assert_eq!(c.eager_limit, 32 << 10);
        let d = VerbsArgs::default().config();
        let lib = VerbsConfig::default();
        assert_eq!(
            (
                d.poll_spin,
                d.srq_depth,
                d.srq_max_depth,
                d.poll_together_from,
                d.exposure,
                d.eager_limit
            ),
            (
                lib.poll_spin,
                lib.srq_depth,
                lib.srq_max_depth,
                lib.poll_together_from,
                lib.exposure,
                lib.eager_limit
            )
        );
        assert!(parse_exposure("windows").is_err());
        assert_eq!(parse_exposure("window"), Ok(Exposure::MemoryWindow));
    }
}
