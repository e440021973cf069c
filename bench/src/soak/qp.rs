//! `bench soak --kill qp` (verbs): clients and server in this process, and every
//! `--kill-every-ms` the queue pair of one live connection is forced to the error state, as a
//! device fault would, on the server's side and the clients' side in turn (transport-verbs'
//! `inject_qp_error_on_one`, a test hook). The connection's calls end with a typed error, the
//! client reconnects; nothing may be lost or misdelivered, and afterwards no connection, lent
//! buffer, descriptor or task may be left on either side.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use transport_core::Transport;
use transport_verbs::{VerbsConfig, VerbsTransport};

use super::{client, served_none, stop_clients, Registered, Resources, SoakArgs, Tally};
use crate::proto;

/// The soak's `qp` victim: its report line and whether it passed.
pub(super) async fn qp_faults(a: &SoakArgs) -> Result<(String, bool), String> {
    let mut at = a
        .verbs_addr
        .ok_or("--transports verbs needs --verbs-addr (an RDMA device's IP:PORT)")?;
    // Not a port the other victims' servers used.
    at.set_port(at.port().wrapping_add(6));
    let server = VerbsTransport::new(VerbsConfig::default()).map_err(|e| format!("verbs: {e}"))?;
    // The clients' transport of their own, as in another process.
    let clients_side =
        VerbsTransport::new(VerbsConfig::default()).map_err(|e| format!("verbs: {e}"))?;
    let listener = server
        .listen(&at)
        .await
        .map_err(|e| format!("verbs listen on {at}: {e}"))?;
    let counters = Arc::new(proto::ServerCounters::default());
    let served = tokio::spawn(proto::serve(listener, counters.clone()));
    // The baseline: both transports have made a connection (their devices' pumps run).
    if let Some(c) = super::connect(&clients_side, &at).await {
        let _ = tokio::time::timeout(Duration::from_secs(5), c.close()).await;
    }
    served_none(&counters, Instant::now() + Duration::from_secs(5)).await;
    let baseline = Resources::now();

    let tally = Arc::new(Tally::default());
    let generation = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = tokio::task::JoinSet::new();
    for c in 0..a.clients {
        clients.spawn(client(
            c,
            clients_side.clone(),
            at,
            tally.clone(),
            generation.clone(),
            stop.clone(),
        ));
    }
    let end = Instant::now() + Duration::from_secs(a.seconds);
    let (mut at_server, mut at_client, mut turn) = (0u64, 0u64, 0usize);
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(a.kill_every_ms).min(end - Instant::now())).await;
        if Instant::now() >= end {
            break;
        }
        let server_side = (at_server + at_client) % 2 == 0;
        let victim = if server_side { &server } else { &clients_side };
        turn = turn.wrapping_add(1);
        if victim.inject_qp_error_on_one(turn) {
            if server_side {
                at_server += 1;
            } else {
                at_client += 1;
            }
            generation.fetch_add(1, Ordering::SeqCst);
        }
    }
    if let Err(e) = stop_clients(&stop, &mut clients).await {
        served.abort();
        return Err(e);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let open = served_none(&counters, deadline).await;
    let reg_server = Registered::settled(&server, deadline).await;
    let reg_clients = Registered::settled(&clients_side, deadline).await;
    let after = Resources::settled(&baseline, deadline).await;
    let (fds, tasks) = after.leaked(&baseline);
    served.abort();

    let get = |c: &AtomicU64| c.load(Ordering::SeqCst);
    let (calls, answered, failed) = (get(&tally.calls), get(&tally.answered), get(&tally.failed));
    let (lost, misdelivered) = (get(&tally.lost), get(&tally.misdelivered));
    let faults = at_server + at_client;
    let ok = lost == 0
        && misdelivered == 0
        && answered + failed + lost == calls
        && faults > 0
        && get(&tally.answered_after_restart) > 0
        && open == 0
        && fds == 0
        && tasks == 0
        && reg_server.clean()
        && reg_clients.clean();
    let line = format!(
        "soak verbs qp errors: {calls} calls in {} s by {} clients: {answered} answered, {failed} \
         failed with a typed error; {at_server} server and {at_client} client queue pairs forced \
         to error, {} connects; lost {lost}, misdelivered {misdelivered}, left open {open} \
         connections, leaked {fds} fds and {tasks} tasks; server{}; clients{}{}",
        a.seconds,
        a.clients,
        get(&tally.connects),
        reg_server.describe(),
        reg_clients.describe(),
        if ok { "" } else { " FAILED" },
    );
    Ok((line, ok))
}
