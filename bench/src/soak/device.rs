//! `bench soak --kill device`: the RDMA device is deleted (`rdma link delete`) while verbs
//! clients call a verbs server in this process, and Unix-socket clients call a Unix-socket
//! server beside it; then the device is added back.
//!
//! Every verbs call ends (answered, or a typed error: the device's removal, or the peer's
//! disconnect on iWARP), the Unix-socket calls go on being answered while the device goes,
//! `rdma link delete` returns (the transport gives the device back once its connections are
//! gone), and after the device is added back the verbs clients connect and are answered
//! again. Nothing may be lost or misdelivered, and afterwards no verbs connection, lent
//! buffer, descriptor or task may be left.

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use transport_core::Transport;
use transport_uds::{UdsAddr, UdsTransport};
use transport_verbs::{VerbsConfig, VerbsTransport};

use super::{
    client, served_none, stop_clients, Registered, Resources, SoakArgs, Tally, RESTART_BOUND,
};
use crate::proto;

/// How long `rdma link delete` may take once it started: the connections fail at once, the
/// device is given back when their teardown is done.
const REMOVAL_BOUND: Duration = Duration::from_secs(30);

/// `DEVICE:NETDEV` of `--remove-device`, and the kind `rdma link add` needs.
fn device_spec(a: &SoakArgs) -> Result<(String, String, &'static str), String> {
    let spec = a
        .remove_device
        .as_deref()
        .ok_or("--kill device needs --remove-device DEVICE:NETDEV (e.g. rxe0:eth0)")?;
    let (dev, netdev) = spec
        .split_once(':')
        .filter(|(d, n)| !d.is_empty() && !n.is_empty())
        .ok_or_else(|| format!("--remove-device {spec}: expected DEVICE:NETDEV"))?;
    let kind = if dev.starts_with("siw") { "siw" } else { "rxe" };
    Ok((dev.to_string(), netdev.to_string(), kind))
}

/// Runs `rdma ARGS` and waits (bounded) for it; an error names the command.
async fn rdma(args: &[&str], within: Duration) -> Result<Duration, String> {
    let started = Instant::now();
    let mut child = Command::new("rdma")
        .args(args)
        .spawn()
        .map_err(|e| format!("rdma {}: {e}", args.join(" ")))?;
    loop {
        match child.try_wait() {
            Ok(Some(s)) if s.success() => return Ok(started.elapsed()),
            Ok(Some(s)) => return Err(format!("rdma {}: {s}", args.join(" "))),
            Ok(None) if started.elapsed() > within => {
                // A removal the kernel cannot finish cannot be killed either (the process is
                // in uninterruptible sleep): report it.
                return Err(format!(
                    "rdma {} still running after {within:?}",
                    args.join(" ")
                ));
            }
            Ok(None) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => return Err(format!("waiting for rdma: {e}")),
        }
    }
}

/// Starts a client for each of `ids` on `transport`, counting into `tally`.
fn spawn_clients<T>(
    set: &mut tokio::task::JoinSet<()>,
    ids: std::ops::Range<u64>,
    transport: &T,
    addr: &T::Addr,
    tally: &Arc<Tally>,
    generation: &Arc<AtomicU64>,
    stop: &Arc<AtomicBool>,
) where
    T: Transport + Clone + Send + Sync + 'static,
    T::Addr: Clone + Send + Sync + 'static,
{
    for c in ids {
        set.spawn(client(
            c,
            transport.clone(),
            addr.clone(),
            tally.clone(),
            generation.clone(),
            stop.clone(),
        ));
    }
}

/// The soak's `device` victim: its report line and whether it passed.
pub(super) async fn device_removed(
    a: &SoakArgs,
    dir: &std::path::Path,
) -> Result<(String, bool), String> {
    let (dev, netdev, kind) = device_spec(a)?;
    let mut at = a
        .verbs_addr
        .ok_or("--transports verbs needs --verbs-addr (an RDMA device's IP:PORT)")?;
    // Not a port the other victims' servers used.
    at.set_port(at.port().wrapping_add(4));
    let verbs = VerbsTransport::new(VerbsConfig::default()).map_err(|e| format!("verbs: {e}"))?;
    let listener = verbs
        .listen(&at)
        .await
        .map_err(|e| format!("verbs listen on {at}: {e}"))?;
    let counters = Arc::new(proto::ServerCounters::default());
    let served = tokio::spawn(proto::serve(listener, counters.clone()));
    let sock = UdsAddr(dir.join("device-uds.sock"));
    let uds = UdsTransport::default();
    let uds_served = super::serve_uds(&sock.0, &counters).await?;
    // The baseline is what the process holds once each transport has served a connection
    // (the device's completion channel and librdmacm's contexts are open by then), and again
    // after the device came back.
    if let Some(c) = super::connect(&verbs, &at).await {
        let _ = tokio::time::timeout(Duration::from_secs(5), c.close()).await;
    }
    if let Some(c) = super::connect(&uds, &sock).await {
        let _ = tokio::time::timeout(Duration::from_secs(5), c.close()).await;
    }
    served_none(&counters, Instant::now() + Duration::from_secs(5)).await;
    let baseline = Resources::now();

    let (vt, ut) = (Arc::new(Tally::default()), Arc::new(Tally::default()));
    let (vgen, ugen) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = tokio::task::JoinSet::new();
    let n = a.clients.max(1);
    spawn_clients(&mut clients, 0..n, &verbs, &at, &vt, &vgen, &stop);
    spawn_clients(&mut clients, n..2 * n, &uds, &sock, &ut, &ugen, &stop);

    let run = async {
        let start = Instant::now();
        let half = Duration::from_secs(a.seconds) / 2;
        tokio::time::sleep(half).await;
        let verbs_answered_before = vt.answered.load(Ordering::SeqCst);
        let uds_before = ut.answered.load(Ordering::SeqCst);
        let removal = rdma(&["link", "delete", &dev], REMOVAL_BOUND).await?;
        let uds_during = ut.answered.load(Ordering::SeqCst) - uds_before;
        // The old listener ended with the device (its serve loop returns the error).
        let listener_end = tokio::time::timeout(Duration::from_secs(5), served)
            .await
            .map_err(|_| "the verbs listener did not end with its device".to_string())?;
        let listener_end = match listener_end {
            Ok(Err(e)) => e.to_string(),
            Ok(Ok(())) => "ended without an error".into(),
            Err(e) => format!("the serve task failed: {e}"),
        };
        rdma(
            &["link", "add", &dev, "type", kind, "netdev", &netdev],
            REMOVAL_BOUND,
        )
        .await?;
        // The device is back: a new listener on the same address, the clients reconnect.
        let deadline = Instant::now() + RESTART_BOUND;
        let listener = loop {
            match verbs.listen(&at).await {
                Ok(l) => break l,
                Err(e) if Instant::now() >= deadline => {
                    return Err(format!("cannot listen on the re-added {dev}: {e}"));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        vgen.fetch_add(1, Ordering::SeqCst);
        let served = tokio::spawn(proto::serve(listener, counters.clone()));
        let rest = Duration::from_secs(a.seconds).saturating_sub(start.elapsed());
        tokio::time::sleep(rest.max(Duration::from_secs(2))).await;
        Ok::<_, String>((
            removal,
            verbs_answered_before,
            uds_during,
            listener_end,
            served,
        ))
    };
    let outcome = run.await;
    stop_clients(&stop, &mut clients).await?;
    let (removal, verbs_before, uds_during, listener_end, served) = outcome?;
    served.abort();
    uds_served.abort();
    let deadline = Instant::now() + Duration::from_secs(10);
    let registered = Registered::settled(&verbs, deadline).await;
    let after = Resources::settled(&baseline, deadline).await;
    let (fds, tasks) = after.leaked(&baseline);

    let get = |c: &AtomicU64| c.load(Ordering::SeqCst);
    let ended_once = |t: &Tally| {
        get(&t.answered) + get(&t.failed) + get(&t.lost) == get(&t.calls)
            && get(&t.lost) == 0
            && get(&t.misdelivered) == 0
    };
    let listener_typed = listener_end.contains("was removed");
    let ok = ended_once(&vt)
        && ended_once(&ut)
        && verbs_before > 0
        && uds_during > 0
        && get(&vt.answered_after_restart) > 0
        && listener_typed
        && registered.clean()
        && fds == 0
        && tasks == 0;
    let line = format!(
        "soak verbs device removal ({dev}): {} verbs calls, {} answered ({} after the device \
         came back), {} failed with a typed error; rdma link delete returned after {:.1} s, \
         {uds_during} uds calls answered meanwhile ({} in all); the listener ended: \
         {listener_end}; lost {}, misdelivered {}, leaked {fds} fds and {tasks} tasks{}{}",
        get(&vt.calls),
        get(&vt.answered),
        get(&vt.answered_after_restart),
        get(&vt.failed),
        removal.as_secs_f64(),
        get(&ut.answered),
        get(&vt.lost) + get(&ut.lost),
        get(&vt.misdelivered) + get(&ut.misdelivered),
        registered.describe(),
        if ok { "" } else { " FAILED" },
    );
    Ok((line, ok))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        soak: SoakArgs,
    }

    /// `--remove-device` takes DEVICE:NETDEV and reads the kind off the device's name.
    #[test]
    fn the_device_spec_names_device_netdev_and_kind() {
        let spec = |s: &str| {
            let cli = Cli::parse_from(["soak", "--remove-device", s]);
            device_spec(&cli.soak)
        };
        assert_eq!(
            spec("rxe0:dummy0"),
            Ok(("rxe0".into(), "dummy0".into(), "rxe"))
        );
        assert_eq!(spec("siw0:eth1"), Ok(("siw0".into(), "eth1".into(), "siw")));
        assert!(spec("rxe0").is_err());
        assert!(spec(":dummy0").is_err());
        let none = Cli::parse_from(["soak"]);
        assert!(device_spec(&none.soak).is_err());
    }
}
