//! Runs QEMU guests: streams their console to the terminal and the log, enforces the hard
//! deadlines, and turns what happened into an [`Outcome`].
//!
//! Every QEMU runs in its own process group with a parent-death SIGKILL; on a deadline, on an
//! error and on drop the whole group is SIGKILLed and reaped, so no guest outlives the command.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::fetch::Fetched;
use super::script;
use super::sys;

/// From QEMU's start to the guest's READY line (boot ~6 s under TCG; generous for a busy host).
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(150);

/// A log file shared by the guests of one command (lines are prefixed with the guest label).
pub struct Log {
    path: PathBuf,
    file: Mutex<File>,
}

impl Log {
    /// Creates `dir/<kind>-<timestamp>.log`.
    pub fn create(dir: &Path, kind: &str) -> Result<Arc<Log>, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join(format!("{kind}-{}.log", timestamp()));
        let file = File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Arc::new(Log {
            path,
            file: Mutex::new(file),
        }))
    }

    /// The log's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one line (also used for the host's own notes and the summary).
    pub fn line(&self, text: &str) {
        if let Ok(mut f) = self.file.lock() {
            let _ = writeln!(f, "{text}");
        }
    }
}

/// `YYYYMMDD-HHMMSS` (UTC).
pub fn timestamp() -> String {
    let [y, m, d, hh, mm, ss] = crate::util::utc_now();
    format!("{y:04}{m:02}{d:02}-{hh:02}{mm:02}{ss:02}")
}

/// A virtio NIC on a "wire" to the peer guest: this guest's end of a Unix stream socket pair,
/// over which QEMU sends each Ethernet frame with a length prefix.
///
/// A stream, not UDP datagrams: a burst of RDMA READ responses overflows the host's UDP receive
/// buffer, frames are dropped and rxe's retransmissions stall READs for tens of seconds
/// (docs/notes/2026-12-03-testbed-two-hosts-wire.md). A stream socket loses nothing: a full
/// socket makes the sending QEMU wait, as a link's flow control would.
#[derive(Debug, Clone)]
pub struct Wire {
    /// Our end of the socket pair, handed to QEMU as descriptor [`WIRE_FD`].
    pub end: Arc<std::os::unix::net::UnixStream>,
    /// Our MAC address.
    pub mac: String,
}

/// The descriptor number QEMU finds its wire end on.
const WIRE_FD: i32 = 100;

/// One guest to boot.
#[derive(Debug, Clone)]
pub struct GuestSpec {
    /// Prefix for its console lines ("" for a lone guest).
    pub label: String,
    /// `tb.*` kernel parameters read by `/init` (if, ip, peer, timeout, script, share).
    pub params: Vec<(String, String)>,
    /// Host directory shared read-only as `/mnt/host`.
    pub share: Option<PathBuf>,
    /// Network: none (rxe on dummy0) or a wire to a peer (rxe on eth0).
    pub wire: Option<Wire>,
    /// Hard limit from QEMU's start to its end.
    pub deadline: Duration,
    /// The label of a guest whose end also ends this one (a server guest whose client guest
    /// is done): it is then stopped, which is not a failure.
    pub ends_with: Option<String>,
}

/// The prefix of console lines that carry data for the host rather than output for the
/// user: they are logged and kept in the transcript, not echoed (see [`Outcome::data`]).
pub const DATA: &str = "XTASK-DATA ";

/// How a guest ended.
#[derive(Debug)]
pub struct Outcome {
    /// The guest's label.
    pub label: String,
    /// `rc` of the guest's `TESTBED-RESULT` line, if it printed one.
    pub rc: Option<i32>,
    /// QEMU's exit status (isa-debug-exit: rc*2+1).
    pub status: Option<ExitStatus>,
    /// Why the host killed it, if it did.
    pub killed: Option<String>,
    /// Why the host stopped it while it was running well (its `ends_with` guest ended).
    pub stopped: Option<String>,
    /// Console lines.
    pub transcript: Vec<String>,
    /// Time from QEMU's start to the READY line.
    pub ready_after: Option<Duration>,
    /// Time from QEMU's start to its end.
    pub elapsed: Duration,
}

impl Outcome {
    /// True only when the guest reported rc 0 *and* QEMU exited through isa-debug-exit with it,
    /// or it was still running, neither killed nor failed, when its `ends_with` guest ended.
    pub fn ok(&self) -> bool {
        if self.killed.is_some() {
            return false;
        }
        if self.stopped.is_some() {
            return self.rc.is_none();
        }
        self.rc == Some(0) && self.status.and_then(|s| s.code()) == Some(1)
    }

    /// One line saying what went wrong (or that nothing did).
    pub fn describe(&self) -> String {
        let who = if self.label.is_empty() {
            "guest".to_owned()
        } else {
            format!("guest {}", self.label)
        };
        let status = self
            .status
            .map(|s| s.to_string())
            .unwrap_or_else(|| "not reaped".into());
        if let Some(why) = &self.killed {
            return format!(
                "{who} killed after {:.0}s: {why}",
                self.elapsed.as_secs_f64()
            );
        }
        if let Some(why) = &self.stopped {
            return format!(
                "{who} stopped after {:.1}s: {why}",
                self.elapsed.as_secs_f64()
            );
        }
        match self.rc {
            None => format!(
                "{who} ended without reporting a result (QEMU {status}): kernel panic or crash? see the log"
            ),
            Some(0) if self.ok() => format!("{who} passed in {:.1}s", self.elapsed.as_secs_f64()),
            Some(0) => format!("{who} reported rc 0 but QEMU ended with {status}"),
            Some(rc) => format!("{who} failed: its commands exited with rc {rc}"),
        }
    }

    /// The data lines ([`DATA`]) the guest printed, without the prefix, in order.
    pub fn data(&self) -> String {
        self.transcript
            .iter()
            .filter_map(|l| l.strip_prefix(DATA))
            .fold(String::new(), |mut out, l| {
                out.push_str(l);
                out.push('\n');
                out
            })
    }

    /// `(step, "ok 1.2s" | "FAIL rc=N 1.2s")` for each finished step.
    pub fn steps(&self) -> Vec<(String, String)> {
        self.transcript
            .iter()
            .filter_map(|l| l.strip_prefix(script::STEP_END))
            .filter_map(|rest| rest.split_once(' '))
            .map(|(name, how)| (name.to_owned(), how.to_owned()))
            .collect()
    }

    /// Figures printed by the benchmarks, per step: perftest's result rows (with their
    /// header) and ibv_rc_pingpong's throughput / latency lines, as the client reported them.
    pub fn figures(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        let mut step = String::new();
        let mut header: Option<String> = None;
        let mut server_part = false;
        for line in &self.transcript {
            if let Some(name) = line.strip_prefix(script::STEP_BEGIN) {
                step = name.to_owned();
                header = None;
                server_part = false;
                continue;
            }
            // A pair prints the client's output, then the server's: keep the client's figures.
            if line.starts_with(script::SERVER_OUTPUT) {
                server_part = true;
            }
            if server_part {
                continue;
            }
            let t = line.trim();
            if t.starts_with("#bytes") {
                header = Some(t.split_whitespace().collect::<Vec<_>>().join(" "));
                continue;
            }
            let figure = if t.contains("usec/iter") || t.contains("Mbit/sec") {
                Some(t.to_owned())
            } else if let Some(h) = &header {
                t.starts_with(|c: char| c.is_ascii_digit()).then(|| {
                    format!(
                        "{h} | {}",
                        t.split_whitespace().collect::<Vec<_>>().join(" ")
                    )
                })
            } else {
                None
            };
            if let Some(f) = figure {
                let entry = (step.clone(), f);
                if !out.contains(&entry) {
                    out.push(entry);
                }
            }
        }
        out
    }
}

/// A running QEMU; dropping it kills and reaps its process group.
struct Running {
    spec: GuestSpec,
    child: Child,
    started: Instant,
    ready: Arc<Mutex<Option<Instant>>>,
    transcript: Arc<Mutex<Vec<String>>>,
    readers: Vec<JoinHandle<()>>,
    status: Option<ExitStatus>,
    /// When QEMU was seen to have exited by itself.
    ended_at: Option<Instant>,
    killed: Option<String>,
    stopped: Option<String>,
}

/// How long a guest with `ends_with` may go on after that guest ended before it is stopped.
const PEER_GRACE: Duration = Duration::from_secs(5);

impl Running {
    /// Ends QEMU (and its process group) and reaps it.
    fn end(&mut self) {
        sys::kill_group(self.child.id());
        let _ = self.child.kill();
        self.status = self.child.wait().ok();
    }

    /// Ends a guest that went wrong (a failure).
    fn kill(&mut self, why: String) {
        self.end();
        self.killed = Some(why);
    }

    /// Ends a guest that has nothing left to do (not a failure).
    fn stop(&mut self, why: String) {
        self.end();
        self.stopped = Some(why);
    }
}

/// The guest kernel's command line. `clocksource=tsc tsc=reliable`: under TCG the kernel's
/// TSC synchronisation check fails and it falls back to the HPET, whose every read is an
/// emulated device access (no vDSO fast path): `clock_gettime` then costs tens of µs, and
/// every timer and `Instant::now()` of the code under test with it. QEMU's TCG TSC is the
/// host's, consistent across vCPUs; a real machine has a TSC clocksource too.
const TB_KERNEL_ARGS: &str =
    "console=ttyS0 quiet panic=-1 rdinit=/init clocksource=tsc tsc=reliable";

impl Drop for Running {
    fn drop(&mut self) {
        if self.status.is_none() {
            sys::kill_group(self.child.id());
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn command(f: &Fetched, initrd: &Path, spec: &GuestSpec) -> Command {
    let mut append = String::from(TB_KERNEL_ARGS);
    for (k, v) in &spec.params {
        append.push_str(&format!(" tb.{k}={v}"));
    }
    let mut cmd = Command::new(f.qemu());
    cmd.env("LD_LIBRARY_PATH", f.lib_path())
        .arg("-L")
        .arg(f.root.join("usr/share/qemu"))
        .args([
            "-accel",
            "tcg,thread=multi",
            "-cpu",
            "max",
            "-m",
            "2G",
            "-smp",
            "2",
        ])
        .args(["-nodefaults", "-no-user-config", "-display", "none"])
        .args(["-serial", "stdio", "-no-reboot"])
        .args(["-device", "isa-debug-exit,iobase=0xf4,iosize=0x04"])
        .arg("-kernel")
        .arg(&f.kernel)
        .arg("-initrd")
        .arg(initrd)
        .arg("-append")
        .arg(append);
    if let Some(dir) = &spec.share {
        let path = dir.display().to_string().replace(',', ",,");
        cmd.arg("-virtfs").arg(format!(
            "local,path={path},mount_tag=host0,security_model=none,readonly=on"
        ));
    }
    if let Some(w) = &spec.wire {
        cmd.arg("-netdev").arg(format!("socket,id=n0,fd={WIRE_FD}"));
        cmd.arg("-device")
            .arg(format!("virtio-net-pci,netdev=n0,mac={}", w.mac));
        sys::pass_fd(&mut cmd, w.end.clone(), WIRE_FD);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    sys::own_group_dying_with_parent(&mut cmd);
    cmd
}

fn reader(
    stream: impl Read + Send + 'static,
    prefix: String,
    log: Arc<Log>,
    transcript: Arc<Mutex<Vec<String>>>,
    ready: Option<(Arc<Mutex<Option<Instant>>>, Instant)>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(stream);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match r.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let line = String::from_utf8_lossy(&buf);
            let line = line.trim_end_matches(['\n', '\r']).replace('\r', "");
            // Data for the host (a report to merge) is kept, not shown.
            if !line.starts_with(DATA) {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{prefix}{line}");
                let _ = out.flush();
            }
            log.line(&format!("{prefix}{line}"));
            if let Some((ready, _)) = &ready {
                if line.starts_with(script::READY) {
                    if let Ok(mut r) = ready.lock() {
                        r.get_or_insert_with(Instant::now);
                    }
                }
            }
            if let Ok(mut t) = transcript.lock() {
                t.push(line);
            }
        }
    })
}

/// Boots the guests together and waits for all of them (or their deadlines).
pub fn run(
    f: &Fetched,
    initrd: &Path,
    specs: Vec<GuestSpec>,
    log: &Arc<Log>,
) -> Result<Vec<Outcome>, String> {
    let mut running: Vec<Running> = Vec::new();
    for spec in specs {
        let mut cmd = command(f, initrd, &spec);
        log.line(&format!("testbed: $ {cmd:?}"));
        // Spawned from this (the calling) thread: the parent-death signal is tied to it.
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", f.qemu().display()))?;
        let started = Instant::now();
        let prefix = if spec.label.is_empty() {
            String::new()
        } else {
            format!("[{}] ", spec.label)
        };
        let transcript = Arc::new(Mutex::new(Vec::new()));
        let ready = Arc::new(Mutex::new(None));
        let mut readers = Vec::new();
        if let Some(out) = child.stdout.take() {
            readers.push(reader(
                out,
                prefix.clone(),
                Arc::clone(log),
                Arc::clone(&transcript),
                Some((Arc::clone(&ready), started)),
            ));
        }
        if let Some(err) = child.stderr.take() {
            readers.push(reader(
                err,
                format!("{prefix}qemu: "),
                Arc::clone(log),
                Arc::new(Mutex::new(Vec::new())),
                None,
            ));
        }
        running.push(Running {
            spec,
            child,
            started,
            ready,
            transcript,
            readers,
            status: None,
            ended_at: None,
            killed: None,
            stopped: None,
        });
    }

    loop {
        let mut pending = 0;
        for r in running.iter_mut().filter(|r| r.status.is_none()) {
            match r.child.try_wait() {
                Ok(Some(status)) => {
                    r.status = Some(status);
                    r.ended_at = Some(Instant::now());
                }
                Ok(None) => {
                    let elapsed = r.started.elapsed();
                    let ready = r.ready.lock().map(|g| g.is_some()).unwrap_or(false);
                    if elapsed > r.spec.deadline {
                        r.kill(format!(
                            "hard deadline of {}s reached",
                            r.spec.deadline.as_secs()
                        ));
                    } else if !ready && elapsed > BOOT_TIMEOUT {
                        r.kill(format!(
                            "no ready rxe0 within {}s of boot",
                            BOOT_TIMEOUT.as_secs()
                        ));
                    } else {
                        pending += 1;
                    }
                }
                Err(e) => r.kill(format!("waiting for QEMU failed: {e}")),
            }
        }
        if pending == 0 {
            break;
        }
        // A guest whose `ends_with` guest ended a while ago (time for a server to finish on
        // its own and report) is done too.
        let ended: Vec<String> = running
            .iter()
            .filter(|r| r.ended_at.is_some_and(|t| t.elapsed() >= PEER_GRACE))
            .map(|r| r.spec.label.clone())
            .collect();
        for r in running.iter_mut().filter(|r| r.status.is_none()) {
            if let Some(peer) = r.spec.ends_with.clone().filter(|p| ended.contains(p)) {
                r.stop(format!("guest {peer} ended, and this one runs for it only"));
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    let mut outcomes = Vec::new();
    for mut r in running {
        let elapsed = r
            .ended_at
            .map_or_else(|| r.started.elapsed(), |t| t.duration_since(r.started));
        for h in r.readers.drain(..) {
            let _ = h.join();
        }
        let transcript = r.transcript.lock().map(|t| t.clone()).unwrap_or_default();
        let rc = transcript
            .iter()
            .rev()
            .find_map(|l| l.strip_prefix(script::RESULT))
            .and_then(|v| v.trim().parse().ok());
        let ready_after = r
            .ready
            .lock()
            .ok()
            .and_then(|g| g.map(|t| t.duration_since(r.started)));
        outcomes.push(Outcome {
            label: r.spec.label.clone(),
            rc,
            status: r.status,
            killed: r.killed.take(),
            stopped: r.stopped.take(),
            transcript,
            ready_after,
            elapsed,
        });
    }
    Ok(outcomes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamp_is_well_formed() {
        let t = timestamp();
        assert_eq!(t.len(), 15);
        assert_eq!(&t[8..9], "-");
        assert!(t.starts_with("20"));
    }

    /// A guest that passed after printing `lines`.
    fn passed_with(lines: &[&str]) -> Outcome {
        Outcome {
            label: String::new(),
            rc: Some(0),
            status: None,
            killed: None,
            stopped: None,
            transcript: lines.iter().map(|s| s.to_string()).collect(),
            ready_after: None,
            elapsed: Duration::ZERO,
        }
    }

    /// A guest stopped because its peer ended passes only if it had reported nothing yet (it
    /// was still running its command); a killed one never passes.
    #[test]
    fn a_guest_stopped_with_its_peer_passes_unless_it_had_failed() {
        let mut o = passed_with(&[]);
        o.rc = None;
        o.stopped = Some("guest B ended".into());
        assert!(o.ok(), "{}", o.describe());
        assert!(o.describe().contains("stopped"), "{}", o.describe());
        o.rc = Some(1);
        assert!(!o.ok(), "it had failed before it was stopped");
        o.rc = None;
        o.killed = Some("hard deadline".into());
        assert!(!o.ok(), "killed");
    }

    /// Data lines come back whole and in order, without their prefix; other lines are left.
    #[test]
    fn data_lines_are_collected_without_their_prefix() {
        let lines = [
            "bench 0.1.0: a table line",
            "XTASK-DATA {",
            "XTASK-DATA   \"version\": \"0.1.0\"",
            "=== TESTBED-STEP-END bench:verbs ok 3.1s",
            "XTASK-DATA }",
        ];
        let o = passed_with(&lines);
        assert_eq!(o.data(), "{\n  \"version\": \"0.1.0\"\n}\n");
    }

    #[test]
    fn figures_and_steps_are_extracted() {
        let lines = [
            "=== TESTBED-STEP-BEGIN ib_send_bw",
            " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]",
            " 65536      1000             0.22               0.21   \t\t   0.000400",
            "=== TESTBED-STEP-END ib_send_bw ok 3.1s",
            "=== TESTBED-STEP-BEGIN ibv_rc_pingpong",
            "1000 iters in 0.31 seconds = 311.00 usec/iter",
            "=== TESTBED-STEP-END ibv_rc_pingpong FAIL rc=1 0.9s",
        ];
        let o = passed_with(&lines);
        let f = o.figures();
        assert_eq!(f.len(), 2);
        assert_eq!(f[0].0, "ib_send_bw");
        assert!(f[0].1.ends_with("| 65536 1000 0.22 0.21 0.000400"));
        assert_eq!(
            o.steps()[1],
            ("ibv_rc_pingpong".into(), "FAIL rc=1 0.9s".into())
        );
        assert!(!o.ok(), "no QEMU status: never ok");
    }
}
