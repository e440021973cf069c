//! `bench doctor`: checks what limits RPC speed on this machine and says what to fix.

use nix::sys::resource::{getrlimit, Resource};
use serde::Serialize;
use std::fs;
use std::path::Path;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Level {
    Ok,
    Warn,
    Info,
}

#[derive(Debug, Clone, Serialize)]
struct Finding {
    check: String,
    level: Level,
    found: String,
    /// What to do about it (empty when nothing).
    fix: String,
}

fn finding(check: &str, level: Level, found: impl Into<String>, fix: impl Into<String>) -> Finding {
    Finding {
        check: check.into(),
        level,
        found: found.into(),
        fix: fix.into(),
    }
}

fn read_trim(p: impl AsRef<Path>) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

fn memlock() -> Finding {
    const WANT: u64 = 64 << 20;
    match getrlimit(Resource::RLIMIT_MEMLOCK) {
        Ok((soft, hard)) => {
            let show = |v: u64| {
                if v == nix::sys::resource::RLIM_INFINITY {
                    "unlimited".to_string()
                } else {
                    format!("{} KiB", v / 1024)
                }
            };
            let found = format!("RLIMIT_MEMLOCK soft {} / hard {}", show(soft), show(hard));
            if soft >= WANT {
                finding("memlock", Level::Ok, found, "")
            } else {
                finding(
                    "memlock",
                    Level::Warn,
                    found,
                    "verbs registers its buffer pool with the NIC and needs locked memory: run `ulimit -l unlimited` (or set `* - memlock unlimited` in /etc/security/limits.conf, LimitMEMLOCK=infinity for services)",
                )
            }
        }
        Err(e) => finding("memlock", Level::Warn, format!("getrlimit failed: {e}"), ""),
    }
}

fn rdma(sys: &Path) -> Vec<Finding> {
    let mut out = Vec::new();
    let ib = sys.join("class/infiniband");
    let devices: Vec<_> = fs::read_dir(&ib)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    if devices.is_empty() {
        let lib = match transport_verbs::list_devices() {
            Err(e) => e.to_string(),
            Ok(_) => "no device in /sys/class/infiniband".into(),
        };
        out.push(finding(
            "rdma devices",
            Level::Warn,
            lib,
            "no RDMA here: load a NIC driver (mlx5_ib, ...) or create a soft-RoCE device: `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0`; without a kernel that has RDMA use `cargo xtask testbed verbs` (README)",
        ));
        return out;
    }
    let mut sorted = devices;
    sorted.sort();
    for dev in sorted {
        let ports = ib.join(&dev).join("ports");
        let mut port_names: Vec<_> = fs::read_dir(&ports)
            .map(|d| {
                d.filter_map(Result::ok)
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        port_names.sort();
        for port in port_names {
            let p = ports.join(&port);
            let check = format!("{dev} port {port}");
            let state = read_trim(p.join("state")).unwrap_or_default();
            let link = read_trim(p.join("link_layer")).unwrap_or_default();
            if state.contains("ACTIVE") {
                out.push(finding(
                    &check,
                    Level::Ok,
                    format!("state {state}, link layer {link}"),
                    "",
                ));
            } else {
                out.push(finding(
                    &check,
                    Level::Warn,
                    format!("state {state}, link layer {link}"),
                    "the port is not ACTIVE: check the cable / switch, or for RoCE that the netdev is up (`ip link set DEV up`)",
                ));
            }
            // GID table: RoCE v2 present?
            let mut v2 = 0;
            let mut total = 0;
            if let Ok(types) = fs::read_dir(p.join("gid_attrs/types")) {
                for t in types.filter_map(Result::ok) {
                    let idx = t.file_name();
                    let gid = read_trim(p.join("gids").join(&idx)).unwrap_or_default();
                    if gid.is_empty() || gid.trim_start_matches(['0', ':']).is_empty() {
                        continue;
                    }
                    total += 1;
                    if read_trim(t.path()).is_some_and(|s| s.to_ascii_lowercase().contains("v2")) {
                        v2 += 1;
                    }
                }
            }
            if link.eq_ignore_ascii_case("ethernet") {
                if v2 > 0 {
                    out.push(finding(
                        &format!("{check} GIDs"),
                        Level::Ok,
                        format!("{total} GIDs, {v2} RoCE v2"),
                        "",
                    ));
                } else {
                    out.push(finding(
                        &format!("{check} GIDs"),
                        Level::Warn,
                        format!("{total} GIDs, no RoCE v2 GID"),
                        "give the netdev an IPv4/IPv6 address: RoCE v2 GIDs are made from the interface's addresses",
                    ));
                }
            } else {
                out.push(finding(
                    &format!("{check} GIDs"),
                    Level::Info,
                    format!("{total} GIDs"),
                    "",
                ));
            }
            // Active MTU (ibv_query_port via sysfs is not exported; rdma-core's view through the library).
            if let Ok(devs) = transport_verbs::list_devices() {
                if let Some(pi) = devs
                    .iter()
                    .find(|d| d.name == dev)
                    .and_then(|d| d.ports.iter().find(|p| p.port_num.to_string() == port))
                {
                    match pi.active_mtu {
                        Some(m) if m >= 4096 => out.push(finding(&format!("{check} MTU"), Level::Ok, format!("active MTU {m}"), "")),
                        Some(m) => out.push(finding(
                            &format!("{check} MTU"),
                            Level::Warn,
                            format!("active MTU {m}"),
                            "small RDMA MTU: raise the netdev MTU (RoCE: `ip link set DEV mtu 9000` gives 4096) or the subnet manager's MTU (IB)",
                        )),
                        None => out.push(finding(&format!("{check} MTU"), Level::Info, "active MTU unknown", "")),
                    }
                }
            }
        }
    }
    out
}

fn ipoib(sys: &Path) -> Vec<Finding> {
    let mut out = Vec::new();
    let Ok(nets) = fs::read_dir(sys.join("class/net")) else {
        return out;
    };
    for n in nets.filter_map(Result::ok) {
        let name = n.file_name().to_string_lossy().into_owned();
        let mode = n.path().join("mode");
        let Some(mode) = read_trim(&mode) else {
            continue;
        };
        // Only IPoIB interfaces have a `mode` attribute (datagram / connected).
        let mtu: u32 = read_trim(n.path().join("mtu"))
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let check = format!("IPoIB {name}");
        if mode == "datagram" || mtu < 16384 {
            out.push(finding(
                &check,
                Level::Warn,
                format!("mode {mode}, MTU {mtu}"),
                "IPoIB in datagram mode or with a small MTU costs one IP packet per ~2 KB (the 8.66 vs 43.6 Gbit/s gap): `echo connected > /sys/class/net/DEV/mode; ip link set DEV mtu 65520`, or use the verbs transport",
            ));
        } else {
            out.push(finding(
                &check,
                Level::Ok,
                format!("mode {mode}, MTU {mtu}"),
                "",
            ));
        }
    }
    out
}

fn sysctls(proc_sys: &Path) -> Vec<Finding> {
    let mut out = Vec::new();
    const WANT: u64 = 4 << 20;
    for key in ["rmem_max", "wmem_max"] {
        let path = proc_sys.join("net/core").join(key);
        let check = format!("net.core.{key}");
        match read_trim(&path).and_then(|s| s.parse::<u64>().ok()) {
            Some(v) if v >= WANT => out.push(finding(&check, Level::Ok, format!("{v}"), "")),
            Some(v) => out.push(finding(
                &check,
                Level::Warn,
                format!("{v}"),
                format!("socket buffers capped at {} KiB limit TCP on fast or long links: `sysctl -w net.core.{key}=16777216`", v / 1024),
            )),
            None => out.push(finding(&check, Level::Info, "not readable", "")),
        }
    }
    let check = "net.ipv4.tcp_window_scaling";
    match read_trim(proc_sys.join("net/ipv4/tcp_window_scaling")).as_deref() {
        Some("1") => out.push(finding(check, Level::Ok, "1", "")),
        Some(v) => out.push(finding(
            check,
            Level::Warn,
            v.to_string(),
            "without window scaling a TCP window is at most 64 KiB: `sysctl -w net.ipv4.tcp_window_scaling=1`",
        )),
        None => out.push(finding(check, Level::Info, "not readable", "")),
    }
    out
}

/// How the verbs transport waits for completions and what each connection registers, with
/// the settings the bench uses.
fn verbs_settings() -> Finding {
    let c = transport_verbs::VerbsConfig::default();
    let polling = format!("polling: {}", crate::sys::verbs_polling(&c));
    let own_recv = if c.srq_depth == 0 {
        c.recv_depth * c.recv_buf_size()
    } else {
        0
    };
    let per_conn = own_recv + c.send_depth * 128;
    finding(
        "verbs settings",
        Level::Info,
        format!(
            "{polling}; receive: {}; {:.3} MiB registered per connection ({} send slots{}), pool ({} MiB idle) and registration cache ({} MiB) shared per device",
            crate::sys::verbs_receive(&c),
            per_conn as f64 / (1 << 20) as f64,
            c.send_depth,
            if own_recv > 0 { " + its receive buffers" } else { "" },
            c.pool_keep_bytes >> 20,
            c.registration_cache_bytes >> 20
        ),
        "",
    )
}

fn all_findings(sys: &Path, proc_sys: &Path) -> Vec<Finding> {
    let mut f = vec![memlock(), verbs_settings()];
    f.extend(rdma(sys));
    f.extend(ipoib(sys));
    f.extend(sysctls(proc_sys));
    f
}

/// What each RDMA device can do (probed: a type-2 window bound, a queue pair's inline size,
/// shared receive queues, READ depth, transport) and the path each feature of the verbs
/// transport takes on it with the bench's settings. Nothing without a device (the rdma check
/// says so).
fn verbs_devices() -> Vec<Finding> {
    let Ok(devices) = transport_verbs::probe_devices() else {
        return Vec::new();
    };
    let c = transport_verbs::VerbsConfig::default();
    devices
        .iter()
        .map(|caps| {
            let paths = caps.paths(&c);
            let level = if caps.type2_windows.is_ok() {
                Level::Ok
            } else {
                Level::Info
            };
            // What registration exposure adds to each rendezvous message here (a window
            // costs two work requests posted with the RTS instead).
            let cost = |len: usize| {
                transport_verbs::registration_cost(&caps.device, len, 50).map_or_else(
                    |e| format!("failed: {e}"),
                    |t| format!("{:.1} µs", t.as_secs_f64() * 1e6),
                )
            };
            finding(
                &format!("verbs device {}", caps.device),
                level,
                caps.to_string(),
                format!(
                    "paths: {paths}; registering and deregistering a payload for remote read \
                     (registration exposure, per rendezvous message): 64 KiB {}, 1 MiB {}",
                    cost(64 << 10),
                    cost(1 << 20)
                ),
            )
        })
        .collect()
}

/// Runs every check and prints the findings.
pub fn run(json: bool) -> Result<(), String> {
    let mut findings = all_findings(Path::new("/sys"), Path::new("/proc/sys"));
    findings.extend(verbs_devices());
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&findings).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    let w = findings
        .iter()
        .map(|f| f.check.chars().count())
        .max()
        .unwrap_or(0);
    println!("bench doctor: what limits RPC speed here");
    for f in &findings {
        let tag = match f.level {
            Level::Ok => "ok  ",
            Level::Warn => "FIX ",
            Level::Info => "info",
        };
        println!("  [{tag}] {:w$}  {}", f.check, f.found);
        if !f.fix.is_empty() {
            println!("         {:w$}  -> {}", "", f.fix);
        }
    }
    let n = findings.iter().filter(|f| f.level == Level::Warn).count();
    if n == 0 {
        println!("nothing to fix");
    } else {
        println!("{n} thing(s) to fix (marked FIX)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(p: &Path, s: &str) {
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, s).unwrap();
    }

    #[test]
    fn reads_a_fake_sysfs() {
        let d = tempfile::tempdir().unwrap();
        let sys = d.path().join("sys");
        let port = sys.join("class/infiniband/rxe0/ports/1");
        write(&port.join("state"), "4: ACTIVE\n");
        write(&port.join("link_layer"), "Ethernet\n");
        write(
            &port.join("gids/0"),
            "fe80:0000:0000:0000:5054:00ff:fe12:3456\n",
        );
        write(&port.join("gid_attrs/types/0"), "IB/RoCE v1\n");
        write(
            &port.join("gids/1"),
            "0000:0000:0000:0000:0000:ffff:0a00:020f\n",
        );
        write(&port.join("gid_attrs/types/1"), "RoCE v2\n");
        write(&sys.join("class/net/ib0/mode"), "datagram\n");
        write(&sys.join("class/net/ib0/mtu"), "2044\n");
        write(&sys.join("class/net/eth0/mtu"), "1500\n");
        let ps = d.path().join("proc_sys");
        write(&ps.join("net/core/rmem_max"), "212992\n");
        write(&ps.join("net/core/wmem_max"), "16777216\n");
        write(&ps.join("net/ipv4/tcp_window_scaling"), "1\n");
        let f = all_findings(&sys, &ps);
        let get = |c: &str| {
            f.iter()
                .find(|x| x.check == c)
                .unwrap_or_else(|| panic!("{c}: {f:?}"))
        };
        assert_eq!(get("rxe0 port 1").level, Level::Ok);
        assert_eq!(get("rxe0 port 1 GIDs").level, Level::Ok);
        assert!(get("rxe0 port 1 GIDs").found.contains("1 RoCE v2"));
        assert_eq!(get("IPoIB ib0").level, Level::Warn);
        assert!(f.iter().all(|x| x.check != "IPoIB eth0"));
        assert_eq!(get("net.core.rmem_max").level, Level::Warn);
        assert_eq!(get("net.core.wmem_max").level, Level::Ok);
        assert_eq!(get("net.ipv4.tcp_window_scaling").level, Level::Ok);
    }

    #[test]
    fn no_rdma_says_what_to_do() {
        let d = tempfile::tempdir().unwrap();
        let f = rdma(&d.path().join("sys"));
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].level, Level::Warn);
        assert!(f[0].fix.contains("rdma_rxe"));
    }
}
