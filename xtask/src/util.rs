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
    run_with_timeout_in(None, program, args, limit)
}

/// [`run_with_timeout`] in directory `dir` (the current one when `None`).
pub fn run_with_timeout_in(
    dir: Option<&std::path::Path>,
    program: &str,
    args: &[&str],
    limit: Duration,
) -> Result<(), String> {
    let in_dir = dir.map_or_else(String::new, |d| format!(" (in {})", d.display()));
    eprintln!(
        "xtask: $ {program} {}{in_dir} (time limit {}s)",
        args.join(" "),
        limit.as_secs()
    );
    let mut cmd = Command::new(program);
    cmd.args(args);
    if let Some(d) = dir {
        cmd.current_dir(d);
    }
    sys::own_group_dying_with_parent(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start `{program}`: {e}"))?;
    match wait_or_kill(&mut child, limit) {
        Ok(Some(status)) if status.success() => Ok(()),
        Ok(Some(status)) => Err(format!("`{program} {}` failed ({status})", args.join(" "))),
        Ok(None) => Err(format!(
            "`{program} {}` did not finish within {}s and was killed",
            args.join(" "),
            limit.as_secs()
        )),
        Err(e) => Err(format!("waiting for `{program}`: {e}")),
    }
}

/// Waits for `child` (started in a group of its own, [`sys::own_group_dying_with_parent`]);
/// after `limit`, kills it and every process it started and returns `None`.
pub fn wait_or_kill(
    child: &mut std::process::Child,
    limit: Duration,
) -> std::io::Result<Option<std::process::ExitStatus>> {
    let start = Instant::now();
    loop {
        match child.try_wait()? {
            Some(status) => return Ok(Some(status)),
            None if start.elapsed() >= limit => {
                sys::kill_group(child.id());
                let _ = child.kill();
                let _ = child.wait();
                return Ok(None);
            }
            None => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// The time now, UTC, as `[year, month, day, hour, minute, second]`, without a date crate.
pub fn utc_now() -> [u64; 6] {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    civil(secs)
}

/// `[year, month, day, hour, minute, second]` of `secs` after the Unix epoch (Howard Hinnant's
/// civil-from-days).
fn civil(secs: u64) -> [u64; 6] {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    [
        y as u64,
        m as u64,
        d as u64,
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
    ]
}

/// Test helper: a command line split at whitespace, as the argument list a command gets.
#[cfg(test)]
pub fn args(s: &str) -> Vec<String> {
    s.split_whitespace().map(String::from).collect()
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

    #[test]
    fn civil_dates_are_right_across_a_leap_day() {
        assert_eq!(super::civil(0), [1970, 1, 1, 0, 0, 0]);
        // 2024-02-29 23:59:59 and the second after it.
        assert_eq!(super::civil(1_709_251_199), [2024, 2, 29, 23, 59, 59]);
        assert_eq!(super::civil(1_709_251_200), [2024, 3, 1, 0, 0, 0]);
    }
}
