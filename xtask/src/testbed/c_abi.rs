//! transport-ffi's C examples over verbs in the guest: built on the host (the debug static
//! library, `cc -Werror`), staged, and run as one step of each target's boot.

use super::{repo_root, target_dir};
use std::path::PathBuf;
use std::process::Command;

/// The examples the step runs, by file name in transport-ffi/examples/c.
pub(super) const EXAMPLES: &[&str] = &["echo_server", "echo_client", "rpc", "poll_server"];

/// Builds transport-ffi's static library and the C examples linked against it; their paths,
/// in the order of [`EXAMPLES`].
pub(super) fn build() -> Result<Vec<PathBuf>, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "-p", "transport-ffi", "--lib"])
        .current_dir(repo_root())
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err(format!("building transport-ffi failed ({status})"));
    }
    let lib = target_dir().join("debug/libtransport_ffi.a");
    let out = target_dir().join("ffi-c");
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let ffi = repo_root().join("transport-ffi");
    let mut exes = Vec::new();
    for name in EXAMPLES {
        let exe = out.join(name);
        let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
            .args(["-std=c11", "-O1", "-g", "-Wall", "-Wextra", "-Werror"])
            .arg("-D_POSIX_C_SOURCE=200809L")
            .arg("-I")
            .arg(ffi.join("include"))
            .arg(ffi.join(format!("examples/c/{name}.c")))
            .arg(&lib)
            .args(["-lpthread", "-ldl", "-lm", "-o"])
            .arg(&exe)
            .status()
            .map_err(|e| format!("cannot run the C compiler: {e}"))?;
        if !status.success() {
            return Err(format!("{name}.c did not compile ({status})"));
        }
        exes.push(exe);
    }
    Ok(exes)
}

/// The guest step: the echo server and client, two clients (one connecting without blocking)
/// on the poll(2) server, and the RPC example, all over `verbs://$TB_IP_ADDR`. `guest` holds
/// the staged paths in the order of [`EXAMPLES`]. Fails on any example's failure or a server
/// that did not say where it listens within 60 s.
pub(super) fn step(guest: &[String]) -> String {
    let [server, client, rpc, poll] = guest else {
        return "echo 'the C examples were not staged'; false".into();
    };
    // A server prints "listening URI" first; wait for it (bounded), then take the URI.
    let started = |out: &str| {
        format!(
            "i=0; until grep -q '^listening ' {out}; do i=$((i+1)); [ $i -gt 600 ] && \
             {{ echo 'no listening line in {out}'; cat {out}; exit 1; }}; sleep 0.1; done; \
             U=$(sed -n 's/^listening //p' {out})"
        )
    };
    format!(
        "set -e; V=\"verbs://$TB_IP_ADDR:0\"; \
         {server} \"$V\" > /tmp/c-echo.out & S=$!; {}; {client} \"$U\"; wait $S; \
         {poll} \"$V\" 2 > /tmp/c-poll.out & P=$!; {}; \
         {client} \"$U\" & A=$!; {client} \"$U\" nb; wait $A; wait $P; \
         {rpc} \"$V\" 200",
        started("/tmp/c-echo.out"),
        started("/tmp/c-poll.out"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The step is valid sh, names every example, and refuses to run with one missing.
    #[test]
    fn the_step_is_valid_sh_and_runs_every_example() {
        let guest: Vec<String> = EXAMPLES
            .iter()
            .map(|e| format!("/mnt/host/bin/{e}"))
            .collect();
        let step = step(&guest);
        for g in &guest {
            assert!(step.contains(g.as_str()), "{g} not in {step}");
        }
        assert!(step.contains("nb"), "the non-blocking client");
        let ok = Command::new("sh")
            .args(["-n", "-c", &step])
            .status()
            .expect("sh");
        assert!(ok.success(), "sh -n refused: {step}");
        assert!(super::step(&guest[..3]).ends_with("false"));
    }
}
