//! `cargo xtask fuzz`: the libFuzzer targets in `fuzz/`, built on the stable toolchain and run
//! for a bounded time each, from the seed corpus in the repository.
//!
//! ```text
//! cargo xtask fuzz                       every target, 60 s each (what CI runs)
//! cargo xtask fuzz --seconds 600 --targets verbs_engine
//! ```
//!
//! The targets are a cargo-fuzz project (`cargo fuzz run frame_decoder` works too, on a
//! nightly toolchain). This command needs no nightly and no cargo-fuzz: it sets the
//! coverage instrumentation flags cargo-fuzz would (`-Cpasses=sancov-module` and the
//! `sanitizer-coverage` options, which stable rustc accepts), without a sanitizer, with debug
//! assertions and overflow checks on. Inputs found are kept in `target/fuzz/corpus/<target>`
//! (reused by later runs, never written into the repository); a crash leaves its input in
//! `target/fuzz/artifacts/<target>/` and fails the command with the line that reproduces it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::testbed::{repo_root, sys, target_dir};

/// The fuzz targets (`fuzz/fuzz_targets/<name>.rs`), each with seeds in `fuzz/seeds/<name>/`.
pub const TARGETS: [&str; 3] = ["frame_decoder", "rpc_server", "verbs_engine"];

/// Seconds each target runs by default (CI's figure).
const DEFAULT_SECONDS: u64 = 60;

/// The instrumentation cargo-fuzz adds (its `-s none` mode), plus the checks kept on.
const RUSTFLAGS: &[&str] = &[
    "--cfg",
    "fuzzing",
    "-Cpasses=sancov-module",
    "-Cllvm-args=-sanitizer-coverage-level=4",
    "-Cllvm-args=-sanitizer-coverage-inline-8bit-counters",
    "-Cllvm-args=-sanitizer-coverage-pc-table",
    "-Cllvm-args=-sanitizer-coverage-trace-compares",
    "-Cdebug-assertions",
    "-Coverflow-checks",
];

/// Runs `cargo xtask fuzz ARGS`.
pub fn run(args: &[String]) -> Result<(), String> {
    let mut seconds = DEFAULT_SECONDS;
    let mut targets: Vec<String> = TARGETS.iter().map(|t| t.to_string()).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => {
                seconds = it
                    .next()
                    .and_then(|s| s.parse().ok())
                    .filter(|&s| s > 0)
                    .ok_or("--seconds takes a number of seconds above 0")?;
            }
            "--targets" => {
                let list = it.next().ok_or("--targets takes a comma-separated list")?;
                targets = list.split(',').map(String::from).collect();
                if let Some(bad) = targets.iter().find(|t| !TARGETS.contains(&t.as_str())) {
                    return Err(format!("unknown fuzz target `{bad}` (known: {TARGETS:?})"));
                }
            }
            "-h" | "--help" => {
                println!(
                    "cargo xtask fuzz [--seconds N] [--targets a,b]\n\n\
                     Builds the libFuzzer targets in fuzz/ and runs each for N seconds \
                     (default {DEFAULT_SECONDS}) from its seeds in fuzz/seeds/.\n\
                     targets: {}",
                    TARGETS.join(", ")
                );
                return Ok(());
            }
            other => return Err(format!("unknown argument `{other}` to `cargo xtask fuzz`")),
        }
    }
    let bins = build()?;
    for t in &targets {
        let line = run_target(&bins.join(t), t, seconds)?;
        println!("{line}");
    }
    Ok(())
}

/// fmt and clippy on the fuzz crate (not a member of the workspace, so `cargo xtask test`'s
/// workspace checks do not cover it).
pub fn check() -> Result<(), String> {
    let manifest = repo_root().join("fuzz/Cargo.toml");
    let manifest = manifest.to_string_lossy();
    let dir = target_dir().join("fuzz/clippy");
    let dir = dir.to_string_lossy();
    crate::util::run("cargo", &["fmt", "--manifest-path", &manifest, "--check"])?;
    crate::util::run(
        "cargo",
        &[
            "clippy",
            "--locked",
            "--manifest-path",
            &manifest,
            "--target-dir",
            &dir,
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
    )
}

/// Builds every target; returns the directory holding the binaries.
fn build() -> Result<PathBuf, String> {
    let triple = host_triple()?;
    let dir = target_dir().join("fuzz");
    let manifest = repo_root().join("fuzz/Cargo.toml");
    let (manifest, dir_s) = (manifest.to_string_lossy(), dir.to_string_lossy());
    let args = [
        "build",
        "--release",
        "--locked",
        "--manifest-path",
        &manifest,
        "--target",
        &triple,
        "--target-dir",
        &dir_s,
        "--bins",
    ];
    eprintln!(
        "xtask: $ RUSTFLAGS='{}' cargo {}",
        RUSTFLAGS.join(" "),
        args.join(" ")
    );
    // `--target` keeps the flags off build scripts and proc macros (they are not fuzzed and
    // would not link with the coverage hooks).
    let status = Command::new("cargo")
        .args(args)
        .env("RUSTFLAGS", RUSTFLAGS.join(" "))
        .status()
        .map_err(|e| format!("cannot start cargo: {e}"))?;
    if !status.success() {
        return Err(format!("building the fuzz targets failed ({status})"));
    }
    Ok(dir.join(triple).join("release"))
}

/// The host's target triple (`rustc -vV`).
fn host_triple() -> Result<String, String> {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .map_err(|e| format!("cannot start rustc: {e}"))?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .ok_or_else(|| "rustc -vV printed no host triple".into())
}

/// Runs one target for `seconds`; returns its summary line, or an error naming the crash.
fn run_target(bin: &Path, name: &str, seconds: u64) -> Result<String, String> {
    let root = target_dir().join("fuzz");
    let corpus = root.join("corpus").join(name);
    let artifacts = root.join("artifacts").join(name);
    let seeds = repo_root().join("fuzz/seeds").join(name);
    for d in [&corpus, &artifacts] {
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    if !seeds.is_dir() {
        return Err(format!(
            "{}: the target's seed corpus is missing",
            seeds.display()
        ));
    }
    let log = root.join(format!("{name}.log"));
    let log_file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let args = [
        format!("-max_total_time={seconds}"),
        // An input that runs this long is a hang; one that takes this much memory, a finding.
        "-timeout=10".into(),
        "-rss_limit_mb=2048".into(),
        "-print_final_stats=1".into(),
        format!("-artifact_prefix={}/", artifacts.display()),
        corpus.display().to_string(),
        seeds.display().to_string(),
    ];
    eprintln!("xtask: $ {} {}", bin.display(), args.join(" "));
    let mut cmd = Command::new(bin);
    cmd.args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::from(log_file));
    sys::own_group_dying_with_parent(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
    // libFuzzer stops itself after `seconds`; this bound covers loading the corpus and a
    // target that stopped answering altogether.
    let limit = Duration::from_secs(seconds + 300);
    let start = Instant::now();
    let status = match crate::util::wait_or_kill(&mut child, limit) {
        Ok(Some(s)) => s,
        Ok(None) => {
            return Err(format!(
                "fuzz {name}: still running after {}s; log: {}",
                limit.as_secs(),
                log.display()
            ))
        }
        Err(e) => return Err(format!("waiting for fuzz {name}: {e}")),
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    if !status.success() {
        let tail: Vec<&str> = text.lines().rev().take(40).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        let input = text
            .lines()
            .find_map(|l| l.split("Test unit written to ").nth(1))
            .unwrap_or("(no input saved)");
        return Err(format!(
            "fuzz {name} found a failure ({status}):\n{}\n\nthe input: {input}\nreproduce: {} {input}",
            tail.join("\n"),
            bin.display()
        ));
    }
    let stat = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("stat::{key}:")))
            .map_or_else(|| "?".to_string(), |v| v.trim().to_string())
    };
    let corpus_files = std::fs::read_dir(&corpus).map_or(0, |d| d.count());
    Ok(format!(
        "fuzz {name}: {} inputs in {}s ({}/s), 0 crashes; corpus {corpus_files} inputs ({}), peak RSS {} MiB",
        stat("number_of_executed_units"),
        start.elapsed().as_secs(),
        stat("average_exec_per_sec"),
        corpus.display(),
        stat("peak_rss_mb"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every target has its source and its seeds in the repository, and only those.
    #[test]
    fn every_target_has_a_source_and_seeds() {
        let root = repo_root().join("fuzz");
        for t in TARGETS {
            assert!(
                root.join(format!("fuzz_targets/{t}.rs")).is_file(),
                "{t}: source"
            );
            let seeds = std::fs::read_dir(root.join("seeds").join(t))
                .map(|d| d.count())
                .unwrap_or(0);
            assert!(seeds > 0, "{t}: no seeds in fuzz/seeds/{t}");
        }
        let sources = std::fs::read_dir(root.join("fuzz_targets"))
            .expect("fuzz/fuzz_targets")
            .count();
        assert_eq!(
            sources,
            TARGETS.len(),
            "a target in fuzz/ that TARGETS does not run"
        );
    }
}
