//! `cargo xtask`: the project's automation, in Rust rather than shell.
//!
//! ```text
//! cargo xtask bench [ARGS]   install what the build needs, then run the `bench` comparison
//! cargo xtask bench --record the fixed comparison recorded as docs/results/ and the README's block
//! cargo xtask test           install what is needed, then run every check and test suite
//!                            (fmt, clippy, workspace tests, the soak, the fuzz targets, the verbs suite in the soft-RoCE guest,
//!                            the instruction counts as a smoke)
//! cargo xtask deps           only install / check the system packages
//! cargo xtask profile         instructions per message (callgrind): link or OS, raw and RPC, client and
//!                            server, on uds and tcp here and verbs in the soft-RoCE guest
//! cargo xtask fuzz           the libFuzzer targets in fuzz/, 60 s each, on the stable toolchain
//! cargo xtask docs           check the docs: links resolve, README and reference pages within size
//! cargo xtask testbed ...    the soft-RoCE QEMU test bed (see `cargo xtask testbed --help`)
//! ```

mod deps;
mod docs;
mod fuzz;
mod profile;
mod record;
mod testbed;
mod util;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (cmd, rest) = match args.split_first() {
        Some((c, r)) => (c.as_str(), r),
        None => ("help", &[][..]),
    };
    let result = match cmd {
        "deps" => deps::ensure_build_deps(),
        "docs" => docs::run(),
        "test" => run_tests(rest),
        "bench" => run_bench(rest),
        "testbed" => testbed::main(rest),
        "profile" => profile::run(rest),
        "fuzz" => fuzz::run(rest),
        "help" | "-h" | "--help" => {
            print_help();
            Ok(())
        }
        other => Err(format!(
            "unknown xtask command `{other}`; try `cargo xtask help`"
        )),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn print_help() {
    println!(
        "cargo xtask <command>\n\n\
         commands:\n  \
         bench [ARGS]   install build dependencies, then `cargo run --release -p bench -- ARGS`; without\n                 an RDMA device, then the verbs rows in the soft-RoCE guest (--no-guest: not)\n  \
         bench --record the fixed comparison, recorded as docs/results/ (page, JSON, plot) and the\n                 README's results block\n  \
         test           install dependencies (valgrind too), then fmt + clippy + workspace tests + `bench soak` (uds, tcp) +\n                 the fuzz targets (60 s each) + verbs suite in the soft-RoCE guest + `profile --smoke --ops ping`\n  \
         deps           install (as root) or list (otherwise) the system packages the build needs\n  \
         profile        instructions per message (callgrind), client and server, uds/tcp here, verbs in\n                 the guest (`cargo xtask profile --help`)\n  \
         fuzz           the libFuzzer targets in fuzz/ (frame decoder, RPC server, verbs engine), 60 s
                 each (`cargo xtask fuzz --help`)
  \
         docs           check the docs: links and anchors resolve, README <= 12 KiB, pages <= 20 KiB\n  \
         testbed ...    the soft-RoCE QEMU test bed (`cargo xtask testbed help`)"
    );
}

/// Time limit for each `cargo test` run of [`run_tests`] once everything is built.
const TEST_TIME_LIMIT: std::time::Duration = std::time::Duration::from_secs(20 * 60);

/// The README's test command: every check CI runs, in order, failing on the first failure.
fn run_tests(args: &[String]) -> Result<(), String> {
    let skip_verbs = args.iter().any(|a| a == "--no-verbs");
    deps::ensure_build_deps()?;
    deps::ensure_packages(deps::TEST_PACKAGES)?;
    // The C examples of transport-ffi run under memcheck; a missing valgrind fails them
    // instead of running them unchecked. Set before any thread or child exists.
    std::env::set_var("TRANSPORT_FFI_MEMCHECK", "1");
    util::run("cargo", &["fmt", "--all", "--check"])?;
    docs::run()?;
    util::run(
        "cargo",
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
    )?;
    // Build first (no time limit: a cold build on 2 cores takes a while), then run the tests
    // under a limit so that a hung test fails CI with a clear message instead of stalling it.
    util::run(
        "cargo",
        &["test", "--workspace", "--all-targets", "--no-run"],
    )?;
    util::run_with_timeout(
        "cargo",
        &["test", "--workspace", "--all-targets"],
        TEST_TIME_LIMIT,
    )?;
    util::run_with_timeout("cargo", &["test", "--workspace", "--doc"], TEST_TIME_LIMIT)?;
    // Faults over time: the server process, then a process of clients, killed (SIGKILL) every
    // 0.7 s for 10 s each, then connections reset, half-closed or cut mid-frame by a proxy, on
    // both socket transports; fails on a lost, misdelivered or leaked call, or a connection
    // the server or the proxy kept.
    util::run_with_timeout(
        "cargo",
        &["run", "-q", "-p", "bench", "--", "soak", "--seconds", "10"],
        std::time::Duration::from_secs(5 * 60),
    )?;
    // The libFuzzer targets (frame decoder, RPC server, verbs engine), 60 s each from the
    // seeds in fuzz/seeds; fails on a crash, a broken promise, a hang or a memory blow-up.
    fuzz::check()?;
    fuzz::run(&[])?;
    if skip_verbs {
        // Only for local iteration; CI never passes this flag (see .ci/run).
        eprintln!("xtask: --no-verbs given: the verbs suite did NOT run");
        return Ok(());
    }
    testbed::run_verbs_suite()?;
    // The instruction counts as a smoke: small counts, the round trip on every path and both
    // sides, no thresholds (the figures come from `cargo xtask profile` with its defaults).
    profile::run(&["--smoke".into(), "--ops".into(), "ping".into()])
}

/// The README's main command: the transport comparison. On a host without an RDMA device
/// the verbs rows are measured in the soft-RoCE guest afterwards and printed in one report
/// with the host's rows (`bench merge`); `--no-guest` skips that.
fn run_bench(args: &[String]) -> Result<(), String> {
    deps::ensure_build_deps()?;
    if args.iter().any(|a| a == "--record") {
        return record::run(args);
    }
    let no_guest = args.iter().any(|a| a == "--no-guest");
    let args: Vec<String> = args
        .iter()
        .filter(|a| *a != "--no-guest")
        .cloned()
        .collect();
    let guest = !no_guest && local_mode(&args) && wants_verbs(&args) && !has_rdma_device();
    let bench = testbed::target_dir().join("release/bench");
    let host_json = testbed::target_dir().join("bench-host.json");
    let mut full = vec!["run", "--quiet", "--release", "-p", "bench", "--"];
    full.extend(args.iter().map(String::as_str));
    let host_json_arg = host_json.to_string_lossy().into_owned();
    if guest {
        full.extend(["--json-out", &host_json_arg]);
    }
    util::run("cargo", &full)?;
    if !guest {
        return Ok(());
    }
    eprintln!(
        "\nxtask: no RDMA device on this host: measuring the verbs rows in the soft-RoCE guest \
         (QEMU software emulation: compare with perftest's figures of the same boot, not with \
         the host's rows; --no-guest skips this)"
    );
    let guest_report = testbed::bench_in_guest(&bench, &args)?.json;
    if guest_report.trim().is_empty() {
        return Err("the guest's bench printed no report to merge".into());
    }
    let guest_json = testbed::target_dir().join("bench-guest.json");
    std::fs::write(&guest_json, guest_report)
        .map_err(|e| format!("{}: {e}", guest_json.display()))?;
    eprintln!("\nxtask: this host's rows and the guest's verbs rows (marked *) in one report:\n");
    let guest_json_arg = guest_json.to_string_lossy().into_owned();
    let mut merge = vec!["merge", host_json_arg.as_str(), guest_json_arg.as_str()];
    if args.iter().any(|a| a == "--json") {
        merge.push("--json");
    }
    util::run(&bench.to_string_lossy(), &merge)
}

/// Whether `bench` runs in local mode (no subcommand, or `local`): only that mode compares
/// transports on this machine.
fn local_mode(args: &[String]) -> bool {
    !args.iter().any(|a| {
        [
            "server",
            "client",
            "scenario",
            "merge",
            "doctor",
            "help",
            "--help",
            "-h",
            "--version",
            "-V",
        ]
        .contains(&a.as_str())
    })
}

/// Whether the run includes verbs (`--transports` names it, or is not given).
fn wants_verbs(args: &[String]) -> bool {
    match args.iter().position(|a| a == "--transports") {
        Some(i) => args
            .get(i + 1)
            .is_some_and(|t| t.split(',').any(|t| t == "verbs")),
        None => !args
            .iter()
            .any(|a| a.starts_with("--transports=") && !a.contains("verbs")),
    }
}

/// Whether this host has an RDMA device (`/sys/class/infiniband` lists one).
pub(crate) fn has_rdma_device() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

#[cfg(test)]
mod tests {
    use super::{local_mode, wants_verbs};
    use crate::util::args;

    /// The guest runs only for a local comparison that includes verbs.
    #[test]
    fn the_guest_runs_for_local_comparisons_with_verbs() {
        assert!(local_mode(&args("--sizes 1K")) && wants_verbs(&args("--sizes 1K")));
        assert!(wants_verbs(&args("--transports uds,verbs")));
        assert!(!wants_verbs(&args("--transports uds,tcp")));
        assert!(!wants_verbs(&args("--transports=uds")));
        assert!(!local_mode(&args("client host")));
        assert!(!local_mode(&args("merge a.json b.json")));
    }
}
