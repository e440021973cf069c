//! Load generators for the classic middleware scenarios: many concurrent clients, slow
//! handlers, typed payloads, and the connection / in-flight shape of the client.
//!
//! One server ([`ScenarioHandler`]) answers every scenario; [`run_load`] drives it with
//! `clients` concurrent callers spread over `connections` connections, each connection allowing
//! `max_in_flight_per_connection` calls at once, for a fixed duration, and returns [`Stats`].
//! `connections = 5, max_in_flight_per_connection = 1` is the classic ORB default (one call per
//! connection, a small pool); `connections = 1` with a large in-flight limit is the pipelined
//! default of this project.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;
use transport_core::Transport;
use transport_rpc::{code, ClientConfig, Handler, Request, RpcClient, RpcError, Status};

use super::typed::{self, Element, Fixed, StringDouble, Structured};

/// Method ids of the scenario server.
pub mod method {
    /// `void o()`.
    pub const PING: u32 = 1;
    /// Sleeps for the payload's milliseconds (u32 LE) without using CPU, then returns nothing.
    pub const SLEEP: u32 = 2;
    /// Base of the typed methods: `TYPED + 10 * kind + mode` (see [`super::TypedKind`],
    /// [`super::Mode`]).
    pub const TYPED: u32 = 100;
}

/// Direction of a byte- or typed-sequence call, as in the middleware comparisons.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Twoway call carrying the sequence, empty reply.
    Send = 0,
    /// Oneway call carrying the sequence.
    Oneway = 1,
    /// Empty call, the reply carries the sequence.
    Recv = 2,
    /// The sequence goes both ways.
    Echo = 3,
}

impl Mode {
    /// All modes, in table order.
    pub const ALL: [Mode; 4] = [Mode::Send, Mode::Oneway, Mode::Recv, Mode::Echo];

    fn from_u32(v: u32) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| *m as u32 == v)
    }

    /// Payload bytes moved per call for a sequence of `len` bytes.
    pub fn bytes_per_call(self, len: usize) -> u64 {
        match self {
            Mode::Echo => 2 * len as u64,
            _ => len as u64,
        }
    }
}

/// Which typed payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum TypedKind {
    /// Sequence of 10-character strings.
    Strings = 0,
    /// Sequence of `struct { string, f64 }`.
    StringDoubles = 1,
    /// Sequence of `struct { i64, i64, f64 }`.
    Fixed = 2,
    /// One ~2.2 KB structured request.
    Structured = 3,
}

impl TypedKind {
    /// All kinds, in table order.
    pub const ALL: [TypedKind; 4] = [
        TypedKind::Strings,
        TypedKind::StringDoubles,
        TypedKind::Fixed,
        TypedKind::Structured,
    ];

    fn from_u32(v: u32) -> Option<TypedKind> {
        TypedKind::ALL.into_iter().find(|k| *k as u32 == v)
    }

    /// Name for tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            TypedKind::Strings => String::NAME,
            TypedKind::StringDoubles => StringDouble::NAME,
            TypedKind::Fixed => Fixed::NAME,
            TypedKind::Structured => Structured::NAME,
        }
    }
}

impl Element for Structured {
    const NAME: &'static str = "structured";
    fn make(_: usize) -> Self {
        typed::structured()
    }
}

/// Sequences returned by `recv` calls, built once per (kind, length), type-erased per kind.
type SequenceCache = Mutex<HashMap<(u32, usize), Arc<dyn Any + Send + Sync>>>;

/// The scenario server's handler. Cheap to clone.
#[derive(Clone, Default)]
pub struct ScenarioHandler {
    /// Built once, encoded per call (the marshalling cost is what `recv` measures).
    cache: Arc<SequenceCache>,
}

impl std::fmt::Debug for ScenarioHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScenarioHandler").finish_non_exhaustive()
    }
}

fn invalid(what: impl std::fmt::Display) -> Status {
    Status::new(code::INVALID_ARGUMENT, what.to_string())
}

fn u32_arg(payload: &[u8]) -> Result<u32, Status> {
    let b: [u8; 4] = payload.try_into().map_err(|_| {
        invalid(format!(
            "expected a u32 argument, got {} bytes",
            payload.len()
        ))
    })?;
    Ok(u32::from_le_bytes(b))
}

impl ScenarioHandler {
    fn cached<E: Element>(&self, kind: u32, n: usize) -> Arc<Vec<E>> {
        let mut cache = self.cache.lock().expect("cache lock");
        let entry = cache
            .entry((kind, n))
            .or_insert_with(|| Arc::new(typed::sequence::<E>(n)));
        entry
            .clone()
            .downcast::<Vec<E>>()
            .expect("one element type per kind")
    }

    fn typed<E: Element>(&self, kind: u32, mode: Mode, payload: &[u8]) -> Result<Bytes, Status> {
        match mode {
            Mode::Send | Mode::Oneway => {
                typed::decode::<Vec<E>>(payload).map_err(invalid)?;
                Ok(Bytes::new())
            }
            Mode::Recv => {
                let n = u32_arg(payload)? as usize;
                Ok(typed::encode(&*self.cached::<E>(kind, n)))
            }
            Mode::Echo => {
                let v = typed::decode::<Vec<E>>(payload).map_err(invalid)?;
                Ok(typed::encode(&v))
            }
        }
    }

    fn dispatch_typed(&self, method: u32, payload: &[u8]) -> Result<Bytes, Status> {
        let rel = method - method::TYPED;
        let (kind, mode) = match (TypedKind::from_u32(rel / 10), Mode::from_u32(rel % 10)) {
            (Some(k), Some(m)) => (k, m),
            _ => return Err(Status::unknown_method(method)),
        };
        let k = kind as u32;
        match kind {
            TypedKind::Strings => self.typed::<String>(k, mode, payload),
            TypedKind::StringDoubles => self.typed::<StringDouble>(k, mode, payload),
            TypedKind::Fixed => self.typed::<Fixed>(k, mode, payload),
            TypedKind::Structured => self.typed::<Structured>(k, mode, payload),
        }
    }
}

impl Handler for ScenarioHandler {
    fn call(&self, req: Request) -> impl Future<Output = Result<Bytes, Status>> + Send + 'static {
        let this = self.clone();
        async move {
            match req.method {
                method::PING => Ok(Bytes::new()),
                method::SLEEP => {
                    let ms = u32_arg(&req.payload)?;
                    tokio::time::sleep(Duration::from_millis(ms as u64)).await;
                    Ok(Bytes::new())
                }
                m if m >= method::TYPED => this.dispatch_typed(m, &req.payload),
                m => Err(Status::unknown_method(m)),
            }
        }
    }
}

/// What each call of a load run does.
pub trait Workload: Send + Sync + 'static {
    /// Method and payload of the next call (encoding happens here, on the caller's clock).
    fn request(&self) -> (u32, Bytes);
    /// True for oneway calls.
    fn oneway(&self) -> bool {
        false
    }
    /// Checks (and for typed payloads decodes) a reply.
    fn check(&self, reply: &Bytes) -> Result<(), String>;
    /// Payload bytes moved per call (both directions).
    fn bytes_per_call(&self) -> u64;
}

/// `void o()`.
#[derive(Debug, Clone, Copy)]
pub struct Ping;

impl Workload for Ping {
    fn request(&self) -> (u32, Bytes) {
        (method::PING, Bytes::new())
    }
    fn check(&self, reply: &Bytes) -> Result<(), String> {
        if reply.is_empty() {
            Ok(())
        } else {
            Err(format!("ping returned {} bytes", reply.len()))
        }
    }
    fn bytes_per_call(&self) -> u64 {
        0
    }
}

/// A call whose handler takes `0` (server work simulated with a timer, no CPU).
#[derive(Debug, Clone, Copy)]
pub struct Slow(pub Duration);

impl Workload for Slow {
    fn request(&self) -> (u32, Bytes) {
        let ms = u32::try_from(self.0.as_millis()).unwrap_or(u32::MAX);
        (method::SLEEP, Bytes::copy_from_slice(&ms.to_le_bytes()))
    }
    fn check(&self, reply: &Bytes) -> Result<(), String> {
        Ping.check(reply)
    }
    fn bytes_per_call(&self) -> u64 {
        0
    }
}

/// A byte sequence sent twoway (the server answers with an empty reply).
#[derive(Debug, Clone)]
pub struct SendBytes(pub Bytes);

impl Workload for SendBytes {
    fn request(&self) -> (u32, Bytes) {
        // PING ignores its payload and answers empty: exactly the byte-sequence "send".
        (method::PING, self.0.clone())
    }
    fn check(&self, reply: &Bytes) -> Result<(), String> {
        Ping.check(reply)
    }
    fn bytes_per_call(&self) -> u64 {
        self.0.len() as u64
    }
}

/// A typed sequence of `E` in one of the four modes.
#[derive(Debug, Clone)]
pub struct Typed<E> {
    kind: TypedKind,
    mode: Mode,
    value: Arc<Vec<E>>,
    encoded_len: usize,
}

impl<E: Element> Typed<E> {
    /// A workload of `kind` (which must be `E`'s kind) with `n` elements.
    pub fn new(kind: TypedKind, mode: Mode, n: usize) -> Typed<E> {
        let value = Arc::new(typed::sequence::<E>(n));
        let encoded_len = typed::encode(&*value).len();
        Typed {
            kind,
            mode,
            value,
            encoded_len,
        }
    }

    /// Encoded size of the sequence.
    pub fn encoded_len(&self) -> usize {
        self.encoded_len
    }
}

impl<E: Element> Workload for Typed<E> {
    fn request(&self) -> (u32, Bytes) {
        let m = method::TYPED + 10 * self.kind as u32 + self.mode as u32;
        match self.mode {
            Mode::Recv => (
                m,
                Bytes::copy_from_slice(&(self.value.len() as u32).to_le_bytes()),
            ),
            _ => (m, typed::encode(&*self.value)),
        }
    }
    fn oneway(&self) -> bool {
        self.mode == Mode::Oneway
    }
    fn check(&self, reply: &Bytes) -> Result<(), String> {
        match self.mode {
            Mode::Send | Mode::Oneway => Ping.check(reply),
            Mode::Recv | Mode::Echo => {
                let v: Vec<E> = typed::decode(reply).map_err(|e| e.to_string())?;
                if v.len() == self.value.len() {
                    Ok(())
                } else {
                    Err(format!(
                        "got {} elements, expected {}",
                        v.len(),
                        self.value.len()
                    ))
                }
            }
        }
    }
    fn bytes_per_call(&self) -> u64 {
        self.mode.bytes_per_call(self.encoded_len)
    }
}

/// Shape of the client side of a load run.
#[derive(Debug, Clone, Serialize)]
pub struct LoadConfig {
    /// Concurrent callers (tasks), spread round-robin over the connections.
    pub clients: usize,
    /// Connections (one [`RpcClient`] each).
    pub connections: usize,
    /// Calls one connection may have in flight at once (1 = one call per connection).
    pub max_in_flight_per_connection: usize,
    /// How long the callers keep calling (each makes at least one call).
    #[serde(serialize_with = "secs")]
    pub duration: Duration,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// Result of a load run.
#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    /// Calls completed (replies received; oneway calls sent).
    pub completed: u64,
    /// Wall time of the run, s.
    pub seconds: f64,
    /// Completed calls per second.
    pub calls_per_s: f64,
    /// Payload throughput, Mbit/s (10^6 bit/s).
    pub mbit_s: f64,
    /// Mean response time, µs (0 for oneway runs).
    pub mean_us: f64,
    /// Median response time, µs.
    pub p50_us: f64,
    /// 99th percentile response time, µs.
    pub p99_us: f64,
    /// Fewest calls one caller completed: a caller starved by the others shows here (every
    /// caller completes at least one).
    pub caller_calls_min: u64,
    /// Most calls one caller completed.
    pub caller_calls_max: u64,
    /// Jain's fairness index of the callers' completed calls, (Σx)² / (n·Σx²): 1.0 when every
    /// caller completed as many calls as the others, 1/n when one caller did them all.
    pub fairness: f64,
}

/// Fewest and most calls per caller and Jain's fairness index of `counts` (each caller's
/// completed calls); (0, 0, 1.0) for no callers or no calls.
pub fn caller_spread(counts: &[u64]) -> (u64, u64, f64) {
    let min = counts.iter().copied().min().unwrap_or(0);
    let max = counts.iter().copied().max().unwrap_or(0);
    let sum: f64 = counts.iter().map(|&c| c as f64).sum();
    let squares: f64 = counts.iter().map(|&c| (c as f64) * (c as f64)).sum();
    let fairness = if squares == 0.0 {
        1.0
    } else {
        sum * sum / (counts.len() as f64 * squares)
    };
    (min, max, fairness)
}

/// Why a load run failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A call failed.
    #[error("call failed: {0}")]
    Rpc(#[from] RpcError),
    /// Could not connect.
    #[error("connect failed: {0}")]
    Connect(#[from] transport_core::TransportError),
    /// A reply had the wrong content.
    #[error("bad reply: {0}")]
    BadReply(String),
    /// The configuration cannot run.
    #[error("invalid load configuration: {0}")]
    Config(&'static str),
}

/// Runs `workload` against the scenario server at `addr` with the client shape `config`.
pub async fn run_load<T, W>(
    transport: &T,
    addr: &T::Addr,
    config: &LoadConfig,
    workload: Arc<W>,
) -> Result<Stats, LoadError>
where
    T: Transport,
    W: Workload,
{
    if config.clients == 0 || config.connections == 0 || config.max_in_flight_per_connection == 0 {
        return Err(LoadError::Config(
            "clients, connections and in-flight limit must all be at least 1",
        ));
    }
    let mut conns = Vec::with_capacity(config.connections);
    for _ in 0..config.connections {
        let conn = transport.connect(addr).await?;
        conns.push(Arc::new(RpcClient::new(
            conn,
            ClientConfig::default().with_max_in_flight(config.max_in_flight_per_connection),
        )));
    }
    let start = Instant::now();
    let stop = start + config.duration;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..config.clients {
        let client = conns[i % conns.len()].clone();
        let workload = workload.clone();
        tasks.spawn(caller(client, workload, stop));
    }
    let mut latencies: Vec<u32> = Vec::new();
    let mut completed = 0u64;
    let mut per_caller = Vec::with_capacity(config.clients);
    let mut first_error = None;
    while let Some(joined) = tasks.join_next().await {
        match joined.expect("caller task panicked") {
            Ok((n, lat)) => {
                completed += n;
                per_caller.push(n);
                latencies.extend(lat);
            }
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    // Oneway calls count once the server has read them: a twoway call behind them on each
    // connection returns only after they were received.
    if workload.oneway() {
        for c in &conns {
            c.call(method::PING, Bytes::new()).await?;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    for c in &conns {
        let _ = c.close().await;
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    latencies.sort_unstable();
    let pct = |p: f64| -> f64 {
        if latencies.is_empty() {
            return 0.0;
        }
        let i = ((latencies.len() as f64 - 1.0) * p).round() as usize;
        latencies[i] as f64
    };
    let mean_us = if latencies.is_empty() {
        0.0
    } else {
        latencies.iter().map(|&l| l as f64).sum::<f64>() / latencies.len() as f64
    };
    let (caller_calls_min, caller_calls_max, fairness) = caller_spread(&per_caller);
    Ok(Stats {
        completed,
        seconds,
        calls_per_s: completed as f64 / seconds,
        mbit_s: (completed * workload.bytes_per_call()) as f64 * 8.0 / seconds / 1e6,
        mean_us,
        p50_us: pct(0.5),
        p99_us: pct(0.99),
        caller_calls_min,
        caller_calls_max,
        fairness,
    })
}

async fn caller<S, W>(
    client: Arc<RpcClient<S>>,
    workload: Arc<W>,
    stop: Instant,
) -> Result<(u64, Vec<u32>), LoadError>
where
    S: transport_core::MessageSender,
    W: Workload,
{
    let mut n = 0u64;
    let mut lat = Vec::new();
    // Every caller makes at least one call, however late it starts (slow machines, emulated
    // RDMA): a run never ends without a figure.
    loop {
        let (m, payload) = workload.request();
        if workload.oneway() {
            client.oneway(m, payload).await?;
        } else {
            let t0 = Instant::now();
            let reply = client.call(m, payload).await?;
            lat.push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32);
            workload.check(&reply).map_err(LoadError::BadReply)?;
        }
        n += 1;
        if Instant::now() >= stop {
            break;
        }
    }
    Ok((n, lat))
}

#[cfg(test)]
mod tests {
    use super::caller_spread;

    /// Equal callers are perfectly fair; one caller doing everything scores 1/n; the spread
    /// names the fewest and most calls.
    #[test]
    fn caller_spread_names_the_extremes_and_jains_index() {
        assert_eq!(caller_spread(&[5, 5, 5, 5]), (5, 5, 1.0));
        let (min, max, f) = caller_spread(&[0, 0, 0, 12]);
        assert_eq!((min, max), (0, 12));
        assert!((f - 0.25).abs() < 1e-12, "{f}");
        // (9 + 234)² / (2 · (9² + 234²)) = 59 049 / 109 674
        let (min, max, f) = caller_spread(&[234, 9]);
        assert_eq!((min, max), (9, 234));
        assert!((f - 59_049.0 / 109_674.0).abs() < 1e-12, "{f}");
    }

    /// No callers, or callers with no calls, are reported as even rather than dividing by zero.
    #[test]
    fn caller_spread_of_nothing_is_even() {
        assert_eq!(caller_spread(&[]), (0, 0, 1.0));
        assert_eq!(caller_spread(&[0, 0]), (0, 0, 1.0));
    }
}
