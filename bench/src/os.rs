//! The operating system's own figures for a socket transport: the limit raw and RPC are
//! measured against.
//!
//! Blocking `std` sockets ([`UnixStream`], or [`TcpStream`] with `TCP_NODELAY`), one client
//! thread and one server thread, no async runtime, no framing, one reused buffer per side:
//!
//! - **ping-pong** ([`ping`]): the client writes 1 byte, the server reads it and writes it
//!   back, repeated; every round trip goes into a histogram, as for the raw and RPC pings.
//! - **stream** ([`stream`]): the client writes `count` buffers of `size` bytes into a sink
//!   that reads them with a buffer of `size` bytes (at least 64 KiB, the stream receiver's
//!   read buffer, at most 1 MiB) and then answers with the number of bytes it read. The clock
//!   runs from the first write to that answer, like the raw stream into the bench server's
//!   sink; 20 buffers go through first, unmeasured, as for raw and RPC.
//!
//! The server ([`Server`]) runs on a thread pinned where the bench server is pinned, each
//! connection on a thread of its own pinned to the same CPU, and the client thread is pinned
//! where the bench's client threads are: the same placement as raw and RPC, in the same run.
//! Socket buffers are the kernel's defaults (autotuned), as on the backends' connections.
//!
//! Every blocking read and write has a timeout ([`IO_TIMEOUT`]): a peer that stops answering
//! ends the measurement with an error instead of hanging it.

use crate::measure::{self, Outcome};
use crate::sys;
use hdrhistogram::Histogram;
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use transport_core::MetricsSnapshot;

/// Longest a blocking read or write of the OS baseline may wait.
pub const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// Buffers streamed (or round trips made) before the clock starts.
const WARMUP: u64 = 20;

/// The sink's read buffer: the message size, within these bounds.
const MIN_READ: usize = 64 << 10;
const MAX_READ: usize = 1 << 20;

/// First byte of a connection: what the server does with it.
const MODE_PING: u8 = b'p';
const MODE_SINK: u8 = b's';

/// Where an OS baseline server listens (or should listen).
pub use crate::measure::SocketTarget as Target;

impl Target {
    /// What the baseline is, for the report.
    pub fn describe(&self) -> &'static str {
        match self {
            Target::Uds(_) => "blocking std UnixStream, one client and one server thread, no runtime",
            Target::Tcp(_) => {
                "blocking std TcpStream with TCP_NODELAY, one client and one server thread, no runtime"
            }
        }
    }
}

/// A connected socket of either kind.
enum Sock {
    Uds(UnixStream),
    Tcp(TcpStream),
}

impl Sock {
    fn connect(target: &Target) -> Result<Sock, String> {
        let s = match target {
            Target::Uds(p) => UnixStream::connect(p)
                .map(Sock::Uds)
                .map_err(|e| format!("os: connect to {}: {e}", p.display()))?,
            Target::Tcp(a) => TcpStream::connect(a)
                .map(Sock::Tcp)
                .map_err(|e| format!("os: connect to {a}: {e}"))?,
        };
        s.configure()?;
        Ok(s)
    }

    /// Timeouts on both directions, and `TCP_NODELAY`.
    fn configure(&self) -> Result<(), String> {
        let r = match self {
            Sock::Uds(s) => s
                .set_read_timeout(Some(IO_TIMEOUT))
                .and_then(|()| s.set_write_timeout(Some(IO_TIMEOUT))),
            Sock::Tcp(s) => s
                .set_nodelay(true)
                .and_then(|()| s.set_read_timeout(Some(IO_TIMEOUT)))
                .and_then(|()| s.set_write_timeout(Some(IO_TIMEOUT))),
        };
        r.map_err(|e| format!("os: socket options: {e}"))
    }
}

/// Counts the system calls a blocking socket makes.
struct Counted<S> {
    s: S,
    syscalls: u64,
}

impl<S: Read + Write> Counted<S> {
    fn new(s: S) -> Self {
        Counted { s, syscalls: 0 }
    }

    fn write_all(&mut self, mut buf: &[u8]) -> std::io::Result<()> {
        while !buf.is_empty() {
            self.syscalls += 1;
            match self.s.write(buf) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => buf = &buf[n..],
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads into `buf`; 0 only at the end of the stream.
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            self.syscalls += 1;
            match self.s.read(buf) {
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                r => return r,
            }
        }
    }

    fn read_exact(&mut self, mut buf: &mut [u8]) -> std::io::Result<()> {
        while !buf.is_empty() {
            match self.read(buf)? {
                0 => return Err(ErrorKind::UnexpectedEof.into()),
                n => buf = &mut buf[n..],
            }
        }
        Ok(())
    }
}

/// The OS baseline server: accepts connections until dropped.
pub struct Server {
    target: Target,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<Option<()>>>,
}

enum AnyListener {
    Uds(UnixListener),
    Tcp(TcpListener),
}

impl Server {
    /// Listens at `bind` (a TCP port 0 gets a free port) on a thread pinned to `core`.
    pub fn start(bind: Target, core: Option<usize>) -> Result<Server, String> {
        let listener = match &bind {
            Target::Uds(p) => UnixListener::bind(p)
                .map(AnyListener::Uds)
                .map_err(|e| format!("os: listen on {}: {e}", p.display()))?,
            Target::Tcp(a) => TcpListener::bind(a)
                .map(AnyListener::Tcp)
                .map_err(|e| format!("os: listen on {a}: {e}"))?,
        };
        let target = match &listener {
            AnyListener::Uds(_) => bind,
            AnyListener::Tcp(l) => {
                Target::Tcp(l.local_addr().map_err(|e| format!("os: listen: {e}"))?)
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let accept = {
            let stop = stop.clone();
            sys::spawn_pinned("os-server", core, move || {
                accept_loop(listener, core, &stop)
            })
            .map_err(|e| format!("os: {e}"))?
        };
        Ok(Server {
            target,
            stop,
            accept: Some(accept),
        })
    }

    /// Where clients connect.
    pub fn target(&self) -> &Target {
        &self.target
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept: it sees the flag and returns. Connection threads end when their
        // clients close (or after IO_TIMEOUT); they are not waited for.
        if Sock::connect(&self.target).is_ok() {
            if let Some(h) = self.accept.take() {
                let _ = h.join();
            }
        }
        if let Target::Uds(p) = &self.target {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn accept_loop(listener: AnyListener, core: Option<usize>, stop: &AtomicBool) {
    loop {
        let conn = match &listener {
            AnyListener::Uds(l) => l.accept().map(|(s, _)| Sock::Uds(s)),
            AnyListener::Tcp(l) => l.accept().map(|(s, _)| Sock::Tcp(s)),
        };
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(conn) = conn else {
            // Out of descriptors or an aborted connection: the client sees its own error.
            continue;
        };
        let _ = std::thread::Builder::new()
            .name("os-conn".into())
            .spawn(move || {
                if let Some(c) = core {
                    if sys::pin_current_thread(c).is_err() {
                        return;
                    }
                }
                if conn.configure().is_err() {
                    return;
                }
                let _ = match conn {
                    Sock::Uds(s) => serve(Counted::new(s)),
                    Sock::Tcp(s) => serve(Counted::new(s)),
                };
            });
    }
}

/// Serves one connection: a mode byte, then ping-pong or sink until the client closes.
fn serve<S: Read + Write>(mut s: Counted<S>) -> std::io::Result<()> {
    let mut mode = [0u8];
    s.read_exact(&mut mode)?;
    match mode[0] {
        MODE_PING => {
            let mut b = [0u8];
            while s.read(&mut b)? == 1 {
                s.write_all(&b)?;
            }
            Ok(())
        }
        MODE_SINK => {
            // Phases: size u32 LE, bytes u64 LE, then that many bytes; answered with the
            // count read (u64 LE).
            let mut buf = Vec::new();
            loop {
                let mut head = [0u8; 12];
                match s.read(&mut head[..1])? {
                    0 => return Ok(()),
                    _ => s.read_exact(&mut head[1..])?,
                }
                let size = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
                let total = u64::from_le_bytes(head[4..].try_into().expect("8 bytes"));
                buf.resize(size.clamp(MIN_READ, MAX_READ), 0);
                let mut got = 0u64;
                while got < total {
                    let want = (total - got).min(buf.len() as u64) as usize;
                    match s.read(&mut buf[..want])? {
                        0 => return Err(ErrorKind::UnexpectedEof.into()),
                        n => got += n as u64,
                    }
                }
                s.write_all(&got.to_le_bytes())?;
            }
        }
        _ => Err(ErrorKind::InvalidData.into()),
    }
}

/// What the client thread measured (also the link's client, `crate::link`).
pub(crate) struct Measured {
    pub(crate) elapsed: Duration,
    pub(crate) bytes: u64,
    pub(crate) hist: Option<Histogram<u64>>,
    pub(crate) syscalls: u64,
    pub(crate) messages: u64,
    pub(crate) usage: sys::Usage,
}

/// Runs `work` on a client thread pinned to `core` and waits for it (bounded: every read
/// and write of the work has a timeout).
fn on_client_thread<F>(core: Option<usize>, work: F) -> Result<Measured, String>
where
    F: FnOnce() -> Result<Measured, String> + Send + 'static,
{
    std::thread::Builder::new()
        .name("os-client".into())
        .spawn(move || {
            if let Some(c) = core {
                sys::pin_current_thread(c)?;
            }
            work()
        })
        .map_err(|e| format!("os: client thread: {e}"))?
        .join()
        .map_err(|_| "os: the client thread panicked".to_string())?
}

/// 1-byte ping-pong with the server at `target`: `count` round trips after a warm-up, from a
/// client thread pinned to `core`. The outcome has the round-trip histogram and no payload.
pub fn ping(target: &Target, count: u64, core: Option<usize>) -> Result<Outcome, String> {
    let target = target.clone();
    let m = on_client_thread(core, move || match Sock::connect(&target)? {
        Sock::Uds(s) => ping_on(Counted::new(s), count),
        Sock::Tcp(s) => ping_on(Counted::new(s), count),
    })?;
    Ok(outcome(m, count))
}

fn round_trip<S: Read + Write>(s: &mut Counted<S>) -> std::io::Result<()> {
    let mut b = [0u8];
    s.write_all(b"p")?;
    s.read_exact(&mut b)?;
    if b != *b"p" {
        return Err(std::io::Error::new(ErrorKind::InvalidData, "wrong echo"));
    }
    Ok(())
}

fn ping_on<S: Read + Write>(mut s: Counted<S>, count: u64) -> Result<Measured, String> {
    let io = |e: std::io::Error| format!("os ping: {e}");
    s.write_all(&[MODE_PING]).map_err(io)?;
    for _ in 0..WARMUP {
        round_trip(&mut s).map_err(io)?;
    }
    let mut h = measure::new_hist();
    let (u0, calls0) = (sys::usage(), s.syscalls);
    let start = Instant::now();
    for _ in 0..count {
        let t = Instant::now();
        round_trip(&mut s).map_err(io)?;
        measure::record(&mut h, t.elapsed());
    }
    let elapsed = start.elapsed();
    let usage = sys::usage() - u0;
    Ok(Measured {
        elapsed,
        bytes: 0,
        hist: Some(h),
        syscalls: s.syscalls - calls0,
        messages: count,
        usage,
    })
}

/// A one-way stream of `count` writes of `size` bytes into the sink at `target`, after a
/// warm-up, from a client thread pinned to `core`. The sink's count of the bytes it read must
/// equal the bytes written, or this is an error.
pub fn stream(
    target: &Target,
    size: usize,
    count: u64,
    core: Option<usize>,
) -> Result<Outcome, String> {
    let size32 = u32::try_from(size).map_err(|_| format!("os stream: size {size} above 4 GiB"))?;
    let target = target.clone();
    let m = on_client_thread(core, move || match Sock::connect(&target)? {
        Sock::Uds(s) => stream_on(Counted::new(s), size32, count),
        Sock::Tcp(s) => stream_on(Counted::new(s), size32, count),
    })?;
    Ok(outcome(m, count))
}

/// Writes `count` buffers of `payload` as one sink phase; returns the bytes the sink read.
fn phase<S: Read + Write>(s: &mut Counted<S>, payload: &[u8], count: u64) -> Result<u64, String> {
    let io = |e: std::io::Error| format!("os stream: {e}");
    let total = count * payload.len() as u64;
    let mut head = [0u8; 12];
    head[..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    head[4..].copy_from_slice(&total.to_le_bytes());
    s.write_all(&head).map_err(io)?;
    for _ in 0..count {
        s.write_all(payload).map_err(io)?;
    }
    let mut ack = [0u8; 8];
    s.read_exact(&mut ack).map_err(io)?;
    let got = u64::from_le_bytes(ack);
    if got != total {
        return Err(format!("os stream: the sink read {got} of {total} bytes"));
    }
    Ok(got)
}

fn stream_on<S: Read + Write>(
    mut s: Counted<S>,
    size: u32,
    count: u64,
) -> Result<Measured, String> {
    s.write_all(&[MODE_SINK])
        .map_err(|e| format!("os stream: {e}"))?;
    let payload = vec![0xa5u8; size as usize];
    phase(&mut s, &payload, WARMUP)?;
    let (u0, calls0) = (sys::usage(), s.syscalls);
    let start = Instant::now();
    let bytes = phase(&mut s, &payload, count)?;
    let elapsed = start.elapsed();
    let usage = sys::usage() - u0;
    Ok(Measured {
        elapsed,
        bytes,
        hist: None,
        syscalls: s.syscalls - calls0,
        messages: count,
        usage,
    })
}

pub(crate) fn outcome(m: Measured, calls: u64) -> Outcome {
    Outcome {
        elapsed: m.elapsed.max(Duration::from_nanos(1)),
        calls,
        payload_bytes: m.bytes,
        latency: m.hist,
        metrics: {
            let mut s = MetricsSnapshot::default();
            s.messages_sent = m.messages;
            s.bytes_sent = m.bytes;
            s.syscalls = m.syscalls;
            s
        },
        server_metrics: MetricsSnapshot::default(),
        cpu: m.usage.cpu,
        page_faults: m.usage.minor_faults,
        context_switches: m.usage.context_switches,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server of each kind, unpinned (the tests run in parallel with others). The Unix
    /// socket lives in a private directory, removed with it.
    fn servers() -> Vec<(Server, Option<tempfile::TempDir>)> {
        let dir = tempfile::tempdir().unwrap();
        let uds = Server::start(Target::Uds(dir.path().join("os.sock")), None).unwrap();
        let tcp = Server::start(Target::Tcp("127.0.0.1:0".parse().unwrap()), None).unwrap();
        assert!(
            matches!(tcp.target(), Target::Tcp(a) if a.port() != 0),
            "the port is the one bound"
        );
        vec![(uds, Some(dir)), (tcp, None)]
    }

    #[test]
    fn ping_makes_the_round_trips_asked_for() {
        for (server, _dir) in servers() {
            let t = server.target();
            for count in [1, 257] {
                let o = ping(t, count, None).unwrap();
                assert_eq!(o.calls, count, "{t:?}");
                assert_eq!(o.payload_bytes, 0, "a latency test moves no payload");
                let h = o.latency.as_ref().expect("a histogram");
                assert_eq!(h.len(), count, "one sample per round trip: {t:?}");
                assert!(h.min() > 0, "{t:?}");
                assert!(o.elapsed > Duration::ZERO);
                // A write and a read per round trip, at least.
                assert!(o.metrics.syscalls >= 2 * count, "{:?}", o.metrics);
                let mean = o.elapsed.as_secs_f64() / count as f64;
                assert!(
                    mean < IO_TIMEOUT.as_secs_f64(),
                    "{t:?}: {mean} s per round trip"
                );
            }
        }
    }

    #[test]
    fn stream_counts_every_byte_written() {
        for (server, _dir) in servers() {
            let t = server.target();
            for (size, count) in [(1024usize, 300u64), (64 << 10, 40), (1 << 20, 5), (3, 7)] {
                let o = stream(t, size, count, None).unwrap();
                assert_eq!(o.calls, count, "{t:?}");
                assert_eq!(o.payload_bytes, size as u64 * count, "{t:?} {size}");
                assert!(o.latency.is_none());
                assert!(o.mbit_s() > 0.0 && o.mbit_s().is_finite(), "{t:?} {size}");
                assert!(o.metrics.syscalls >= count, "{:?}", o.metrics);
                assert_eq!(o.metrics.bytes_sent, size as u64 * count);
            }
            // The same server serves the next connection, and several in a row.
            assert_eq!(ping(t, 3, None).unwrap().calls, 3);
        }
    }

    /// A sink whose peer disappears mid-phase, or a peer that sends an unknown mode, ends
    /// that connection only.
    #[test]
    fn a_broken_client_ends_only_its_connection() {
        for (server, _dir) in servers() {
            let t = server.target();
            let mut s = Sock::connect(t).unwrap();
            let mut head = vec![MODE_SINK];
            head.extend_from_slice(&1024u32.to_le_bytes());
            head.extend_from_slice(&(1u64 << 40).to_le_bytes());
            match &mut s {
                Sock::Uds(s) => s.write_all(&head).unwrap(),
                Sock::Tcp(s) => s.write_all(&head).unwrap(),
            }
            drop(s);
            let mut s = Sock::connect(t).unwrap();
            match &mut s {
                Sock::Uds(s) => s.write_all(b"?").unwrap(),
                Sock::Tcp(s) => s.write_all(b"?").unwrap(),
            }
            drop(s);
            assert_eq!(stream(t, 4096, 10, None).unwrap().payload_bytes, 40960);
        }
    }

    /// Dropping the server stops its accept thread (the drop returns) and removes its socket.
    #[test]
    fn drop_stops_the_server() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("os.sock");
        let server = Server::start(Target::Uds(path.clone()), None).unwrap();
        assert!(path.exists());
        drop(server);
        assert!(!path.exists());
        assert!(Sock::connect(&Target::Uds(path)).is_err());
    }

    /// Client and server threads can be pinned (to the first allowed CPU, as `--pin same`).
    #[test]
    fn pinned_ping_and_stream() {
        let cpu = sys::allowed_cpus().first().copied();
        let server = Server::start(Target::Tcp("127.0.0.1:0".parse().unwrap()), cpu).unwrap();
        assert_eq!(ping(server.target(), 50, cpu).unwrap().calls, 50);
        assert_eq!(
            stream(server.target(), 1000, 50, cpu)
                .unwrap()
                .payload_bytes,
            50_000
        );
    }
}
