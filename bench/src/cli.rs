//! The bench's command line: the commands and the flags of `bench local`, `client` and
//! `server` (clap). The value types they share with the other commands are in `args`, the
//! tuning flags in `tuning`.

use crate::args::{parse_bytes, parse_size, Only, Pin, RemoteTransport, TransportName};
use crate::measure::{Layer, Op, RawTwoway, RpcIo};
use crate::suite::Settings;
use crate::{count, results, scenario_cmd, soak, suite, tuning};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Default address of `bench server`: loopback only, since the port is unauthenticated.
pub(crate) const DEFAULT_LISTEN: &str = "127.0.0.1:5201";

#[derive(Parser, Debug)]
#[command(
    name = "bench",
    version,
    about = "Raw transport vs RPC over it, on uds, tcp and verbs, with a diagnosis of the gap",
    args_conflicts_with_subcommands = true
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
    #[command(flatten)]
    pub(crate) run: RunArgs,
}

/// `bench results ...`.
#[derive(Subcommand, Debug)]
pub(crate) enum ResultsCommand {
    /// Record a run as the results page, its JSON and plot, and the README's block.
    Write(results::WriteArgs),
    /// Fail unless the results page, its plot and the README's block match the recorded JSON.
    Check {
        /// The results directory.
        #[arg(long, default_value = "docs/results")]
        dir: PathBuf,
        /// The README holding the block.
        #[arg(long, default_value = "README.md")]
        readme: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Client and server in this process, over every available transport (the default).
    Local(RunArgs),
    /// Serve bench connections for `bench client` on another host.
    Server(ServerArgs),
    /// Run the comparison against `bench server` on HOST (TCP, verbs with --transport verbs),
    /// or at a Unix socket (`unix:PATH`, served by `bench server --uds PATH`).
    Client {
        /// The server: HOST or HOST:PORT (default port 5201), or `unix:PATH` for its Unix
        /// socket.
        host: String,
        /// Transport to the server (verbs needs `bench server --verbs`; uds needs
        /// `bench server --uds PATH` and takes `unix:PATH` or PATH as the server). Default:
        /// uds for `unix:PATH`, else tcp.
        #[arg(long, value_enum)]
        transport: Option<RemoteTransport>,
        #[command(flatten)]
        run: RunArgs,
    },
    /// The classic middleware scenarios: typed payloads, many clients, slow handlers, ORB shape.
    Scenario(scenario_cmd::ScenarioArgs),
    /// One report from a run on this machine and runs on an emulated one (`--json-out`
    /// files): the emulated rows are marked `NAME*` and only their ratios compare. `cargo
    /// xtask bench` uses it for the verbs rows it measures in the soft-RoCE guest.
    Merge {
        /// The report of this machine's run.
        base: PathBuf,
        /// Reports measured on the emulated machine.
        #[arg(required = true)]
        emulated: Vec<PathBuf>,
        /// How the emulated machine is described in the notes.
        #[arg(long, default_value = results::MERGE_MACHINE)]
        machine: String,
        /// Print the merged report as JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// The results page: `write` records a run (the host's and the guest's `--json-out`
    /// reports) as docs/results/ and the README's block (`cargo xtask bench --record` calls
    /// it); `check` fails when the page, the plot or the README's block differ from what the
    /// recorded JSON renders to.
    #[command(subcommand)]
    Results(ResultsCommand),
    /// One path, one operation, N messages, then exit: what `cargo xtask profile` runs under
    /// callgrind to count instructions per message (the difference of N and 3N).
    Count(count::CountArgs),
    /// RPC clients for a bounded time while faults strike: the server process or a process of
    /// clients killed (SIGKILL) and started again, or connections reset, half-closed or cut
    /// mid-frame by a proxy (uds, tcp); every call accounted for (answered, failed with a
    /// typed error, lost, misdelivered), and descriptors, tasks and connections back to their
    /// baseline.
    Soak(soak::SoakArgs),
    /// `bench soak`'s child of clients: calls until it is killed.
    #[command(hide = true)]
    SoakClient(soak::SoakClientArgs),
    /// Check the environment and say what to fix.
    Doctor {
        /// Print the findings as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Debug, Clone)]
pub(crate) struct RunArgs {
    /// The whole sweep: sizes 1 KB..1 MB x 1, 2, 4, 8, 16, 32 client threads (default: quick).
    #[arg(long)]
    pub(crate) full: bool,
    /// Payload sizes (K = 1024, M = 1048576), e.g. 1K,64K,500000.
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    pub(crate) sizes: Option<Vec<usize>>,
    /// Client thread counts (each thread has its own connection), e.g. 1,4,16.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..=256))]
    pub(crate) threads: Option<Vec<u16>>,
    /// Operations to measure, exactly (default: all, and the latency row); `ping` is the
    /// latency row.
    #[arg(long, value_delimiter = ',', value_enum)]
    pub(crate) ops: Option<Vec<Op>>,
    /// Measure only this path: `rpc` measures RPC alone, without the raw connection and the
    /// os (or link) baseline; the tables and the JSON say those were not measured.
    #[arg(long, value_enum, value_name = "PATH")]
    pub(crate) only: Option<Only>,
    /// Round trips for the latency row, raw and RPC each (split over the repetitions).
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) pings: u64,
    /// Repetitions of every figure (printed as median, min-max).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub(crate) repeat: u64,
    /// RPC calls in flight per client thread (1 = one synchronous call at a time).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub(crate) window: u64,
    /// Most payload bytes in flight per client thread: a byte-sequence cell of SIZE runs
    /// min(--window, this / SIZE) calls at once (at least 1; on uds and tcp an echo call counts
    /// 2 x SIZE, its request and its reply). Default 2M on uds and tcp, where
    /// bytes in flight beyond the CPU cache cost more than they hide, and 8M on verbs (an eighth
    /// of a locked-memory limit if less, at least 2M), whose rendezvous moves a large payload
    /// after a round trip of its own, so that with two 1 MiB calls in flight the device idles
    /// between them (K/M suffixes allowed; given, it applies to all).
    #[arg(long, value_parser = parse_bytes)]
    pub(crate) window_bytes: Option<usize>,
    /// Payload bytes per throughput run (K/M suffixes allowed).
    #[arg(long, default_value = "200M", value_parser = parse_bytes)]
    pub(crate) bytes: usize,
    /// CPU placement of client and server.
    #[arg(long, value_enum, default_value_t = Pin::Same)]
    pub(crate) pin: Pin,
    #[command(flatten)]
    pub(crate) tuning: tuning::TuningArgs,
    /// How the RPC rows are measured: `async` (RpcClient and RpcServer on tokio) or
    /// `blocking` (`transport_rpc::blocking`: the client blocks in recv, one call at a
    /// time, a thread per connection on the server; local mode, uds and tcp; verbs stays
    /// async).
    #[arg(long, value_enum, default_value_t = RpcIo::Async)]
    pub(crate) rpc_io: RpcIo,
    /// Payloads in plain heap memory instead of the transport's buffer pool (`BufferPool::alloc`):
    /// on verbs every eager message is then copied into registered memory, and a rendezvous
    /// payload registered (once, then cached), as for an application that does not allocate
    /// from the pool. No effect on uds and tcp, whose pool is the heap.
    #[arg(long)]
    pub(crate) heap_payload: bool,
    /// What the raw rows of the twoway ops measure: `stream` (message streams: send into a
    /// sink, recv from a source, echo echoed back) or `exchange` (the two messages an RPC call
    /// makes, on the raw connection, as many in flight as the cell's RPC window: send answered
    /// by an empty message, recv asked for by a small request, echo one back per message sent;
    /// RPC / raw is then the RPC layer's own cost).
    #[arg(long, value_enum, default_value_t = RawTwoway::Stream)]
    pub(crate) raw_twoway: RawTwoway,
    /// Transports to measure (local mode).
    #[arg(long, value_delimiter = ',', value_enum, default_values_t = [TransportName::Uds, TransportName::Shm, TransportName::Tcp, TransportName::Verbs])]
    pub(crate) transports: Vec<TransportName>,
    /// Print the report as JSON on stdout instead of tables.
    #[arg(long)]
    pub(crate) json: bool,
    /// Also write the report as JSON to this file (the tables still print): what
    /// `bench merge` reads.
    #[arg(long, value_name = "FILE.json")]
    pub(crate) json_out: Option<PathBuf>,
    /// Write an SVG plot to this file: per client thread count, Mbit/s (raw, RPC, os or link)
    /// and utilization (rpc/raw, raw/os, rpc/os) vs message size.
    #[arg(long, value_name = "FILE.svg")]
    pub(crate) plot: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub(crate) no_progress: bool,
}

#[derive(Args, Debug)]
#[command(after_long_help = "\
The port is unauthenticated: anyone who can reach it can make the server send and receive \
data and use CPU. It listens on loopback (127.0.0.1:5201) unless --listen names another \
address; a non-loopback --listen (e.g. 0.0.0.0:5201 for a client on another host) prints a \
warning. Use one only on a network you trust.
SIGINT or SIGTERM stops the server, removes the --uds socket file and exits with status 0.")]
pub(crate) struct ServerArgs {
    /// TCP address to listen on (default: loopback only). A non-loopback address (e.g.
    /// 0.0.0.0:5201, for a client on another host) exposes an unauthenticated port and prints
    /// a warning.
    #[arg(long, default_value = DEFAULT_LISTEN)]
    pub(crate) listen: SocketAddr,
    /// Also listen on this Unix socket path (removed when the server stops).
    #[arg(long)]
    pub(crate) uds: Option<PathBuf>,
    /// Also serve over RDMA verbs (rdma_cm) on the same IP and port (rdma_cm needs the IP of
    /// an RDMA device, not loopback: pass --listen), or at --verbs-listen.
    #[arg(long)]
    pub(crate) verbs: bool,
    /// Where verbs listens (with --verbs; default: --listen's address). An iWARP device
    /// (siw, Chelsio, irdma in iWARP mode) runs RDMA over TCP and cannot share a port with
    /// the TCP listener: give it another port. The link figures listen one port up.
    #[arg(long)]
    pub(crate) verbs_listen: Option<SocketAddr>,
    #[command(flatten)]
    pub(crate) tuning: tuning::TuningArgs,
    /// Also serve the OS baseline (blocking std sockets, a thread per connection: a 1-byte
    /// ping-pong and a sink) on this Unix socket path, for `bench count --path os`.
    #[arg(long)]
    pub(crate) os_uds: Option<PathBuf>,
    /// Also serve the OS baseline on this TCP address (see --os-uds).
    #[arg(long)]
    pub(crate) os_tcp: Option<SocketAddr>,
    /// Pin the server to this CPU.
    #[arg(long)]
    pub(crate) core: Option<usize>,
}

impl RunArgs {
    /// `--transports` when not given.
    pub(crate) fn default_transports() -> Vec<TransportName> {
        vec![
            TransportName::Uds,
            TransportName::Shm,
            TransportName::Tcp,
            TransportName::Verbs,
        ]
    }

    /// `--spin-us`.
    pub(crate) fn spin(&self) -> Duration {
        self.tuning.spin()
    }

    pub(crate) fn settings(&self, client_core: Option<usize>) -> Settings {
        let sizes = self.sizes.clone().unwrap_or_else(|| {
            if self.full {
                vec![1024, 4096, 16384, 65536, 262_144, 500_000, 1 << 20]
            } else {
                vec![1024, 65536, 262_144, 500_000, 1 << 20]
            }
        });
        let threads = self
            .threads
            .clone()
            .map(|v| v.into_iter().map(usize::from).collect())
            .unwrap_or_else(|| {
                if self.full {
                    vec![1, 2, 4, 8, 16, 32]
                } else {
                    vec![1]
                }
            });
        let ops = self
            .ops
            .clone()
            .map(|v| v.into_iter().filter(|&o| o != Op::Ping).collect())
            .unwrap_or_else(|| vec![Op::Send, Op::Oneway, Op::Recv, Op::Echo]);
        let ping = self.ops.as_ref().is_none_or(|v| v.contains(&Op::Ping));
        let layers = match self.only {
            Some(Only::Rpc) => vec![Layer::Rpc],
            None => vec![Layer::Raw, Layer::Rpc],
        };
        Settings {
            sizes,
            threads,
            ops,
            layers,
            ping,
            pings: self.pings,
            repeat: self.repeat as usize,
            bytes_per_run: self.bytes as u64,
            min_calls: 64,
            max_calls: 20_000,
            window: self.window as usize,
            window_bytes: self.window_bytes.unwrap_or(suite::WINDOW_BYTES),
            verbs_window_bytes: self
                .window_bytes
                .unwrap_or_else(suite::verbs_window_bytes_here),
            echo_both_ways: true,
            client_core,
            rpc_io: self.rpc_io,
            heap_payload: self.heap_payload,
            raw_twoway: self.raw_twoway,
        }
    }

    pub(crate) fn progress(&self, total: u64) -> ProgressBar {
        if self.no_progress || self.json {
            return ProgressBar::hidden();
        }
        let pb = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        pb.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} {msg}")
                .expect("valid template"),
        );
        pb
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::measure::Op;

    #[test]
    fn window_bytes_caps_calls_in_flight() {
        let cli = Cli::try_parse_from(["bench", "--window", "16", "--window-bytes", "2M"]).unwrap();
        let s = cli.run.settings(None);
        assert_eq!(s.window_for(Op::Send, 1024), 16);
        assert_eq!(s.window_for(Op::Send, 256 << 10), 8);
        assert_eq!(s.window_for(Op::Recv, 500_000), 4);
        assert_eq!(s.window_for(Op::Oneway, 1 << 20), 2);
        assert_eq!(s.window_for(Op::Send, 64 << 20), 1, "never below one call");
        assert_eq!(
            s.for_verbs().window_for(Op::Send, 1 << 20),
            2,
            "given, it applies to verbs too"
        );
    }

    #[test]
    fn an_echo_counts_its_bytes_both_ways_except_on_verbs() {
        let cli = Cli::try_parse_from(["bench", "--window-bytes", "2M"]).unwrap();
        let s = cli.run.settings(None);
        assert_eq!(
            s.window_for(Op::Echo, 256 << 10),
            4,
            "1 MiB out, 1 MiB back"
        );
        assert_eq!(s.window_for(Op::Recv, 256 << 10), 8);
        assert_eq!(s.window_for(Op::Echo, 1 << 20), 1);
        assert_eq!(
            s.window_for(Op::Echo, 1024),
            16,
            "the call limit still holds"
        );
        let verbs = s.for_verbs();
        assert_eq!(verbs.window_for(Op::Echo, 256 << 10), 8);
        assert_eq!(verbs.window_for(Op::Echo, 1 << 20), 2);
    }

    #[test]
    fn verbs_keeps_more_bytes_in_flight_by_default() {
        let cli = Cli::try_parse_from(["bench"]).unwrap();
        let s = cli.run.settings(None);
        assert_eq!(s.window_for(Op::Send, 1 << 20), 2);
        let verbs = s.for_verbs();
        assert_eq!(verbs.window_bytes, suite::verbs_window_bytes_here());
        assert!(verbs.window_bytes >= s.window_bytes && verbs.window_bytes <= 8 << 20);
        if transport_verbs::memlock_budget().is_none_or(|b| b >= 64 << 20) {
            assert_eq!(verbs.window_for(Op::Send, 1 << 20), 8);
            assert_eq!(verbs.window_for(Op::Echo, 1 << 20), 8);
        }
        assert_eq!(
            verbs.window_for(Op::Send, 64 << 10),
            16,
            "the call limit still holds"
        );
    }

    /// `bench scenario` takes the verbs polling budget and shared receive queue depth, as
    /// `bench local` does, into the settings its verbs transport is made with.
    #[test]
    fn scenarios_take_the_verbs_settings() {
        let cli = Cli::try_parse_from([
            "bench",
            "scenario",
            "clients",
            "--verbs-poll-us",
            "250",
            "--verbs-srq-depth",
            "0",
            "--verbs-poll-together",
            "64",
        ])
        .unwrap();
        let Some(Command::Scenario(a)) = cli.command else {
            panic!("not the scenario command: {cli:?}");
        };
        assert_eq!(a.verbs.verbs_poll_us, Some(250));
        assert_eq!(a.verbs.verbs_srq_depth, Some(0));
        assert_eq!(a.verbs.verbs_poll_together, Some(64));
        let c = a.verbs.config();
        assert_eq!(
            (c.poll_spin, c.srq_depth, c.poll_together_from),
            (Duration::from_micros(250), 0, 64)
        );
        let Some(Command::Scenario(a)) = Cli::try_parse_from(["bench", "scenario", "clients"])
            .unwrap()
            .command
        else {
            panic!("not the scenario command");
        };
        assert_eq!(a.verbs, tuning::VerbsArgs::default(), "the library's");
    }

    /// `bench local` and `bench server` take the same tuning flags, each into its own value:
    /// the runtime's spin and the verbs settings.
    #[test]
    fn local_and_server_take_the_tuning_flags() {
        let flags = ["--spin-us", "7", "--verbs-srq-depth", "0"];
        let local = Cli::try_parse_from(["bench", "local"].into_iter().chain(flags)).unwrap();
        let server = Cli::try_parse_from(["bench", "server"].into_iter().chain(flags)).unwrap();
        let (Some(Command::Local(l)), Some(Command::Server(s))) = (local.command, server.command)
        else {
            panic!("not the local and server commands");
        };
        assert_eq!(l.tuning, s.tuning);
        assert_eq!(l.spin(), Duration::from_micros(7));
        assert_eq!(s.tuning.verbs.config().srq_depth, 0);
        let Some(Command::Local(d)) = Cli::try_parse_from(["bench", "local"]).unwrap().command
        else {
            panic!("not the local command");
        };
        assert_eq!(d.tuning.spin_us, tuning::DEFAULT_SPIN_US);
        assert_eq!(d.tuning.verbs, tuning::VerbsArgs::default());
    }

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
