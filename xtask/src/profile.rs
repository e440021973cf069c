//! `cargo xtask profile`: user-space instructions per message, counted with callgrind.
//!
//! For each transport, path (the OS's sockets or the link, raw, RPC) and operation, one
//! process runs `bench count` for N and for 3N messages under callgrind: the difference of the
//! two totals divided by 2N is what one message costs, set-up cancelled. The client is counted
//! beside a native `bench server`, the server (`bench server` under callgrind, stopped by
//! SIGTERM) beside a native client. uds and tcp run on this host; verbs runs in the soft-RoCE
//! guest (or on this host when it has an RDMA device), from the host's valgrind files.
//!
//! Instructions do not depend on the emulator or on the machine's load: what runs in the guest
//! is what would run beside a NIC (the kernel's share, rxe's work included, is not counted).
//! Waiting does, though: a receiver that finds nothing polls again, and those polls count.
//! `--repeat R` runs each count R times and keeps the least at each N (waiting only adds), so
//! the figure is the work a message needs, not how long the peer took.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{deps, testbed, util};

/// One measurement: a path, an operation and its payload size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Case {
    path: &'static str,
    op: &'static str,
    size: usize,
}

/// What is counted: a round trip (ping), and a 64 KiB message one way (raw stream, oneway
/// and twoway calls), on every path that has it (`os` is the link on verbs).
const CASES: &[Case] = &[
    Case {
        path: "os",
        op: "ping",
        size: 0,
    },
    Case {
        path: "raw",
        op: "ping",
        size: 0,
    },
    Case {
        path: "rpc",
        op: "ping",
        size: 0,
    },
    Case {
        path: "os",
        op: "oneway",
        size: 65536,
    },
    Case {
        path: "raw",
        op: "oneway",
        size: 65536,
    },
    Case {
        path: "rpc",
        op: "oneway",
        size: 65536,
    },
    Case {
        path: "rpc",
        op: "send",
        size: 65536,
    },
];

/// The options of `cargo xtask profile`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Opts {
    transports: Vec<String>,
    sides: Vec<String>,
    ops: Vec<String>,
    /// Round trips N for ping (the 64 KiB cases run N / 10, at least 10).
    count: u64,
    /// Runs of each count; the least is kept.
    repeat: u64,
    /// Bring the callgrind files of the 3N runs back into target/profile/ (for
    /// callgrind_annotate).
    keep: bool,
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        transports: vec!["uds".into(), "tcp".into(), "verbs".into()],
        sides: vec!["client".into(), "server".into()],
        ops: vec!["ping".into(), "oneway".into(), "send".into()],
        count: 2000,
        repeat: 1,
        keep: false,
    };
    let list = |v: &str, allowed: &[&str], name: &str| -> Result<Vec<String>, String> {
        let l: Vec<String> = v.split(',').map(str::to_owned).collect();
        match l.iter().find(|x| !allowed.contains(&x.as_str())) {
            Some(bad) => Err(format!(
                "{name}: unknown `{bad}` (one of {})",
                allowed.join(", ")
            )),
            None => Ok(l),
        }
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{a} needs a value"))
        };
        match a.as_str() {
            "--transports" => o.transports = list(&value()?, &["uds", "tcp", "verbs"], a)?,
            "--sides" => o.sides = list(&value()?, &["client", "server"], a)?,
            "--ops" => o.ops = list(&value()?, &["ping", "oneway", "send"], a)?,
            "--count" => o.count = positive(a, &value()?)?,
            "--repeat" => o.repeat = positive(a, &value()?)?,
            "--smoke" => o.count = 50,
            "--keep" => o.keep = true,
            other => return Err(format!("unexpected argument `{other}`\n{}", help())),
        }
    }
    Ok(o)
}

/// Option `name`'s value as a count of at least 1.
fn positive(name: &str, v: &str) -> Result<u64, String> {
    match v.parse::<u64>() {
        Ok(0) => Err(format!("{name}: 0")),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{name}: {e}")),
    }
}

fn help() -> &'static str {
    "cargo xtask profile [--transports uds,tcp,verbs] [--sides client,server] \
     [--ops ping,oneway,send] [--count N | --smoke] [--repeat R] [--keep]\n  \
     instructions per message (callgrind, N and 3N messages; the 64 KiB cases N/10); \
     --smoke: N = 50; --repeat: each count R times, the least kept (waiting polls only add); \
     --keep: the last 3N runs' callgrind files into target/profile/"
}

/// `cargo xtask profile ARGS`.
pub fn run(args: &[String]) -> Result<(), String> {
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{}", help());
        return Ok(());
    }
    let o = parse(args)?;
    deps::ensure_build_deps()?;
    deps::ensure_packages(&["valgrind"])?;
    util::run("cargo", &["build", "--release", "-p", "bench"])?;
    let bench = testbed::target_dir().join("release/bench");
    let mut lines = String::new();
    for t in o.transports.iter().filter(|t| *t != "verbs") {
        lines.push_str(&on_host(&bench, t, &o)?);
    }
    if o.transports.iter().any(|t| t == "verbs") {
        lines.push_str(&verbs(&bench, &o)?);
    }
    if o.keep {
        save_files(&lines)?;
    }
    let counts = parse_lines(&lines)?;
    let missing = missing(&counts, &o);
    if !missing.is_empty() {
        return Err(format!(
            "the profile lacks the runs of: {}",
            missing.join(", ")
        ));
    }
    let table = render(&counts, &o);
    println!("{table}");
    let out = testbed::target_dir().join("profile.txt");
    std::fs::write(&out, &table).map_err(|e| format!("{}: {e}", out.display()))?;
    eprintln!("xtask: table written to {}", out.display());
    Ok(())
}

/// The cases `o` selects, with N for each.
fn selected(o: &Opts) -> Vec<(Case, u64)> {
    CASES
        .iter()
        .filter(|c| o.ops.iter().any(|op| op == c.op))
        .map(|c| {
            let n = if c.op == "ping" {
                o.count
            } else {
                (o.count / 10).max(10)
            };
            (*c, n)
        })
        .collect()
}

/// Where the script finds what it runs.
struct Env<'a> {
    transport: &'a str,
    /// The bench binary.
    bench: String,
    /// The valgrind command (with its VALGRIND_LIB in the guest).
    valgrind: String,
    /// A scratch directory.
    work: String,
    /// `bench server`'s arguments.
    server: String,
    /// The server's log line printed last when ready.
    ready: &'static str,
    /// `bench count`'s target and transport for a path.
    target: Box<dyn Fn(&str) -> String + 'a>,
    /// Printed before every result line (the guest's data prefix).
    prefix: &'a str,
}

/// The POSIX `sh` script (busybox in the guest) that counts every selected case: prints
/// `PROFILE transport side path op size n instructions` per run.
fn script(e: &Env<'_>, o: &Opts) -> String {
    let mut s = format!(
        r#"set -u
B={bench}; W={work}; mkdir -p $W
ir() {{ sed -n 's/^summary: //p' "$1"; }}
nap() {{ usleep 200000 2>/dev/null || sleep 1; }}
srv_start() {{
  rm -f $W/srv.log $W/*.sock
  $1 $B server {server} >$W/srv.log 2>&1 &
  SRV=$!
  i=0
  until grep -q "{ready}" $W/srv.log 2>/dev/null; do
    i=$((i + 1))
    if [ $i -gt 1500 ] || ! kill -0 $SRV 2>/dev/null; then echo "profile: the server did not start"; cat $W/srv.log; exit 1; fi
    nap
  done
}}
srv_stop() {{ kill -TERM $SRV; wait $SRV || {{ echo "profile: the server failed"; cat $W/srv.log; exit 1; }}; }}
keep() {{ [ {keep} = 1 ] && echo "{prefix}PROFILE-FILE $2 $(gzip -c $1 | base64 -w0)"; true; }}
count() {{ $1 $B count $2 --count $3 >$W/count.log 2>&1 || {{ echo "profile: bench count $2 --count $3 failed"; cat $W/count.log; exit 1; }}; }}
"#,
        bench = e.bench,
        work = e.work,
        server = e.server,
        ready = e.ready,
        keep = u8::from(o.keep),
        prefix = e.prefix,
    );
    let vg = format!("{} --tool=callgrind --callgrind-out-file=$W/cg", e.valgrind);
    for side in ["client", "server"] {
        if !o.sides.iter().any(|x| x == side) {
            continue;
        }
        // The client is counted beside one native server; the server, under callgrind, is
        // started for each count and stopped by SIGTERM (callgrind writes its file at exit).
        if side == "client" {
            s.push_str("srv_start \"\"\n");
        }
        for (c, n) in selected(o) {
            let args = format!(
                "{} --path {} --op {} --size {}",
                (e.target)(c.path),
                c.path,
                c.op,
                c.size.max(1)
            );
            let what = format!("{} {side} {} {} {}", e.transport, c.path, c.op, c.size);
            for k in [n, 3 * n]
                .into_iter()
                .flat_map(|k| (0..o.repeat).map(move |_| k))
            {
                let one = if side == "client" {
                    format!("count \"{vg}\" \"{args}\" {k}")
                } else {
                    format!("srv_start \"{vg}\"; count \"\" \"{args}\" {k}; srv_stop")
                };
                s.push_str(&format!(
                    "{one}; echo \"{}PROFILE {what} {k} $(ir $W/cg)\"\n",
                    e.prefix
                ));
            }
            s.push_str(&format!("keep $W/cg {}\n", what.replace(' ', "-")));
        }
        if side == "client" {
            s.push_str("srv_stop\n");
        }
    }
    s
}

/// Counts uds or tcp on this host.
fn on_host(bench: &Path, transport: &str, o: &Opts) -> Result<String, String> {
    let work = tempfile_dir()?;
    let w = work.display().to_string();
    let port = 15301 + (std::process::id() % 2000) as u16 * 2;
    let (server, ready) = match transport {
        "uds" => (
            format!("--listen 127.0.0.1:0 --uds {w}/b.sock --os-uds {w}/os.sock --spin-us 0"),
            "os baseline (blocking sockets) uds",
        ),
        _ => (
            format!(
                "--listen 127.0.0.1:{port} --os-tcp 127.0.0.1:{} --spin-us 0",
                port + 1
            ),
            "os baseline (blocking sockets) tcp",
        ),
    };
    let wd = w.clone();
    let tr = transport.to_owned();
    let env = Env {
        transport,
        bench: bench.display().to_string(),
        valgrind: "valgrind --quiet".into(),
        work: w.clone(),
        server,
        ready,
        target: Box::new(move |path| match (tr.as_str(), path) {
            ("uds", "os") => format!("unix:{wd}/os.sock"),
            ("uds", _) => format!("unix:{wd}/b.sock"),
            (_, "os") => format!("127.0.0.1:{}", port + 1),
            _ => format!("127.0.0.1:{port}"),
        }),
        prefix: "",
    };
    let text = script(&env, o);
    eprintln!("xtask: counting {transport} on this host");
    let out = Command::new("sh")
        .arg("-c")
        .arg(&text)
        .output()
        .map_err(|e| format!("sh: {e}"));
    let _ = std::fs::remove_dir_all(&work);
    let out = out?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(format!(
            "profile of {transport} failed ({}):\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(stdout)
}

fn tempfile_dir() -> Result<PathBuf, String> {
    let d = std::env::temp_dir().join(format!("xtask-profile-{}", std::process::id()));
    std::fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
    Ok(d)
}

/// Counts verbs: in the soft-RoCE guest, with the host's valgrind files staged beside bench.
fn verbs(bench: &Path, o: &Opts) -> Result<String, String> {
    let vg = Path::new("/usr/libexec/valgrind");
    let files = vec![
        bench.to_path_buf(),
        PathBuf::from("/usr/bin/valgrind.bin"),
        vg.join("callgrind-amd64-linux"),
        vg.join("vgpreload_core-amd64-linux.so"),
        vg.join("default.supp"),
    ];
    if let Some(missing) = files.iter().find(|f| !f.exists()) {
        return Err(format!(
            "{} is missing (valgrind's files)",
            missing.display()
        ));
    }
    let env = Env {
        transport: "verbs",
        bench: "/mnt/host/bin/bench".into(),
        valgrind: "env VALGRIND_LIB=/mnt/host/bin /mnt/host/bin/valgrind.bin --quiet".into(),
        work: "/tmp/profile".into(),
        server: "--verbs --listen $TB_IP_ADDR:5201".into(),
        ready: "verbs link figures",
        target: Box::new(|_| "$TB_IP_ADDR:5201 --transport verbs".into()),
        prefix: testbed::DATA,
    };
    let text = format!("ulimit -l unlimited\n{}", script(&env, o));
    // About 15 s a run under emulation, start-up included; generous for the default counts.
    let runs = selected(o).len() as u32 * 2 * o.sides.len() as u32 * o.repeat as u32;
    testbed::script_in_guest(&files, "profile:verbs", 120 + runs * 60, &text)
}

/// Writes the callgrind files the script printed (`PROFILE-FILE name base64-of-gzip`) into
/// target/profile/NAME.out.
fn save_files(text: &str) -> Result<(), String> {
    let dir = testbed::target_dir().join("profile");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for l in text.lines() {
        let Some((name, data)) = l
            .trim()
            .strip_prefix("PROFILE-FILE ")
            .and_then(|r| r.split_once(' '))
        else {
            continue;
        };
        let gz = dir.join(format!("{name}.out.gz"));
        let decoded = Command::new("sh")
            .arg("-c")
            .arg(format!("base64 -d > '{}'", gz.display()))
            .stdin(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin.take().expect("piped").write_all(data.as_bytes())?;
                c.wait()
            })
            .map_err(|e| format!("base64: {e}"))?;
        if !decoded.success() {
            return Err(format!("{name}: not base64"));
        }
        util::run("gunzip", &["-f", &gz.to_string_lossy()])?;
        eprintln!("xtask: {}", dir.join(format!("{name}.out")).display());
    }
    Ok(())
}

/// Totals by (transport, side, path, op, size), each with its (n, instructions) runs.
type Counts = BTreeMap<(String, String, String, String, usize), Vec<(u64, u64)>>;

fn parse_lines(text: &str) -> Result<Counts, String> {
    let mut m = Counts::new();
    for l in text.lines() {
        let Some(rest) = l.trim().strip_prefix("PROFILE ") else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let [t, side, path, op, size, n, ir] = f[..] else {
            return Err(format!("a profile line without its count: `{l}`"));
        };
        let num = |s: &str| s.parse::<u64>().map_err(|e| format!("`{l}`: {e}"));
        m.entry((
            t.into(),
            side.into(),
            path.into(),
            op.into(),
            num(size)? as usize,
        ))
        .or_default()
        .push((num(n)?, num(ir)?));
    }
    if m.is_empty() {
        return Err("the profile printed no counts".into());
    }
    Ok(m)
}

/// The selected (transport, side, case) whose N and 3N runs are not both in `c`.
fn missing(c: &Counts, o: &Opts) -> Vec<String> {
    let mut out = Vec::new();
    for t in &o.transports {
        for side in &o.sides {
            for (case, n) in selected(o) {
                let key = (
                    t.clone(),
                    side.clone(),
                    case.path.into(),
                    case.op.into(),
                    case.size,
                );
                let runs = c.get(&key).map(Vec::as_slice).unwrap_or_default();
                let has = |k: u64| runs.iter().any(|r| r.0 == k);
                if !(has(n) && has(3 * n)) {
                    out.push(format!(
                        "{t} {side} {} {} {}",
                        case.path, case.op, case.size
                    ));
                }
            }
        }
    }
    out
}

/// Instructions per message from the runs of N and 3N messages: the least run of each (a
/// run's waiting polls only add to it).
fn per_message(runs: &[(u64, u64)]) -> Option<f64> {
    let n_lo = runs.iter().map(|r| r.0).min()?;
    let n_hi = runs.iter().map(|r| r.0).max()?;
    let least = |n: u64| runs.iter().filter(|r| r.0 == n).map(|r| r.1).min();
    let (lo, hi) = (least(n_lo)?, least(n_hi)?);
    (n_hi > n_lo).then(|| (hi as f64 - lo as f64) / (n_hi - n_lo) as f64)
}

fn render(c: &Counts, o: &Opts) -> String {
    let mut out = format!(
        "user-space instructions per message (callgrind; whole process, runs of N and 3N \
         messages, difference / 2N; ping N = {}, 64 KiB N = {}; {}; os = the OS's blocking \
         sockets, on verbs the link's busy-polled ping-pong and READ stream)\n\n\
         | transport | op | size | path | client | server | client / os | server / os |\n\
         |---|---|---|---|---|---|---|---|\n",
        o.count,
        (o.count / 10).max(10),
        if o.repeat > 1 {
            format!("the least of {} runs of each", o.repeat)
        } else {
            "one run of each".to_owned()
        }
    );
    let get = |t: &str, side: &str, path: &str, op: &str, size: usize| {
        c.get(&(t.into(), side.into(), path.into(), op.into(), size))
            .and_then(|r| per_message(r))
    };
    // A negative difference is noise (waiting polls that differed between the two runs
    // by more than the messages cost), not a figure.
    let fmt = |v: Option<f64>| match v {
        Some(v) if v < 0.0 => "noise".to_owned(),
        Some(v) => format!("{v:.0}"),
        None => "-".to_owned(),
    };
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if a >= 0.0 && b > 0.0 => format!("{:.2}x", a / b),
        _ => "-".to_owned(),
    };
    for t in &o.transports {
        for case in selected(o).iter().map(|x| x.0) {
            let client = get(t, "client", case.path, case.op, case.size);
            let server = get(t, "server", case.path, case.op, case.size);
            if client.is_none() && server.is_none() {
                continue;
            }
            // The os row of the same op (send compares with the oneway stream).
            let base_op = if case.op == "send" { "oneway" } else { case.op };
            let os_c = get(t, "client", "os", base_op, case.size);
            let os_s = get(t, "server", "os", base_op, case.size);
            let path = if t == "verbs" && case.path == "os" {
                "link"
            } else {
                case.path
            };
            let size = if case.size == 0 {
                "-".to_owned()
            } else {
                format!("{}K", case.size / 1024)
            };
            out.push_str(&format!(
                "| {t} | {} | {size} | {path} | {} | {} | {} | {} |\n",
                case.op,
                fmt(client),
                fmt(server),
                ratio(client, os_c),
                ratio(server, os_s)
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::args;

    #[test]
    fn options_parse_and_refuse_unknown_names() {
        let o = parse(&args(
            "--transports verbs --sides client --ops ping --smoke",
        ))
        .unwrap();
        assert_eq!(o.transports, vec!["verbs"]);
        assert_eq!(o.sides, vec!["client"]);
        assert_eq!(o.count, 50);
        assert!(parse(&args("--transports shm")).is_err());
        assert!(parse(&args("--count 0")).is_err());
        assert_eq!(selected(&o).len(), 3, "ping on os, raw and rpc");
    }

    /// The difference of the N and 3N runs over 2N, set-up cancelled.
    #[test]
    fn instructions_per_message_cancel_the_set_up() {
        let text = "PROFILE verbs client rpc ping 0 200 7881148\nnoise\n\
                    XTASK-DATA PROFILE verbs client rpc ping 0 600 10499160\n";
        let c = parse_lines(&text.replace("XTASK-DATA ", "")).unwrap();
        let runs = &c[&(
            "verbs".into(),
            "client".into(),
            "rpc".into(),
            "ping".into(),
            0,
        )];
        let v = per_message(runs).unwrap();
        assert!((v - 6545.03).abs() < 0.01, "{v}");
        let o = Opts {
            transports: vec!["verbs".into()],
            sides: vec!["client".into()],
            ops: vec!["ping".into()],
            count: 200,
            repeat: 1,
            keep: false,
        };
        assert_eq!(
            missing(&c, &o),
            ["verbs client os ping 0", "verbs client raw ping 0"],
            "the rpc runs are there, the others not"
        );
        assert!(parse_lines("PROFILE verbs client rpc ping 0 200").is_err());
        assert!(parse_lines("nothing").is_err());
    }

    /// With repeated runs, the least of each count is kept: a run that polled while it waited
    /// counts more, and does not move the figure.
    #[test]
    fn repeated_runs_keep_the_least_of_each_count() {
        let runs = [
            (200, 1_000_500),
            (200, 1_000_000),
            (600, 1_900_000),
            (600, 1_800_000),
        ];
        assert_eq!(per_message(&runs), Some(2000.0));
        assert_eq!(per_message(&runs[..2]), None, "one count only");
        assert_eq!(parse(&args("--repeat 3")).unwrap().repeat, 3);
        assert!(parse(&args("--repeat 0")).is_err());
        let o = parse(&args(
            "--transports uds --sides client --ops ping --repeat 2",
        ))
        .unwrap();
        let env = Env {
            transport: "uds",
            bench: "b".into(),
            valgrind: "vg".into(),
            work: "/w".into(),
            server: "s".into(),
            ready: "r",
            target: Box::new(|p| p.to_owned()),
            prefix: "",
        };
        let script = script(&env, &o);
        // Three paths (os, raw, rpc), each count twice.
        assert_eq!(script.matches("\" 2000; echo").count(), 6);
        assert_eq!(script.matches("\" 6000; echo").count(), 6);
    }
}
