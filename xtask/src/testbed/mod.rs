//! The soft-RoCE test bed: a QEMU (TCG) guest running Debian 12's kernel with `rdma_rxe`, in
//! which the verbs tests run against a real verbs device (`rxe0`), and with `siw` (soft-iWARP,
//! built on the host: [`siw`]) as a second device, `siw0`. The host needs no RDMA.
//!
//! ```text
//! cargo xtask testbed help
//! cargo xtask testbed fetch       download + unpack the packages, build the initramfs (cached)
//! cargo xtask testbed smoke       boot, run the smoke suite (ibv_devices, ibv_devinfo,
//!                                 ibv_rc_pingpong, ib_send_bw, ib_write_bw, ib_send_lat,
//!                                 ib_send_bw -R over rdma_cm, rping; then over siw0 through
//!                                 rdma_cm: ib_send_bw, ib_write_bw, ib_read_bw, ib_send_lat,
//!                                 rping)
//! cargo xtask testbed verbs       build transport-verbs' test binaries; one boot per target
//!                                 (rxe0, rxe0 with registration exposure, siw0), each running
//!                                 each test binary with TRANSPORT_VERBS_REQUIRE_DEVICE=1 and
//!                                 --include-ignored (the device tests are ignored elsewhere;
//!                                 the first boot runs the smoke suite before)
//! cargo xtask testbed run [--timeout S] [--deadline S] [--file PATH]... -- 'CMD' ['CMD'...]
//!                                 boot and run each shell command line in the guest (files
//!                                 given with --file appear as /mnt/host/bin/NAME)
//! cargo xtask testbed two-hosts [--timeout S] [--file PATH]... [--server 'CMD'] [--client 'CMD']
//!                                 two guests on a virtual wire; the server command runs in A,
//!                                 the client in B ($TB_PEER is the other guest's address);
//!                                 default: ib_send_bw between them
//! ```
//!
//! In the guest every command sees `TB_DEV=rxe0`, `TB_GID_INDEX` (the IPv4 RoCE v2 GID, looked
//! up), `TB_IP_ADDR`, `TB_PEER` (two-hosts), `TB_SIW_DEV=siw0`, `TB_SIW_IP` (10.78.0.1 on
//! `dummy1`, `TB_SIW_NETDEV`), memlock unlimited, `/mnt/host` (the share).
//!
//! Cache: `$TESTBED_CACHE`, default `.testbed-cache/` at the repository root: `debs/`, `root/`
//! (unpacked), `vmlinux`, `siw/siw.ko` (+ `siw.stamp`), `initramfs.cpio` (+ `.stamp`),
//! `logs/<command>-<time>.log`, `runs/` (per-run shares, removed after the run).
//!
//! Time bounds: each step/command runs under `timeout -s KILL` in the guest (default 120 s,
//! `--timeout`); the guest's whole script under the sum plus a margin; the host kills QEMU's
//! process group when the guest is not ready within [`guest::BOOT_TIMEOUT`] or past the hard
//! deadline (script bound + boot allowance, `--deadline`). A result counts only when the guest
//! printed `TESTBED-RESULT rc=0` and QEMU exited through isa-debug-exit with that status.
//! See `docs/testbed.md`.

mod c_abi;
mod fetch;
mod guest;
mod initramfs;
mod modules;
mod script;
mod siw;
pub(crate) mod sys;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) use guest::DATA;
use guest::{GuestSpec, Log, Outcome, Wire};
use script::{RunScript, SMOKE_STEPS};

/// Per-step timeout in the guest unless `--timeout` says otherwise.
const STEP_TIMEOUT: u32 = 120;
/// Per smoke pair (TCG: the 64 KiB × 1000 bandwidth runs take a few seconds).
const SMOKE_TIMEOUT: u32 = 90;
/// Per verbs test binary.
const TEST_TIMEOUT: u32 = 300;
/// Host allowance on top of the guest script's bound: boot, module loading, shutdown.
const HOST_MARGIN: Duration = Duration::from_secs(120);

/// The cache directory: `$TESTBED_CACHE` or `<repo>/.testbed-cache`.
fn cache_dir() -> PathBuf {
    match std::env::var_os("TESTBED_CACHE") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => repo_root().join(".testbed-cache"),
    }
}

/// Cargo's target directory for this workspace (`$CARGO_TARGET_DIR` or `target/`).
pub(crate) fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"))
}

pub(crate) fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The fetched packages, the built siw module and the built initramfs.
struct Bed {
    cache: PathBuf,
    fetched: fetch::Fetched,
    initramfs: initramfs::Initramfs,
}

impl Bed {
    fn prepare() -> Result<Bed, String> {
        let cache = cache_dir();
        let started = Instant::now();
        let fetched = fetch::ensure(&cache)?;
        let siw = siw::ensure(&fetched, &cache)?;
        let initramfs = initramfs::ensure(&fetched, &siw, &cache)?;
        eprintln!(
            "testbed: cache {} ready in {:.1}s (kernel {})",
            cache.display(),
            started.elapsed().as_secs_f64(),
            fetched.kver
        );
        Ok(Bed {
            cache,
            fetched,
            initramfs,
        })
    }

    /// A fresh share directory (`runs/<time>-<pid>`) with `bin/` and `lib/`.
    fn new_share(&self) -> Result<Share, String> {
        // Shares of runs whose process is gone (killed before its cleanup) are removed.
        if let Ok(entries) = fs::read_dir(self.cache.join("runs")) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let alive = name
                    .rsplit('-')
                    .next()
                    .is_some_and(|pid| Path::new("/proc").join(pid).exists());
                if !alive {
                    let _ = fs::remove_dir_all(e.path());
                }
            }
        }
        let dir =
            self.cache
                .join("runs")
                .join(format!("{}-{}", guest::timestamp(), std::process::id()));
        for d in ["bin", "lib"] {
            fs::create_dir_all(dir.join(d)).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        Ok(Share { dir })
    }

    /// Copies `file` into the share's `bin/` (and the libraries it needs that the initramfs
    /// lacks into `lib/`); returns its guest path.
    fn stage(&self, share: &Share, file: &Path) -> Result<String, String> {
        let name = file
            .file_name()
            .ok_or_else(|| format!("not a file: {}", file.display()))?
            .to_string_lossy()
            .into_owned();
        let dest = share.dir.join("bin").join(&name);
        if fs::hard_link(file, &dest).is_err() {
            fs::copy(file, &dest).map_err(|e| format!("{}: {e}", file.display()))?;
        }
        for (soname, src) in initramfs::shared_libs(&self.fetched, file)? {
            if !self.initramfs.libs.contains(&soname) {
                fs::copy(&src, share.dir.join("lib").join(&soname))
                    .map_err(|e| format!("{}: {e}", src.display()))?;
            }
        }
        Ok(format!("/mnt/host/bin/{name}"))
    }

    fn boot(&self, specs: Vec<GuestSpec>, log: &Arc<Log>) -> Result<Vec<Outcome>, String> {
        guest::run(&self.fetched, &self.initramfs.path, specs, log)
    }
}

/// A per-run share; removed on drop.
struct Share {
    dir: PathBuf,
}

impl Share {
    fn write(&self, name: &str, text: &str) -> Result<(), String> {
        fs::write(self.dir.join(name), text).map_err(|e| format!("{name}: {e}"))
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn single_guest(share: &Share, script_secs: u32, deadline: Option<Duration>) -> GuestSpec {
    GuestSpec {
        label: String::new(),
        params: vec![
            ("if".into(), "dummy0".into()),
            ("ip".into(), "10.77.0.1/24".into()),
            ("timeout".into(), script_secs.to_string()),
            ("script".into(), "run.sh".into()),
            ("share".into(), "1".into()),
        ],
        share: Some(share.dir.clone()),
        wire: None,
        deadline: deadline
            .unwrap_or_else(|| Duration::from_secs(u64::from(script_secs)) + HOST_MARGIN),
        ends_with: None,
    }
}

/// Prints and logs the step table and the benchmark figures; Err unless every guest passed.
fn report(outcomes: &[Outcome], log: &Arc<Log>, started: Instant) -> Result<(), String> {
    let mut lines = vec![String::new(), "testbed: summary".to_owned()];
    for o in outcomes {
        let who = if o.label.is_empty() {
            String::new()
        } else {
            format!("[{}] ", o.label)
        };
        if let Some(r) = o.ready_after {
            lines.push(format!(
                "  {who}rxe0 and siw0 ready {:.1}s after QEMU start",
                r.as_secs_f64()
            ));
        }
        for (step, how) in o.steps() {
            lines.push(format!("  {who}{step:<24} {how}"));
        }
        for (step, fig) in o.figures() {
            lines.push(format!("  {who}figure {step}: {fig}"));
        }
        lines.push(format!("  {}", o.describe()));
    }
    lines.push(format!(
        "  wall time {:.1}s; log {}",
        started.elapsed().as_secs_f64(),
        log.path().display()
    ));
    for l in &lines {
        println!("{l}");
        log.line(l);
    }
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|o| !o.ok())
        .map(Outcome::describe)
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} (log: {})",
            failed.join("; "),
            log.path().display()
        ))
    }
}

/// `cargo xtask testbed ARGS`.
pub fn main(args: &[String]) -> Result<(), String> {
    let (cmd, rest) = match args.split_first() {
        Some((c, r)) => (c.as_str(), r),
        None => ("help", &[][..]),
    };
    // `cargo xtask testbed verbs --help` prints help: it does not start a 20-minute run.
    if rest.iter().any(|a| a == "--help" || a == "-h") {
        println!("{}", help());
        return Ok(());
    }
    if let Some(extra) = unexpected_args(cmd, rest) {
        return Err(extra);
    }
    match cmd {
        "help" | "-h" | "--help" => {
            println!("{}", help());
            Ok(())
        }
        "fetch" => Bed::prepare().map(|bed| {
            println!(
                "testbed: ready: kernel {} ({}), initramfs {}, cache {}",
                bed.fetched.kver,
                bed.fetched.kernel.display(),
                bed.initramfs.path.display(),
                bed.cache.display()
            );
        }),
        "smoke" => smoke(),
        "verbs" => run_verbs_suite(),
        "run" => run(rest),
        "two-hosts" => two_hosts(rest),
        other => Err(format!("unknown testbed command `{other}`\n{}", help())),
    }
}

/// Why `rest` cannot follow `cmd` (`fetch`, `smoke` and `verbs` take no arguments), if it
/// cannot.
fn unexpected_args(cmd: &str, rest: &[String]) -> Option<String> {
    let takes_none = matches!(cmd, "fetch" | "smoke" | "verbs");
    (takes_none && !rest.is_empty()).then(|| {
        format!(
            "`cargo xtask testbed {cmd}` takes no arguments (got `{}`)\n{}",
            rest.join(" "),
            help()
        )
    })
}

fn help() -> &'static str {
    "cargo xtask testbed <command>   (soft-RoCE + soft-iWARP QEMU guest; see docs/testbed.md)

  fetch       download and unpack the guest kernel, QEMU and rdma-core (.debs), build siw.ko
              and the initramfs; a no-op when the cache ($TESTBED_CACHE or .testbed-cache/) is
              complete
  smoke       boot the guest and run the smoke suite (device listing, ibv_rc_pingpong,
              ib_send_bw, ib_write_bw, ib_send_lat, ib_send_bw -R (rdma_cm), rping on rxe0;
              ib_send_bw, ib_write_bw, ib_read_bw, ib_send_lat and rping on siw0 (rdma_cm))
  verbs       build transport-verbs' test binaries, then boot once per target (rxe0; rxe0 with
              TRANSPORT_VERBS_EXPOSURE=registration; siw0): the smoke suite (first boot), each
              test binary with TRANSPORT_VERBS_REQUIRE_DEVICE=1 and --include-ignored (the
              device tests, ignored elsewhere), and the bench's verbs rows;
              fails unless all of it ran and passed against every target
  run [--timeout S] [--deadline S] [--file PATH]... -- 'CMD' ['CMD'...]
              boot and run each shell command line in the guest, each under `timeout S`
              (default 120); --file copies a host file to /mnt/host/bin/NAME; --deadline is the
              host's hard limit for the whole guest
  two-hosts [--timeout S] [--file PATH]... [--server 'CMD'] [--client 'CMD']
              two guests joined by a virtual wire (a socket pair): the server command runs in guest A, the client in
              guest B (use $TB_PEER for A's address); default: ib_send_bw from B to A

  in the guest: $TB_DEV (rxe0), $TB_GID_INDEX (IPv4 RoCE v2 GID, looked up), $TB_IP_ADDR,
  $TB_PEER, $TB_SIW_DEV (siw0), $TB_SIW_IP (10.78.0.1 on dummy1); memlock unlimited; logs in
  <cache>/logs/"
}

fn smoke() -> Result<(), String> {
    let started = Instant::now();
    let bed = Bed::prepare()?;
    let share = bed.new_share()?;
    let mut s = RunScript::default();
    script::smoke(&mut s, SMOKE_TIMEOUT);
    share.write("run.sh", &s.finish())?;
    let log = Log::create(&bed.cache.join("logs"), "smoke")?;
    let secs = SMOKE_TIMEOUT * SMOKE_STEPS + 30;
    let outcomes = bed.boot(vec![single_guest(&share, secs, None)], &log)?;
    report(&outcomes, &log, started)
}

struct RunOpts {
    timeout: u32,
    deadline: Option<Duration>,
    files: Vec<PathBuf>,
    commands: Vec<String>,
    server: Option<String>,
    client: Option<String>,
}

fn parse_opts(args: &[String], two_hosts: bool) -> Result<RunOpts, String> {
    let mut o = RunOpts {
        timeout: STEP_TIMEOUT,
        deadline: None,
        files: Vec::new(),
        commands: Vec::new(),
        server: None,
        client: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match a.as_str() {
            "--timeout" => {
                o.timeout = value("--timeout")?
                    .parse()
                    .map_err(|e| format!("--timeout: {e}"))?;
            }
            "--deadline" => {
                let s: u64 = value("--deadline")?
                    .parse()
                    .map_err(|e| format!("--deadline: {e}"))?;
                o.deadline = Some(Duration::from_secs(s));
            }
            "--file" => o.files.push(PathBuf::from(value("--file")?)),
            "--server" if two_hosts => o.server = Some(value("--server")?),
            "--client" if two_hosts => o.client = Some(value("--client")?),
            "--" if !two_hosts => {
                o.commands.extend(it.by_ref().cloned());
            }
            other => return Err(format!("unexpected argument `{other}`\n{}", help())),
        }
    }
    Ok(o)
}

fn run(args: &[String]) -> Result<(), String> {
    let started = Instant::now();
    let o = parse_opts(args, false)?;
    if o.commands.is_empty() {
        return Err("nothing to run: `cargo xtask testbed run -- 'CMD' ...`".into());
    }
    let bed = Bed::prepare()?;
    let share = bed.new_share()?;
    for f in &o.files {
        let guest_path = bed.stage(&share, f)?;
        eprintln!("testbed: {} -> {guest_path}", f.display());
    }
    let mut s = RunScript::default();
    for (i, c) in o.commands.iter().enumerate() {
        s.step(&format!("cmd{}", i + 1), o.timeout, c);
    }
    share.write("run.sh", &s.finish())?;
    let log = Log::create(&bed.cache.join("logs"), "run")?;
    let n = u32::try_from(o.commands.len()).unwrap_or(u32::MAX);
    let secs = o.timeout.saturating_mul(n).saturating_add(30);
    let outcomes = bed.boot(vec![single_guest(&share, secs, o.deadline)], &log)?;
    report(&outcomes, &log, started)
}

fn two_hosts(args: &[String]) -> Result<(), String> {
    let started = Instant::now();
    let o = parse_opts(args, true)?;
    let bed = Bed::prepare()?;
    let share = bed.new_share()?;
    for f in &o.files {
        let guest_path = bed.stage(&share, f)?;
        eprintln!("testbed: {} -> {guest_path}", f.display());
    }
    const BW: &str = "ib_send_bw -d rxe0 -i 1 -x $TB_GID_INDEX -F -n 1000 -s 65536 --report_gbits";
    let server = o.server.clone().unwrap_or_else(|| BW.to_owned());
    let client = o.client.clone().unwrap_or_else(|| format!("{BW} $TB_PEER"));
    let mut a = RunScript::default();
    a.step("server", o.timeout, &server);
    share.write("a.sh", &a.finish())?;
    let mut b = RunScript::default();
    b.remote_client("client", o.timeout, &client);
    share.write("b.sh", &b.finish())?;

    let (wa, wb) = std::os::unix::net::UnixStream::pair()
        .map_err(|e| format!("socket pair for the wire: {e}"))?;
    let (wa, wb) = (std::sync::Arc::new(wa), std::sync::Arc::new(wb));
    let secs = o.timeout.saturating_add(60);
    let deadline = o
        .deadline
        .unwrap_or_else(|| Duration::from_secs(u64::from(secs)) + HOST_MARGIN);
    let spec = |label: &str,
                me: u8,
                peer: u8,
                end: &std::sync::Arc<std::os::unix::net::UnixStream>,
                script: &str| GuestSpec {
        label: label.into(),
        params: vec![
            ("if".into(), "eth0".into()),
            ("ip".into(), format!("10.77.0.{me}/24")),
            ("peer".into(), format!("10.77.0.{peer}")),
            ("timeout".into(), secs.to_string()),
            ("script".into(), script.into()),
            ("share".into(), "1".into()),
        ],
        share: Some(share.dir.clone()),
        wire: Some(Wire {
            end: end.clone(),
            mac: format!("52:54:00:77:00:{me:02x}"),
        }),
        deadline,
        // The server guest runs for the client only: it ends when the client guest does.
        ends_with: (me == 1).then(|| "B".to_owned()),
    };
    let log = Log::create(&bed.cache.join("logs"), "two-hosts")?;
    let outcomes = bed.boot(
        vec![spec("A", 1, 2, &wa, "a.sh"), spec("B", 2, 1, &wb, "b.sh")],
        &log,
    )?;
    report(&outcomes, &log, started)
}

/// Test binaries of other crates whose `verbs::` cases run in the guest (the same test bodies
/// as their uds/tcp cases): (package, test target).
const VERBS_VARIANT_TESTS: &[(&str, &str)] = &[
    ("transport-stream", "stream"),
    ("transport-tarpc", "tarpc"),
    ("grpc-demo", "grpc"),
    ("bench", "scenarios"),
];

/// The verbs test executables, each with the libtest filter to run it with: every integration
/// test of `cargo test -p transport-verbs --no-run`, and the `verbs::` cases of [`VERBS_VARIANT_TESTS`].
fn build_verbs_tests() -> Result<Vec<(PathBuf, Option<&'static str>)>, String> {
    // Integration tests only: the library's unit tests (the sans-IO engine, codecs) need no
    // device and run on the host with the rest of the workspace.
    let mut exes: Vec<_> = build_test_exes(&["-p", "transport-verbs", "--test", "*"])?
        .into_iter()
        .map(|e| (e, None))
        .collect();
    for (package, test) in VERBS_VARIANT_TESTS {
        for e in build_test_exes(&["-p", package, "--test", test])? {
            exes.push((e, Some("verbs::")));
        }
    }
    Ok(exes)
}

/// Builds the bench binary (debug profile: the smoke run checks that it works, not its speed).
fn build_bench_debug() -> Result<PathBuf, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "-p", "bench", "--bin", "bench"])
        .current_dir(repo_root())
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err(format!("building bench failed ({status})"));
    }
    Ok(target_dir().join("debug/bench"))
}

/// The test executables of `cargo test <selection> --no-run`.
fn build_test_exes(selection: &[&str]) -> Result<Vec<PathBuf>, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let what = selection.join(" ");
    eprintln!("testbed: $ cargo test {what} --no-run --message-format=json");
    let out = Command::new(cargo)
        .arg("test")
        .args(selection)
        .args(["--no-run", "--message-format=json-render-diagnostics"])
        .current_dir(repo_root())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "building the tests of `{what}` failed ({})",
            out.status
        ));
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["reason"] == "compiler-artifact" && v["profile"]["test"] == true {
            if let Some(exe) = v["executable"].as_str() {
                exes.push(PathBuf::from(exe));
            }
        }
    }
    exes.sort();
    exes.dedup();
    if exes.is_empty() {
        return Err(format!("cargo reported no test executable for `{what}`"));
    }
    Ok(exes)
}

/// Options of `bench` the guest run sets itself (value-taking ones drop their value too).
const GUEST_BENCH_OWN: &[&str] = &["--transports", "--pin", "--plot"];
/// Flags of `bench` that make no sense in the guest (its output goes to the terminal).
const GUEST_BENCH_DROP: &[&str] = &["--json"];

/// The arguments for `bench` in the guest: the user's, without the options the guest sets,
/// plus `--transports verbs --pin none` and sizes and counts that finish in a few minutes
/// under emulation (unless the user chose them).
pub fn guest_bench_args(user: &[String]) -> Vec<String> {
    let mut out: Vec<String> = vec![
        "--transports".into(),
        "verbs".into(),
        "--pin".into(),
        "none".into(),
    ];
    let mut it = user.iter();
    while let Some(a) = it.next() {
        let name = a.split('=').next().unwrap_or(a);
        if GUEST_BENCH_OWN.contains(&name) {
            if !a.contains('=') {
                it.next();
            }
            continue;
        }
        if GUEST_BENCH_DROP.contains(&name) {
            continue;
        }
        out.push(a.clone());
    }
    let given = |flag: &str| {
        user.iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
    };
    if !given("--sizes") && !given("--full") {
        out.extend(["--sizes".into(), "64K,1M".into()]);
    }
    if !given("--bytes") {
        out.extend(["--bytes".into(), "20M".into()]);
    }
    if !given("--pings") {
        out.extend(["--pings".into(), "6000".into()]);
    }
    if !given("--no-progress") {
        out.push("--no-progress".into());
    }
    out
}

/// The value of the bench's `--verbs-device` in `args` (`--verbs-device X` or `=X`), if given.
pub fn verbs_device(args: &[String]) -> Option<String> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--verbs-device" {
            return it.next().cloned();
        }
        if let Some(v) = a.strip_prefix("--verbs-device=") {
            return Some(v.to_owned());
        }
    }
    None
}

/// How perftest uses a guest device: its options (device, and the RoCE GID or rdma_cm) and
/// the address its server listens on (a guest variable).
fn perftest_device(dev: &str) -> Result<(&'static str, &'static str), String> {
    match dev {
        "rxe0" => Ok(("-d rxe0 -x $TB_GID_INDEX", "$TB_IP_ADDR")),
        // iWARP connects through rdma_cm only.
        "siw0" => Ok(("-d siw0 -R", "$TB_SIW_IP")),
        other => Err(format!(
            "--verbs-device {other}: the guest has rxe0 (soft-RoCE) and siw0 (soft-iWARP)"
        )),
    }
}

/// `cargo xtask bench` on a host without RDMA: boots the soft-RoCE guest and runs perftest's
/// `ib_send_lat` (2 B), `ib_send_bw` (64 KiB), `ib_write_bw` (64 KiB, 1 MiB; one way and both
/// ways at once) and `ib_read_bw` (64 KiB, 1 MiB), then the
/// bench's verbs rows (`bench` built for the host, shared read-only), all in one boot.
/// Figures under emulation mean nothing absolute: compare them with perftest's of the same boot.
/// perftest runs on the bench's `--verbs-device` (`rxe0` when not given, `siw0` through
/// rdma_cm), which the guest's bench receives with the user's other arguments.
///
/// Returns the guest bench's report as JSON (its `--json-out`), for `bench merge`, and
/// perftest's result rows as `(step, figure)`.
pub fn bench_in_guest(bench: &Path, user_args: &[String]) -> Result<GuestBench, String> {
    let started = Instant::now();
    let dev = verbs_device(user_args).unwrap_or_else(|| "rxe0".into());
    let (dev_opts, addr) = perftest_device(&dev)?;
    let bed = Bed::prepare()?;
    let share = bed.new_share()?;
    let guest = bed.stage(&share, bench)?;
    let mut s = RunScript::default();
    // perftest: a server in the background, the client against it; only its result rows.
    let pair = |cmd: &str| {
        format!(
            "{cmd} >/dev/null 2>&1 & sleep 1; {cmd} {addr} | grep -E '^ *#bytes|^ *[0-9]+ +[0-9]+'; wait"
        )
    };
    s.step(
        "perftest:ib_send_lat-2B",
        120,
        &format!(
            "{}; echo '(perftest latency = half a round trip: compare 2 x t_typical with the \
             round trips of the bench)'",
            pair(&format!("ib_send_lat {dev_opts} -s 2 -n 5000"))
        ),
    );
    s.step(
        "perftest:ib_send_bw-64K",
        120,
        &pair(&format!(
            "ib_send_bw {dev_opts} -F -n 2000 -s 65536 --report_gbits"
        )),
    );
    s.step(
        "perftest:ib_write_bw-64K",
        120,
        &pair(&format!(
            "ib_write_bw {dev_opts} -F -n 2000 -s 65536 --report_gbits"
        )),
    );
    s.step(
        "perftest:ib_write_bw-1M",
        120,
        &pair(&format!(
            "ib_write_bw {dev_opts} -F -n 300 -s 1048576 --report_gbits"
        )),
    );
    // Both directions at once (`-b`): what an echo row, which carries its payload both ways,
    // compares with (per direction, half of the reported sum).
    for (name, size, n) in [("64K", 65536, 2000), ("1M", 1048576, 300)] {
        s.step(
            &format!("perftest:ib_write_bw-{name}-bidirectional"),
            120,
            &pair(&format!(
                "ib_write_bw {dev_opts} -F -b -n {n} -s {size} --report_gbits"
            )),
        );
    }
    // The bench's own link stream reads (see transport_verbs::link): its perftest twin.
    for (name, size, n) in [("64K", 65536, 2000), ("1M", 1048576, 300)] {
        s.step(
            &format!("perftest:ib_read_bw-{name}"),
            120,
            &pair(&format!(
                "ib_read_bw {dev_opts} -F -n {n} -s {size} --report_gbits"
            )),
        );
    }
    let args: Vec<String> = guest_bench_args(user_args)
        .iter()
        .map(|a| script::sh_quote(a))
        .collect();
    const BENCH_SECS: u32 = 1500;
    // The report goes to the host as data lines (not shown), for `bench merge`.
    s.step(
        "bench:verbs",
        BENCH_SECS,
        &format!(
            "{guest} {} --json-out /tmp/bench-guest.json && sed 's/^/{}/' /tmp/bench-guest.json",
            args.join(" "),
            guest::DATA
        ),
    );
    share.write("run.sh", &s.finish())?;
    let log = Log::create(&bed.cache.join("logs"), "bench")?;
    let outcomes = bed.boot(
        vec![single_guest(&share, 8 * 120 + BENCH_SECS + 30, None)],
        &log,
    )?;
    report(&outcomes, &log, started)?;
    Ok(GuestBench {
        json: outcomes.iter().map(guest::Outcome::data).collect(),
        perftest: outcomes
            .iter()
            .flat_map(guest::Outcome::figures)
            .filter(|(step, _)| step.starts_with("perftest:"))
            .collect(),
    })
}

/// Runs the shell script `script` (busybox `sh`) in one guest boot as step `step`, bounded
/// by `secs`, with `files` staged in `/mnt/host/bin`; returns the data lines it printed
/// ([`guest::DATA`] prefix removed). `cargo xtask profile` measures through it.
pub fn script_in_guest(
    files: &[PathBuf],
    step: &str,
    secs: u32,
    script: &str,
) -> Result<String, String> {
    let started = Instant::now();
    let bed = Bed::prepare()?;
    let share = bed.new_share()?;
    for f in files {
        bed.stage(&share, f)?;
    }
    share.write("step.sh", script)?;
    let mut s = RunScript::default();
    s.step(step, secs, "sh /mnt/host/step.sh");
    share.write("run.sh", &s.finish())?;
    let log = Log::create(&bed.cache.join("logs"), step)?;
    let outcomes = bed.boot(vec![single_guest(&share, secs + 30, None)], &log)?;
    report(&outcomes, &log, started)?;
    Ok(outcomes.iter().map(guest::Outcome::data).collect())
}

/// What [`bench_in_guest`] brings back from the guest.
pub struct GuestBench {
    /// The bench's report, as JSON.
    pub json: String,
    /// perftest's result rows of the same boot, `(step, figure)`.
    pub perftest: Vec<(String, String)>,
}

/// A device and environment the whole verbs suite runs against, in a guest boot of its own
/// (about 3 s each; no state left by one target's tests reaches the next).
#[derive(Debug)]
struct Target {
    /// Names the target's log (`verbs-<tag>-<time>.log`).
    tag: &'static str,
    /// The device its tests must open (the device test's report is checked).
    dev: &'static str,
    /// How it differs from the plain device, for the summary line.
    note: &'static str,
    /// Shell lines at the top of its guest script: the variables its tests and bench read.
    setup: &'static [&'static str],
}

impl Target {
    /// `siw0`, `rxe0 (exposure: registration)`.
    fn label(&self) -> String {
        format!("{}{}", self.dev, self.note)
    }
}

/// The targets of [`run_verbs_suite`], in order; the smoke suite runs in the first one's boot.
const TARGETS: &[Target] = &[
    Target {
        tag: "rxe0",
        dev: "rxe0",
        note: "",
        setup: &[],
    },
    // Rendezvous payloads exposed through registrations instead of memory windows (the mode
    // devices without type-2 windows use), on the same device.
    Target {
        tag: "rxe0-registration",
        dev: "rxe0",
        note: " (exposure: registration)",
        setup: &["export TRANSPORT_VERBS_EXPOSURE=registration"],
    },
    // soft-iWARP: the tests listen on $TB_IP_ADDR, which rdma_cm maps to siw0. iWARP has no
    // RoCE GID: no GID index is given.
    Target {
        tag: "siw0",
        dev: "siw0",
        note: "",
        setup: &[
            r#"export TB_DEV="$TB_SIW_DEV" TB_NETDEV="$TB_SIW_NETDEV" TB_IP_ADDR="$TB_SIW_IP""#,
            "unset TB_GID_INDEX",
        ],
    },
];

/// The most one target's guest script may take: a target whose tests hang (each binary may
/// take [`TEST_TIMEOUT`]) is cut off here, so that `cargo xtask test` stays within CI's time.
const TARGET_BUDGET: u32 = 1200;

/// A verbs test binary staged in the share: its step name and guest command line.
struct Staged {
    name: String,
    cmdline: String,
}

/// Runs the verbs test suite in the guest against each of [`TARGETS`]. Fails (never skips)
/// when the bed cannot run.
///
/// Builds transport-verbs' test binaries (and the `verbs::` variants of transport-stream's,
/// grpc-demo's and bench's per-transport tests) on the host, then boots the guest once per
/// target: the first boot runs the smoke suite, each runs every test binary with
/// `TRANSPORT_VERBS_REQUIRE_DEVICE=1`, `--include-ignored` (the tests that need a device are
/// ignored by default) and the target's variables, and the bench's verbs rows
/// once. A target passes only when the guest reported success, every step passed, each binary
/// printed libtest's `test result: ok.` and at least one test passed, and the device test
/// reported opening the target's device. Every target runs, whatever the previous ones did;
/// the result is Ok only when all of them passed.
pub fn run_verbs_suite() -> Result<(), String> {
    let started = Instant::now();
    crate::deps::ensure_build_deps()?;
    let exes = build_verbs_tests()?;
    let bench = build_bench_debug()?;
    let c_examples = c_abi::build()?;
    let bed = Bed::prepare()?;
    let share = bed.new_share()?;
    let mut tests = Vec::new();
    let mut removal = None;
    for (exe, filter) in &exes {
        let guest_path = bed.stage(&share, exe)?;
        let filter = filter.unwrap_or_default();
        let name = exe
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let staged = Staged {
            name: format!("test:{name}"),
            cmdline: format!(
                "TRANSPORT_VERBS_REQUIRE_DEVICE=1 {guest_path} --test-threads=1 --nocapture --include-ignored {filter}"
            ),
        };
        // Deletes the device: the last step of each boot (see `run_target`).
        if name.starts_with(REMOVAL_TEST) {
            removal = Some(staged);
        } else {
            tests.push(staged);
        }
    }
    let removal = removal.ok_or("transport-verbs' device removal test was not built")?;
    let guest_bench = bed.stage(&share, &bench)?;
    let guest_c = c_examples
        .iter()
        .map(|e| bed.stage(&share, e))
        .collect::<Result<Vec<_>, _>>()?;
    let c_step = c_abi::step(&guest_c);
    let mut lines = Vec::new();
    let mut failed = Vec::new();
    for (i, target) in TARGETS.iter().enumerate() {
        let started = Instant::now();
        let suite = Suite {
            tests: &tests,
            removal: &removal,
            guest_bench: &guest_bench,
            c_step: &c_step,
        };
        let verdict = run_target(&bed, &share, target, i == 0, &suite);
        let took = started.elapsed().as_secs_f64();
        match verdict {
            Ok(passed) => lines.push(format!(
                "testbed: verbs suite passed: {passed} tests in {} binaries against {} \
                 (guest {took:.1}s)",
                tests.len(),
                target.label()
            )),
            Err(e) => {
                lines.push(format!(
                    "testbed: verbs suite FAILED against {} (guest {took:.1}s): {e}",
                    target.label()
                ));
                failed.push(target.label());
            }
        }
    }
    // Each target's own output scrolled by: its verdicts again, together.
    println!();
    for l in &lines {
        println!("{l}");
    }
    println!(
        "testbed: verbs suite: {} targets in {:.1}s (with the builds)",
        TARGETS.len(),
        started.elapsed().as_secs_f64()
    );
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the verbs suite failed against {}",
            failed.join(", ")
        ))
    }
}

/// What every target's boot runs, staged in the guest.
#[derive(Clone, Copy)]
struct Suite<'a> {
    /// The test binaries (their `test:` steps).
    tests: &'a [Staged],
    /// The device removal test, run last.
    removal: &'a Staged,
    /// The bench binary's guest path.
    guest_bench: &'a str,
    /// The C examples' step ([`c_abi::step`]).
    c_step: &'a str,
}

/// One target's boot: the smoke suite if `smoke`, each test binary, the bench's verbs rows,
/// the verbs soak, and last the device's removal (`removal`, which deletes the device and adds
/// it back). Returns the number of tests that passed.
fn run_target(
    bed: &Bed,
    share: &Share,
    target: &Target,
    smoke: bool,
    suite: &Suite<'_>,
) -> Result<u64, String> {
    let Suite {
        tests,
        removal,
        guest_bench,
        c_step,
    } = *suite;
    let started = Instant::now();
    let mut s = RunScript::default();
    s.raw(&format!("# verbs suite against {}", target.label()));
    for line in target.setup {
        s.raw(line);
    }
    let mut secs = 30;
    if smoke {
        script::smoke(&mut s, SMOKE_TIMEOUT);
        secs += SMOKE_TIMEOUT * SMOKE_STEPS;
    }
    let mut names = Vec::new();
    for t in tests {
        s.step(&t.name, TEST_TIMEOUT, &t.cmdline);
        names.push(t.name.clone());
    }
    // The bench's verbs rows once, as a smoke (no figure is checked): the step fails unless
    // the report printed its verbs latency row and the polling line.
    s.step(
        "bench:verbs-smoke",
        TEST_TIMEOUT,
        &format!(
            "{guest_bench} --transports verbs --verbs-device {} --pin none --ops ping,send \
             --sizes 4K --bytes 1M --pings 200 --repeat 1 --no-progress > /tmp/bench.out 2>&1; \
             rc=$?; cat /tmp/bench.out; [ $rc = 0 ] && grep -q '^  verbs .*[0-9]' /tmp/bench.out \
             && grep -q 'verbs *polling: adaptive' /tmp/bench.out",
            target.dev
        ),
    );
    // transport-ffi's C examples over verbs: echo, the poll(2) server with a client that
    // connects without blocking, RPC with a C handler.
    s.step("c:verbs-examples", TEST_TIMEOUT, c_step);
    // Faults over time on verbs (`bench soak`): the server process SIGKILLed and restarted
    // under 4 clients, then the clients' process, then queue pairs forced to error one at a
    // time, then the device deleted under verbs and Unix-socket clients and added back; fails on a lost, misdelivered or leaked call, a
    // connection, descriptor, task or lent buffer kept, or a removal that does not finish.
    // Every 1.5 s: a debug build under emulation takes a while to listen again.
    s.step(
        "bench:verbs-soak",
        TEST_TIMEOUT,
        &format!(
            "{guest_bench} soak --transports verbs --verbs-addr \"$TB_IP_ADDR:7471\" \
             --seconds 10 --clients 4 --kill-every-ms 1500 --kill server,client,qp,device \
             --remove-device \"$TB_DEV:$TB_NETDEV\""
        ),
    );
    // The device deleted while connections run, then added back (transport-verbs'
    // tests/device_removal.rs): last, as it takes the device away for a moment.
    s.step(
        &removal.name,
        TEST_TIMEOUT,
        &format!(
            "TRANSPORT_VERBS_REMOVE_DEVICE=\"$TB_DEV\" TRANSPORT_VERBS_REMOVE_NETDEV=\"$TB_NETDEV\" {}",
            removal.cmdline
        ),
    );
    names.push(removal.name.clone());
    let n = u32::try_from(tests.len()).unwrap_or(u32::MAX);
    secs += TEST_TIMEOUT.saturating_mul(n.saturating_add(4));
    share.write("run.sh", &s.finish())?;
    let log = Log::create(&bed.cache.join("logs"), &format!("verbs-{}", target.tag))?;
    log.line(&format!("testbed: verbs suite against {}", target.label()));
    let outcomes = bed.boot(
        vec![single_guest(share, secs.min(TARGET_BUDGET), None)],
        &log,
    )?;
    let o = &outcomes[0];
    let guest = report(&outcomes, &log, started);
    // The steps' own verdicts name what failed better than the guest's status does.
    let ran = check_tests_ran(o, &names, target, &log);
    let budget_spent = o.rc == Some(137) && secs > TARGET_BUDGET;
    match (guest, ran) {
        (Ok(()), Ok(n)) => Ok(n),
        (_, Err(e)) | (Err(e), Ok(_)) if budget_spent => Err(format!(
            "{e}; the guest script was killed when the target's budget of {TARGET_BUDGET}s ran out"
        )),
        (_, Err(e)) | (Err(e), Ok(_)) => Err(e),
    }
}

/// Test binaries that must pass at least this many tests in the guest: a suite that skipped
/// itself (no device) or lost cases fails the run instead of passing quietly.
const MIN_PASSED: &[(&str, u64)] = &[
    // transport-test's conformance suite: 20 cases + the capability check.
    ("test:conformance-", 21),
    // transport-stream's byte-stream cases and grpc-demo's tonic + native cases, `verbs::` only.
    ("test:stream-", 9),
    ("test:grpc-", 7),
    // transport-tarpc's cases (tarpc on the transport's messages), `verbs::` only.
    ("test:tarpc-", 7),
    // bench's middleware-scenario plumbing (typed payloads, many clients, ORB shape).
    ("test:scenarios-", 5),
    // transport-verbs' hostile-peer cases (lengths, RTS flood, eager flood, no HELLO, no FIN,
    // stale and leaked rkeys, a loopback listen refused).
    ("test:hostile-", 8),
    // transport-test's RPC-level hostile-peer cases (reused id, close with parked handlers,
    // per-connection and server request budgets, idle timeout).
    ("test:hostile_rpc-", 5),
    // transport-verbs' adaptive polling (no channel syscalls within the budget, idle = asleep).
    ("test:polling-", 2),
    // transport-verbs' memory per connection (bounded; pool and shared receive queue belong to
    // the device; more credits than shared buffers lose nothing; the queue refills).
    ("test:memory-", 4),
    // transport-verbs' link figures (busy-polled SEND ping-pong, RDMA READ stream).
    ("test:link-", 2),
    // transport-verbs' thousand connection pairs in one process, a call each.
    ("test:scale-", 1),
    // transport-verbs under RLIMIT_MEMLOCK: the defaults connect under 8 MiB (the shared
    // receive queue fitted), then a registration beyond 16 MiB is a typed error.
    ("test:memlock-", 1),
    // A queue pair forced to error: pending calls fail; mid-rendezvous, the reader's or the
    // sender's: both ends fail typed and give every buffer back.
    ("test:failures-", 3),
    // The device deleted under running connections, given back, added again.
    ("test:device_removal-", 1),
];

/// The test binary that removes the device (run last in each boot).
const REMOVAL_TEST: &str = "device_removal-";

/// The guest passing is not enough: each test binary must have run and passed tests, and the
/// device test must have opened the target's device. Returns the number of tests passed.
fn check_tests_ran(
    o: &Outcome,
    names: &[String],
    target: &Target,
    log: &Arc<Log>,
) -> Result<u64, String> {
    let steps = o.steps();
    let mut passed_total = 0u64;
    let mut current: Option<&str> = None;
    let mut results: Vec<(String, u64)> = Vec::new();
    for line in &o.transcript {
        if let Some(name) = line.strip_prefix(script::STEP_BEGIN) {
            current = names.iter().find(|n| *n == name).map(String::as_str);
        } else if let (Some(step), Some(rest)) = (current, line.strip_prefix("test result: ok. ")) {
            let n: u64 = rest
                .split_whitespace()
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            passed_total += n;
            results.push((step.to_owned(), n));
        }
    }
    let failed: Vec<&str> = names
        .iter()
        .filter(|name| {
            let ok = steps
                .iter()
                .any(|(s, how)| s == *name && how.starts_with("ok"));
            let reported = results.iter().any(|(s, _)| s == *name);
            !ok || !reported
        })
        .map(String::as_str)
        .collect();
    if !failed.is_empty() {
        return Err(format!(
            "{} of {} test binaries did not run to a passing `test result` in the guest: {} \
             (log: {})",
            failed.len(),
            names.len(),
            failed.join(", "),
            log.path().display()
        ));
    }
    if passed_total == 0 {
        return Err("the verbs test binaries ran but no test passed".into());
    }
    for (prefix, min) in MIN_PASSED {
        if !names.iter().any(|n| n.starts_with(prefix)) {
            return Err(format!(
                "no `{prefix}*` test binary was built for the guest (expected {min} tests)"
            ));
        }
        for (step, n) in results.iter().filter(|(s, _)| s.starts_with(prefix)) {
            if n < min {
                return Err(format!(
                    "{step} passed only {n} tests in the guest, expected at least {min} (log: {})",
                    log.path().display()
                ));
            }
        }
    }
    let opened = format!("transport-verbs device test: opened {} ", target.dev);
    if !o.transcript.iter().any(|l| l.starts_with(&opened)) {
        return Err(format!(
            "the device test did not report opening {} (log: {})",
            target.dev,
            log.path().display()
        ));
    }
    let line = format!(
        "testbed: verbs suite passed: {passed_total} tests in {} binaries against {}",
        names.len(),
        target.label()
    );
    println!("{line}");
    log.line(&line);
    Ok(passed_total)
}

#[cfg(test)]
mod tests {
    use super::{guest_bench_args, perftest_device, unexpected_args, verbs_device, TARGETS};
    use crate::util::args;

    #[test]
    fn commands_without_arguments_refuse_them() {
        for cmd in ["fetch", "smoke", "verbs"] {
            assert_eq!(unexpected_args(cmd, &[]), None, "{cmd}");
            let why = unexpected_args(cmd, &args("--only tarpc")).expect(cmd);
            assert!(
                why.contains("takes no arguments") && why.contains("--only tarpc"),
                "{why}"
            );
        }
        assert_eq!(unexpected_args("run", &args("-- true")), None);
        assert_eq!(unexpected_args("two-hosts", &args("--timeout 9")), None);
        // --help anywhere prints the help instead of running (see `main`).
        assert!(super::main(&args("verbs --help")).is_ok());
    }

    #[test]
    fn guest_bench_args_keep_the_users_choices_and_set_the_guests_own() {
        let a = guest_bench_args(&args(
            "--transports uds,tcp --ops send --pin=split --plot x.svg --json --sizes 4K --repeat 2",
        ));
        assert_eq!(
            a,
            args("--transports verbs --pin none --ops send --sizes 4K --repeat 2 --bytes 20M --pings 6000 --no-progress")
        );
    }

    #[test]
    fn guest_bench_args_default_to_a_short_sweep() {
        assert_eq!(
            guest_bench_args(&[]),
            args("--transports verbs --pin none --sizes 64K,1M --bytes 20M --pings 6000 --no-progress")
        );
        assert!(!guest_bench_args(&args("--full")).contains(&"--sizes".to_string()));
    }

    /// `--verbs-device` chooses perftest's device and reaches the guest's bench unchanged.
    #[test]
    fn the_verbs_device_reaches_perftest_and_the_guest_bench() {
        assert_eq!(verbs_device(&args("--sizes 4K")), None);
        assert_eq!(
            verbs_device(&args("--verbs-device siw0 --sizes 4K")).as_deref(),
            Some("siw0")
        );
        assert_eq!(
            verbs_device(&args("--verbs-device=rxe0")).as_deref(),
            Some("rxe0")
        );
        assert!(guest_bench_args(&args("--verbs-device siw0"))
            .windows(2)
            .any(|w| w == ["--verbs-device", "siw0"]));
        let (opts, addr) = perftest_device("siw0").unwrap();
        assert!(opts.contains("-R") && addr == "$TB_SIW_IP", "{opts} {addr}");
        let (opts, addr) = perftest_device("rxe0").unwrap();
        assert!(opts.contains("$TB_GID_INDEX") && addr == "$TB_IP_ADDR");
        assert!(perftest_device("mlx5_0").is_err());
    }

    /// Each target has its own log name, and the siw target points the tests at siw0.
    #[test]
    fn targets_are_distinct_and_the_siw_one_moves_the_address() {
        let mut tags: Vec<&str> = TARGETS.iter().map(|t| t.tag).collect();
        tags.sort_unstable();
        tags.dedup();
        assert_eq!(tags.len(), TARGETS.len());
        assert_eq!(TARGETS[0].label(), "rxe0");
        assert_eq!(TARGETS[1].label(), "rxe0 (exposure: registration)");
        let siw = TARGETS.iter().find(|t| t.dev == "siw0").unwrap();
        let setup = siw.setup.join("\n");
        assert!(setup.contains(r#"TB_IP_ADDR="$TB_SIW_IP""#), "{setup}");
        assert!(setup.contains(r#"TB_DEV="$TB_SIW_DEV""#), "{setup}");
    }
}
