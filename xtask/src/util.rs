//! Small process helpers shared by the xtask commands.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::testbed::sys;

/// Runs `program args…` with inherited stdio; an error names the command and its exit status.
pub fn run(program: &str, args: &[&str]) -> Result<(), String> {
    eprintln!("xtask: $ {program} {}", args.join(" "));
    let status = Command::new(program)
        .args(args)
        .status()
        .map_err(|e| format!("cannot start `{program}`: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`{program} {}` failed ({status})", args.join(" ")))
    }
}

/// True when the process runs as root (apt-get may be used).
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Like [`run`], but kills the command (and every process it started) when it has not finished
/// within `limit`: a hung test fails the run instead of stalling CI until its global timeout.
pub fn run_with_timeout(program: &str, args: &[&str], limit: Duration) -> Result<(), String> {
    eprintln!(
        "xtask: $ {program} {} (time limit {}s)",
        args.join(" "),
        limit.as_secs()
    );
    let mut cmd = Command::new(program);
    cmd.args(args);
    sys::own_group_dying_with_parent(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start `{program}`: {e}"))?;
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => {
                return Err(format!("`{program} {}` failed ({status})", args.join(" ")))
            }
            Ok(None) if start.elapsed() >= limit => {
                sys::kill_group(child.id());
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "`{program} {}` did not finish within {}s and was killed",
                    args.join(" "),
                    limit.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => return Err(format!("waiting for `{program}`: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_with_timeout_reports_success_failure_and_kills_hung_commands() {
        assert!(run_with_timeout("true", &[], Duration::from_secs(30)).is_ok());
        let err = run_with_timeout("false", &[], Duration::from_secs(30)).unwrap_err();
        assert!(err.contains("failed"), "{err}");
        // A shell whose child sleeps: both must be gone when the limit hits.
        let start = Instant::now();
        let err =
            run_with_timeout("sh", &["-c", "sleep 60; true"], Duration::from_secs(1)).unwrap_err();
        assert!(err.contains("did not finish within 1s"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(20));
    }
}
