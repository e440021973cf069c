//! `cargo xtask bench --record`: one run of the comparison recorded as the project's results
//! page (docs/results/: results.md, results.json, throughput.svg) and the README's headline
//! block. The run is always the same recipe ([`COMMON`] plus the host's and the guest's own
//! settings), so successive pages compare; a newer run replaces the page and git keeps the old.

use std::path::Path;
use std::process::Command;

use crate::{testbed, util};

/// What both the host and the guest measure: the latency row and the byte-sequence ops that
/// the headline shows, at one medium and one large size.
pub const COMMON: &[&str] = &[
    "--ops",
    "ping,send,oneway,echo",
    "--sizes",
    "64K,1M",
    "--repeat",
    "5",
];

/// The host's own settings: every transport, client and server on one CPU (the most
/// repeatable placement), enough bytes and pings for steady medians.
pub const HOST: &[&str] = &[
    "--transports",
    "uds,shm,tcp,verbs",
    "--pin",
    "same",
    "--bytes",
    "1000M",
    "--pings",
    "100000",
    "--no-progress",
];

/// Runs the recipe, writes docs/results/ and the README's block. `--no-guest` leaves the
/// verbs rows out on a host without RDMA; no other option is taken, so that every recorded
/// page measures the same thing.
pub fn run(args: &[String]) -> Result<(), String> {
    let no_guest = args.iter().any(|a| a == "--no-guest");
    if let Some(other) = args.iter().find(|a| *a != "--record" && *a != "--no-guest") {
        return Err(format!(
            "`--record` runs a fixed recipe and takes no other option than --no-guest (got \
             `{other}`); run `cargo xtask bench {other} ...` without --record to explore"
        ));
    }
    let root = testbed::repo_root();
    let commit = commit(&root)?;
    util::run(
        "cargo",
        &[
            "build",
            "--quiet",
            "--release",
            "-p",
            "bench",
            "--bin",
            "bench",
        ],
    )?;
    let bench = testbed::target_dir().join("release/bench");
    let bench_s = bench.to_string_lossy().into_owned();
    let dir = testbed::target_dir().join("record");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let host_json = dir.join("host.json").to_string_lossy().into_owned();
    let mut host: Vec<&str> = COMMON.to_vec();
    host.extend(HOST);
    host.extend(["--json-out", &host_json]);
    util::run(&bench_s, &host)?;

    let mut write: Vec<String> = vec![
        "results".into(),
        "write".into(),
        "--host".into(),
        host_json.clone(),
    ];
    if !no_guest && !crate::has_rdma_device() {
        eprintln!(
            "\nxtask: no RDMA device on this host: measuring the verbs rows in the soft-RoCE \
             guest beside perftest (--no-guest skips this)"
        );
        let common: Vec<String> = COMMON.iter().map(|s| s.to_string()).collect();
        let guest = testbed::bench_in_guest(&bench, &common)?;
        if guest.json.trim().is_empty() {
            return Err("the guest's bench printed no report".into());
        }
        let guest_json = dir.join("guest.json");
        let perftest = dir.join("perftest.tsv");
        let lines: String = guest
            .perftest
            .iter()
            .map(|(step, fig)| format!("{step}\t{fig}\n"))
            .collect();
        for (path, text) in [(&guest_json, &guest.json), (&perftest, &lines)] {
            std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        write.extend([
            "--guest".into(),
            guest_json.to_string_lossy().into_owned(),
            "--perftest".into(),
            perftest.to_string_lossy().into_owned(),
        ]);
    }
    let [y, m, d, hh, mm, _] = util::utc_now();
    write.extend([
        "--generated".into(),
        format!("{y:04}-{m:02}-{d:02} {hh:02}:{mm:02} UTC"),
        "--commit".into(),
        commit,
        "--command".into(),
        format!(
            "cargo xtask bench --record{}",
            if no_guest { " --no-guest" } else { "" }
        ),
        "--dir".into(),
        root.join("docs/results").to_string_lossy().into_owned(),
        "--readme".into(),
        root.join("README.md").to_string_lossy().into_owned(),
    ]);
    let write: Vec<&str> = write.iter().map(String::as_str).collect();
    util::run(&bench_s, &write)
}

/// The commit measured: its short id, and `+ uncommitted changes` when files other than the
/// docs (which the record itself rewrites) differ from it.
fn commit(root: &Path) -> Result<String, String> {
    let git = |args: &[&str]| -> Result<String, String> {
        let out = Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .map_err(|e| format!("cannot run git: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "`git {}` failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let id = git(&["rev-parse", "--short=10", "HEAD"])?;
    let dirty = git(&[
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ".",
        ":(exclude)docs",
        ":(exclude)README.md",
    ])?;
    Ok(if dirty.is_empty() {
        id
    } else {
        format!("{id} + uncommitted changes")
    })
}
