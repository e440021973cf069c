//! rdma_cm plumbing: one task per event channel reads its events (non-blocking fd on tokio's
//! `AsyncFd`) and routes each to the identifier's sink; connection setup on both sides.

use std::net::SocketAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Weak};
use std::time::Duration;

use sideway::ibverbs::queue_pair::QueuePairState;
use sideway::ibverbs::AccessFlags;
use sideway::rdmacm::communication_manager::{
    ConnectionParameter, EventChannel, EventType, Identifier,
};
use tokio::sync::mpsc;
use transport_core::TransportError;

use crate::caps::ExposurePath;
use crate::config::VerbsConfig;
use crate::cq_pump::CqRoute;
use crate::domain::{Domains, Member};
use crate::ffi::{Access, Endpoint, ExposeBy, OwnedRegion, RawQp, RecvQueue, CTRL_SLOT};
use crate::pool::{Pool, PoolBuf};

/// The verbs resources of one connection.
pub(crate) struct Resources {
    /// Wakes the connection's driver at its CQ's events; dropped before the endpoint.
    pub(crate) cq_route: CqRoute,
    pub(crate) ep: Endpoint<PoolBuf>,
    pub(crate) pool: Pool,
    pub(crate) metrics: Arc<transport_core::Metrics>,
    pub(crate) device: String,
    /// Counts this connection in its domain; dropped after the endpoint.
    pub(crate) member: Member,
    /// The transport's settings with what the device's paths decide applied (receive depth,
    /// inline size, READ depth, chunk, exposure): what this connection uses.
    pub(crate) cfg: Arc<VerbsConfig>,
    /// Whether this side made the connection (it sends the first message: iWARP requires
    /// the connecting side to, and both sides follow the rule everywhere).
    pub(crate) speaks_first: bool,
}

/// Where a connection's queue pair receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecvMode {
    /// Through the device's shared receive queue when the configuration has one
    /// (`srq_depth > 0`): the transport's connections.
    Shared,
    /// Into `recv_depth` buffers of its own: the link measurement (perftest does the same)
    /// and the test peer.
    Own,
}

/// A connection whose queue pair is connected and whose receive buffers are posted: what
/// `conn::start` drives.
pub(crate) struct Established {
    pub(crate) res: Resources,
    pub(crate) id: Arc<Identifier>,
    /// The identifier's rdma_cm events (disconnect, ...).
    pub(crate) events: mpsc::UnboundedReceiver<CmMsg>,
    pub(crate) peer: String,
}

/// Receive buffers a connection with buffers of its own posts beyond the credits it grants.
pub(crate) const SPARE_RECV: usize = 1;

/// Posts the initial receive buffers (before the peer can send); nothing to do for a queue
/// pair that receives through the device's shared receive queue (filled when it was made).
fn prepost(mut r: Resources) -> Result<Resources, TransportError> {
    if r.ep.receives_shared() {
        return Ok(r);
    }
    let cfg = r.cfg.clone();
    for _ in 0..cfg.recv_depth + SPARE_RECV {
        let b = r.pool.get_recv(cfg.recv_buf_size())?;
        if r.ep.stage_recv(b).is_err() {
            return Err(crate::error::VerbsError::Internal("receive table overrun".into()).into());
        }
    }
    let d = r.ep.ring()?;
    r.metrics.doorbells.add(d);
    Ok(r)
}

/// Destroys an identifier off the async threads (rdma_destroy_id may wait for the event pump).
pub(crate) fn drop_id_off_thread(id: Arc<Identifier>) {
    match tokio::runtime::Handle::try_current() {
        Ok(h) => {
            h.spawn_blocking(move || drop(id));
        }
        Err(_) => drop(id),
    }
}

/// One rdma_cm event, as routed to an identifier's sink.
pub(crate) struct CmMsg {
    pub(crate) kind: Option<EventType>,
    pub(crate) status: i32,
    /// For a connect request: the new identifier.
    pub(crate) new_id: Option<Arc<Identifier>>,
}

/// Stored in an identifier's user context: where its events go.
pub(crate) struct CmSink(pub(crate) mpsc::UnboundedSender<CmMsg>);

/// The rdma_cm event channel of a transport (shared by its clones), made on first use. All
/// identifiers of the transport (listeners, connect requests, connections) live on it, and one
/// pump thread routes its events.
#[derive(Default)]
pub(crate) struct CmChannel(std::sync::Mutex<Option<Arc<EventChannel>>>);

impl CmChannel {
    /// The channel, made (and its pump started) by the first caller. Device removals seen on
    /// it are reported to `domains` ([`Domains::device_removed`]).
    pub(crate) fn get(&self, domains: &Arc<Domains>) -> Result<Arc<EventChannel>, TransportError> {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ch) = &*g {
            return Ok(ch.clone());
        }
        let ch = channel(Arc::downgrade(domains))?;
        *g = Some(ch.clone());
        Ok(ch)
    }
}

/// How often the pump checks whether anything but itself still holds the channel.
const PUMP_EXIT_CHECK: Duration = Duration::from_secs(1);

/// The local IPv4 addresses (loopback excluded) that rdma_cm maps to an RDMA device, with the
/// device's name: each is bound once on a throw-away identifier (no port is taken: port 0 and
/// no listen). This finds every transport's address, iWARP's too, whose GIDs carry no IP.
pub(crate) fn rdma_addresses() -> Result<Vec<(String, std::net::IpAddr)>, TransportError> {
    use sideway::ibverbs::device::DeviceInfo as _;
    let ips: Vec<std::net::IpAddr> = nix::ifaddrs::getifaddrs()
        .map_err(|e| cm_err("getifaddrs", &"-", e))?
        .filter_map(|i| {
            i.address?
                .as_sockaddr_in()
                .map(|a| std::net::IpAddr::V4(a.ip()))
        })
        .filter(|ip| !ip.is_loopback())
        .collect();
    let ch = EventChannel::new().map_err(|e| cm_err("rdma_create_event_channel", &"-", e))?;
    let mut out = Vec::new();
    for ip in ips {
        let id = ch
            .create_id(sideway::rdmacm::communication_manager::PortSpace::Tcp)
            .map_err(|e| cm_err("rdma_create_id", &ip, e))?;
        if id.bind_addr(SocketAddr::new(ip, 0)).is_err() {
            continue;
        }
        if let Some(ctx) = id.get_device_context() {
            if !out.iter().any(|(_, a)| *a == ip) {
                out.push((ctx.name(), ip));
            }
        }
    }
    Ok(out)
}

/// Makes an event channel and starts its pump thread. The pump ends once nothing but itself
/// holds the channel (the transport and every identifier created on it are gone).
///
/// A thread, not a task: connections of one transport may live on different runtimes (e.g. a
/// current-thread runtime per client thread), and the events of all of them must keep flowing
/// when any one runtime ends. Events are rare (setup, teardown), and the thread sleeps in
/// poll(2), waking once per `PUMP_EXIT_CHECK` while idle.
fn channel(domains: Weak<Domains>) -> Result<Arc<EventChannel>, TransportError> {
    let ch = EventChannel::new().map_err(|e| cm_err("rdma_create_event_channel", &"-", e))?;
    ch.set_nonblocking(true)?;
    let pumped = ch.clone();
    std::thread::Builder::new()
        .name("verbs-rdma-cm".into())
        .spawn(move || pump(pumped, domains))?;
    Ok(ch)
}

fn pump(ch: Arc<EventChannel>, domains: Weak<Domains>) {
    use std::os::fd::AsRawFd;
    let fd = ch.as_raw_fd();
    loop {
        if Arc::strong_count(&ch) <= 1 {
            break;
        }
        // `fd` stays open while `ch` lives (held here).
        match crate::ffi::wait_readable(fd, PUMP_EXIT_CHECK) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
        // Drain: the fd is level-triggered, so anything left wakes the next poll.
        loop {
            // sideway's enum conversions can panic on values it does not know.
            let got = catch_unwind(AssertUnwindSafe(|| match ch.get_cm_event() {
                Ok(ev) => {
                    let kind = catch_unwind(AssertUnwindSafe(|| ev.event_type())).ok();
                    let status = ev.status();
                    let (target, new_id) = if kind == Some(EventType::ConnectRequest) {
                        (ev.listener_id(), ev.cm_id())
                    } else {
                        (ev.cm_id(), None)
                    };
                    if kind == Some(EventType::DeviceRemoval) {
                        // Before the identifier's own handling: the device's shared
                        // resources are forgotten first, so that they go as soon as the
                        // connections on it let go of theirs.
                        let ctx = target.as_ref().and_then(|id| id.get_device_context());
                        if let (Some(ctx), Some(d)) = (ctx, domains.upgrade()) {
                            d.device_removed(&ctx);
                        }
                    }
                    if let Some(sink) = target.and_then(|id| id.get_context::<CmSink>()) {
                        let _ = sink.0.send(CmMsg {
                            kind,
                            status,
                            new_id,
                        });
                    }
                    drop(ev); // acknowledged
                    true
                }
                Err(_) => false,
            }));
            if !matches!(got, Ok(true)) {
                break;
            }
        }
    }
}

fn cm_err(
    op: &'static str,
    addr: &dyn std::fmt::Display,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> TransportError {
    crate::error::VerbsError::Cm {
        op,
        addr: addr.to_string(),
        source: source.into(),
    }
    .into()
}

/// Waits for the next event of an identifier, with a time limit.
async fn next_event(
    rx: &mut mpsc::UnboundedReceiver<CmMsg>,
    op: &'static str,
    addr: &SocketAddr,
    within: Duration,
) -> Result<CmMsg, TransportError> {
    match tokio::time::timeout(within, rx.recv()).await {
        Ok(Some(m)) => Ok(m),
        Ok(None) => Err(cm_err(op, addr, "event channel closed")),
        Err(_) => Err(TransportError::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("rdma_cm {op} for {addr} timed out after {within:?}"),
        ))),
    }
}

async fn expect_event(
    rx: &mut mpsc::UnboundedReceiver<CmMsg>,
    want: EventType,
    op: &'static str,
    addr: &SocketAddr,
    within: Duration,
) -> Result<(), TransportError> {
    expect_one_of(rx, &[want], op, addr, within)
        .await
        .map(|_| ())
}

/// The next event, which must be one of `wanted`: which one it is.
async fn expect_one_of(
    rx: &mut mpsc::UnboundedReceiver<CmMsg>,
    wanted: &[EventType],
    op: &'static str,
    addr: &SocketAddr,
    within: Duration,
) -> Result<EventType, TransportError> {
    let m = next_event(rx, op, addr, within).await?;
    match m.kind {
        Some(k) if wanted.contains(&k) => Ok(k),
        Some(EventType::Rejected) | Some(EventType::Unreachable) => {
            Err(TransportError::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                format!("rdma_cm {op} to {addr}: {:?} (status {})", m.kind, m.status),
            )))
        }
        other => Err(cm_err(
            op,
            addr,
            format!("unexpected event {other:?} (status {})", m.status),
        )),
    }
}

/// Builds the verbs resources of one connection on the identifier's device.
fn resources(
    id: &Arc<Identifier>,
    cfg: &VerbsConfig,
    domains: &Domains,
    addr: &SocketAddr,
    mode: RecvMode,
) -> Result<Resources, TransportError> {
    let ctx = id
        .get_device_context()
        .ok_or_else(|| cm_err("get device", addr, "identifier is bound to no RDMA device"))?;
    let device = {
        use sideway::ibverbs::device::DeviceInfo as _;
        ctx.name()
    };
    let domain = domains.for_context(&ctx, &device, cfg).map_err(|e| {
        cm_err(
            "device resources (ibv_alloc_pd, shared receive queue)",
            addr,
            e,
        )
    })?;
    let cfg = domain.paths.apply(cfg);
    let cfg = &cfg;
    let pd = domain.pd.clone();
    let recv = match (mode, &domain.srq) {
        (RecvMode::Shared, Some(s)) => RecvQueue::Shared(s.clone()),
        // One buffer beyond the credits granted: a message a peer sends without a credit lands
        // there and fails the connection as the protocol violation it is, instead of finding no
        // buffer (which iWARP, with no receiver-not-ready retry, answers by ending the
        // connection, and RoCE by retrying until the peer gives up).
        _ => RecvQueue::Own(cfg.recv_depth + SPARE_RECV),
    };
    // The CQ never overflows (a lost completion would lose its buffer): it has room for the
    // whole send queue and every receive this QP can complete before its driver polls.
    let receives = recv.completions();
    let cqe = (cfg.send_depth + receives + 16) as u32;
    let cq = ctx
        .create_cq_builder()
        .setup_cqe(cqe)
        .setup_comp_channel(domain.cq_pump.channel(), 0)
        .build()
        .map_err(|e| cm_err("ibv_create_cq", addr, e))?;
    let mut inline = cfg.inline_size as u32;
    let (qp, caps) = loop {
        match RawQp::create(&pd, &cq, cfg.send_depth, &recv, inline) {
            Ok(qp) => break qp,
            Err(_) if inline > 0 => inline = 0,
            Err(e) => return Err(cm_err("ibv_create_qp", addr, e)),
        }
    };
    let inline = caps.max_inline_data.min(inline);
    let metrics = Arc::new(transport_core::Metrics::default());
    let pool = domain.pool.for_connection(metrics.clone());
    let ctrl =
        OwnedRegion::new(&pd, cfg.send_depth * CTRL_SLOT, Access::SendOnly).map_err(|e| {
            TransportError::from(crate::pool::registration_error(
                &device,
                cfg.send_depth * CTRL_SLOT,
                e,
            ))
        })?;
    metrics.registrations.incr();
    let ep = Endpoint::new(
        qp,
        cq,
        pd.clone(),
        ctrl,
        cfg.send_depth,
        recv.clone(),
        inline as usize,
        match domain.paths.exposure {
            ExposurePath::MemoryWindow => ExposeBy::Window,
            ExposurePath::Registration => ExposeBy::Registration,
        },
        domain.paths.read_sink_remote_write,
    );
    let posted = match recv {
        RecvQueue::Shared(_) => 0,
        RecvQueue::Own(depth) => depth * cfg.recv_buf_size(),
    };
    let member = domain.join(cfg.send_depth * CTRL_SLOT, posted);
    let cq_route = domain.cq_pump.route(ep.cq_key(), metrics.clone());
    Ok(Resources {
        cq_route,
        ep,
        pool,
        metrics,
        device,
        member,
        cfg: Arc::new(cfg.clone()),
        speaks_first: true,
    })
}

/// The RNR NAK delay this side asks for: code 7, 0.12 ms (InfiniBand's encoding).
const MIN_RNR_TIMER: u8 = 7;

fn init_attr(
    id: &Identifier,
    addr: &SocketAddr,
) -> Result<sideway::ibverbs::queue_pair::QueuePairAttribute, TransportError> {
    let mut attr = id
        .get_qp_attr(QueuePairState::Init)
        .map_err(|e| cm_err("init QP attributes", addr, e))?;
    // Incoming RDMA READs only (the peer reads rendezvous payloads through memory windows
    // bound to this QP); no remote writes or atomics: nothing this side does needs them.
    attr.setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteRead);
    Ok(attr)
}

fn to_state(
    r: &mut Resources,
    id: &Identifier,
    state: QueuePairState,
    addr: &SocketAddr,
) -> Result<(), TransportError> {
    let attr = if state == QueuePairState::Init {
        init_attr(id, addr)?
    } else {
        let mut attr = id
            .get_qp_attr(state)
            .map_err(|e| cm_err("QP attributes", addr, e))?;
        if state == QueuePairState::ReadyToReceive {
            // rdma_cm asks for the longest RNR delay (code 0: 655 ms). With a shared receive
            // queue a burst across many connections can find it empty for a moment; the
            // sender's device then retries (rnr_retry 7: without limit) after this delay.
            attr.setup_min_rnr_timer(MIN_RNR_TIMER);
            // rdma_cm's default conn_param serves one READ at a time; the engine keeps no
            // more READs in flight than the peer announces it serves (HELLO).
            attr.setup_max_dest_read_atomic(r.cfg.read_depth as u8);
        }
        if state == QueuePairState::ReadyToSend {
            attr.setup_max_read_atomic(r.cfg.read_depth as u8);
        }
        attr
    };
    r.ep.modify(&attr)
        .map_err(|e| cm_err("ibv_modify_qp", addr, e))
}

/// Connects to a listener at `addr`.
pub(crate) async fn connect(
    ch: Arc<EventChannel>,
    domains: Arc<Domains>,
    cfg: Arc<VerbsConfig>,
    addr: SocketAddr,
    mode: RecvMode,
) -> Result<Established, TransportError> {
    let id = ch
        .create_id(sideway::rdmacm::communication_manager::PortSpace::Tcp)
        .map_err(|e| cm_err("rdma_create_id", &addr, e))?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    id.setup_context(CmSink(tx));
    drop(ch);
    let t = cfg.connect_timeout;
    let result = async {
        id.resolve_addr(None, addr, t)
            .map_err(|e| cm_err("resolve address", &addr, e))?;
        expect_event(
            &mut rx,
            EventType::AddressResolved,
            "resolve address",
            &addr,
            t + t,
        )
        .await?;
        id.resolve_route(t)
            .map_err(|e| cm_err("resolve route", &addr, e))?;
        expect_event(
            &mut rx,
            EventType::RouteResolved,
            "resolve route",
            &addr,
            t + t,
        )
        .await?;
        let mut r = resources(&id, &cfg, &domains, &addr, mode)?;
        to_state(&mut r, &id, QueuePairState::Init, &addr)?;
        // Receives are posted before the peer can send anything.
        let mut r = prepost(r)?;
        {
            let mut param = ConnectionParameter::default();
            param.setup_qp_number(r.ep.qp_number());
            id.connect(param).map_err(|e| cm_err("connect", &addr, e))?;
        }
        let answer = expect_one_of(
            &mut rx,
            &[EventType::ConnectResponse, EventType::Established],
            "connect",
            &addr,
            t,
        )
        .await?;
        // InfiniBand and RoCE answer with the peer's response and leave the queue pair to
        // us: re-apply INIT (remote access flags), then RTR and RTS, then establish. iWARP's
        // connection manager moves the queue pair to RTS itself and reports it established.
        if answer == EventType::ConnectResponse {
            to_state(&mut r, &id, QueuePairState::Init, &addr)?;
            to_state(&mut r, &id, QueuePairState::ReadyToReceive, &addr)?;
            to_state(&mut r, &id, QueuePairState::ReadyToSend, &addr)?;
            id.establish().map_err(|e| cm_err("establish", &addr, e))?;
        }
        Ok::<_, TransportError>(r)
    }
    .await;
    match result {
        Ok(res) => Ok(Established {
            res,
            id,
            events: rx,
            peer: addr.to_string(),
        }),
        Err(e) => {
            drop_id_off_thread(id);
            Err(e)
        }
    }
}

/// A bound, listening identifier.
pub(crate) struct Listening {
    /// The listening identifier, until [`Listening::close`] or its device's removal.
    id: Arc<std::sync::Mutex<Option<Arc<Identifier>>>>,
    pub(crate) addr: SocketAddr,
}

impl Listening {
    /// Stops listening: destroys the identifier (off the async threads).
    pub(crate) fn close(&self) {
        close_listening(&self.id);
    }
}

fn close_listening(slot: &std::sync::Mutex<Option<Arc<Identifier>>>) {
    let id = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(id) = id {
        drop_id_off_thread(id);
    }
}

/// Binds and listens at `addr`; port 0 picks a free port. Connect requests are completed in
/// the background (like a kernel's TCP backlog), each established connection handed to
/// `on_ready` (which starts it at once, so its handshake does not wait for `accept`). When
/// the listener's device is removed, its identifier is destroyed and `on_ready` gets the
/// [`VerbsError::DeviceRemoved`](crate::VerbsError::DeviceRemoved) error, last.
pub(crate) fn listen(
    ch: Arc<EventChannel>,
    domains: Arc<Domains>,
    addr: SocketAddr,
    cfg: Arc<VerbsConfig>,
    mode: RecvMode,
    on_ready: impl Fn(Result<Established, crate::VerbsError>) + Send + Sync + 'static,
) -> Result<Listening, TransportError> {
    // `to_canonical` so an IPv4-mapped loopback (`[::ffff:127.0.0.1]`) is caught too.
    if addr.ip().to_canonical().is_loopback() {
        // rdma_cm binds a loopback address to an RDMA device, where other hosts connect to the
        // device's own IP (checked across two soft-RoCE guests): a listener that looks
        // loopback-only would be open to the network.
        return Err(crate::error::VerbsError::Config(
            "a verbs listener cannot be loopback-only: rdma_cm binds a loopback address to an \
             RDMA device, which other hosts reach; listen on the device's IP \
             (transport_verbs::local_rdma_ip) or 0.0.0.0 to choose that exposure",
        )
        .into());
    }
    let backlog = cfg.backlog;
    let id = ch
        .create_id(sideway::rdmacm::communication_manager::PortSpace::Tcp)
        .map_err(|e| cm_err("rdma_create_id", &addr, e))?;
    drop(ch);
    let bound = if addr.port() != 0 {
        id.bind_addr(addr).map_err(|e| cm_err("bind", &addr, e))?;
        addr
    } else {
        // sideway cannot read back the port rdma_cm picked: pick one ourselves.
        let mut seed = std::process::id() as u64
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1);
        let mut bound = None;
        for _ in 0..200 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let port = 20_000 + (seed % 40_000) as u16;
            let a = SocketAddr::new(addr.ip(), port);
            if id.bind_addr(a).is_ok() {
                bound = Some(a);
                break;
            }
        }
        bound.ok_or_else(|| cm_err("bind", &addr, "no free port found"))?
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    id.setup_context(CmSink(tx));
    id.listen(backlog)
        .map_err(|e| cm_err("listen", &bound, e))?;
    let on_ready = Arc::new(on_ready);
    let slot = Arc::new(std::sync::Mutex::new(Some(id)));
    let listening = slot.clone();
    // Ends when the listening identifier (which holds the sink) is destroyed.
    tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            if m.kind == Some(EventType::DeviceRemoval) {
                let device = {
                    use sideway::ibverbs::device::DeviceInfo as _;
                    let id = listening.lock().unwrap_or_else(|p| p.into_inner());
                    id.as_ref()
                        .and_then(|id| id.get_device_context())
                        .map_or_else(|| format!("of {bound}"), |ctx| ctx.name())
                };
                close_listening(&listening);
                on_ready(Err(crate::VerbsError::DeviceRemoved { device }));
                break;
            }
            let Some(new_id) = m.new_id else { continue };
            let cfg = cfg.clone();
            let domains = domains.clone();
            let on_ready = on_ready.clone();
            tokio::spawn(async move {
                // A request whose setup fails is dropped (rejected); the listener goes on.
                if let Ok(est) = accept(cfg, domains, new_id, bound, mode).await {
                    on_ready(Ok(est));
                }
            });
        }
    });
    Ok(Listening {
        id: slot,
        addr: bound,
    })
}

/// Completes one incoming connection request.
pub(crate) async fn accept(
    cfg: Arc<VerbsConfig>,
    domains: Arc<Domains>,
    id: Arc<Identifier>,
    listen_addr: SocketAddr,
    mode: RecvMode,
) -> Result<Established, TransportError> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    id.setup_context(CmSink(tx));
    let addr = listen_addr;
    let result = async {
        let mut r = resources(&id, &cfg, &domains, &addr, mode)?;
        r.speaks_first = false;
        to_state(&mut r, &id, QueuePairState::Init, &addr)?;
        let mut r = prepost(r)?;
        to_state(&mut r, &id, QueuePairState::ReadyToReceive, &addr)?;
        to_state(&mut r, &id, QueuePairState::ReadyToSend, &addr)?;
        {
            let mut param = ConnectionParameter::default();
            param.setup_qp_number(r.ep.qp_number());
            id.accept(param).map_err(|e| cm_err("accept", &addr, e))?;
        }
        expect_event(
            &mut rx,
            EventType::Established,
            "accept",
            &addr,
            cfg.connect_timeout,
        )
        .await?;
        Ok::<_, TransportError>(r)
    }
    .await;
    match result {
        Ok(res) => Ok(Established {
            res,
            id,
            events: rx,
            peer: format!("rdma peer via {listen_addr}"),
        }),
        Err(e) => {
            drop_id_off_thread(id);
            Err(e)
        }
    }
}
