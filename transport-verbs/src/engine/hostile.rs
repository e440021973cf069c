//! The engine driven by a hostile peer, without a device: arbitrary peer messages, READ
//! completions, application reads and time, with the engine's promises checked after every
//! step. One driver for the property test (`tests.rs`) and the fuzz target
//! (`fuzz/fuzz_targets/verbs_engine.rs`, through the `fuzzing` feature's [`crate::fuzz`]).

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use transport_core::{HeaderBytes, Metrics};

use super::{Delivery, Engine, EngineConfig, RecvBuf, Work};
use crate::proto::{Th, TH_LEN};

/// A receive buffer of the tests: just the bytes.
pub(crate) struct Buf(pub(crate) Vec<u8>);

impl RecvBuf for Buf {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
    fn into_payload(self, range: Range<usize>) -> Bytes {
        Bytes::from(self.0).slice(range)
    }
}

/// Receive queue depth of the engine under test.
pub(crate) const DEPTH: u32 = 8;
/// Receive buffer size of the engine under test.
pub(crate) const BUF: usize = 4096;

/// The settings of the engine under test: small, so that limits are reached quickly.
pub(crate) fn cfg() -> EngineConfig {
    EngineConfig {
        speaks_first: true,
        recv_depth: DEPTH,
        recv_buf_size: BUF,
        max_message_size: 1 << 20,
        zero_copy_recv_min: 1024,
        rendezvous_chunk: 4096,
        rendezvous_window: 2,
        max_rendezvous_in: 4,
        max_rendezvous_in_bytes: 64 << 10,
        max_rendezvous_out: 4,
        backlog_max: 32,
        backlog_bytes: 256 << 10,
        handshake_timeout: Duration::from_secs(10),
        rendezvous_timeout: Duration::from_secs(30),
        linger: Duration::from_secs(10),
        read_depth: 4,
        probe_hello: false,
    }
}

/// A peer message: transport header, message header, payload.
pub(crate) fn encode(th: Th, header: &[u8], payload: &[u8]) -> Buf {
    let h = HeaderBytes::new(header).expect("header fits");
    let mut out = vec![0u8; TH_LEN + h.len()];
    let n = th.encode(&h, &mut out);
    out.truncate(n);
    out.extend_from_slice(payload);
    Buf(out)
}

/// The peer's HELLO, granting `credits`.
pub(crate) fn hello(credits: u16) -> Th {
    Th {
        credits,
        ..Th::hello(DEPTH, BUF as u64, 4, 64, 4)
    }
}

/// What the engine may hold because of a peer, at most: rendezvous targets (the announced
/// budget, or one message of the maximum size), plus messages ready behind a transfer (at
/// most the backlog budget plus what the peer's credits let through).
pub(crate) fn bound(c: &EngineConfig) -> u64 {
    let targets =
        c.max_rendezvous_in_bytes.max(c.max_message_size as u64) + c.max_message_size as u64;
    let ready = c.backlog_bytes
        + c.max_message_size as u64
        + (c.backlog_max as u64 + c.recv_depth as u64) * c.recv_buf_size as u64;
    targets + ready
}

/// A message a hostile peer sends, as the fields of a transport header (any kind, or an
/// unknown one, and any numbers) with a message header and payload of the given lengths.
#[derive(Debug, Clone)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct HostileMsg {
    /// The kind byte (1..=7 are kinds; others are unknown).
    pub kind: u8,
    /// Credits granted.
    pub credits: u16,
    /// Rendezvous id.
    pub id: u32,
    /// Announced length (used when `honest_len` is false).
    pub len: u64,
    /// Remote address of a rendezvous.
    pub addr: u64,
    /// Remote key of a rendezvous.
    pub rkey: u32,
    /// The header's auxiliary field.
    pub aux: u32,
    /// Message header length (the byte says it; at most 64 bytes follow).
    pub hlen: u8,
    /// Payload length.
    pub plen: u16,
    /// Announce the true payload length, so eager messages get past decoding.
    pub honest_len: bool,
}

impl HostileMsg {
    /// The message's bytes on the wire.
    pub fn bytes(&self) -> Vec<u8> {
        let plen = usize::from(self.plen);
        let mut m = vec![0u8; TH_LEN];
        m[0] = self.kind;
        m[1] = self.hlen;
        m[2..4].copy_from_slice(&self.credits.to_le_bytes());
        m[4..8].copy_from_slice(&self.id.to_le_bytes());
        let len = if self.honest_len {
            plen as u64
        } else {
            self.len
        };
        m[8..16].copy_from_slice(&len.to_le_bytes());
        m[16..24].copy_from_slice(&self.addr.to_le_bytes());
        m[24..28].copy_from_slice(&self.rkey.to_le_bytes());
        m[28..32].copy_from_slice(&self.aux.to_le_bytes());
        m.extend(std::iter::repeat_n(0xab, usize::from(self.hlen).min(64)));
        m.extend(std::iter::repeat_n(0xcd, plen));
        m
    }
}

/// One step of a hostile peer, or of the application and the clock around the engine.
#[derive(Debug, Clone)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub enum Step {
    /// The peer sends a message built from header fields.
    Msg(HostileMsg),
    /// The peer sends these bytes as a message.
    Raw(Vec<u8>),
    /// The peer sends a valid HELLO.
    Hello,
    /// The glue posts every work request the engine asks for.
    Pump,
    /// The oldest READ posted completes.
    ReadDone,
    /// The application takes this many delivered messages.
    Take(u8),
    /// This many seconds pass.
    Wait(u8),
}

/// Runs `steps` against a fresh engine and checks after each one that the engine holds no
/// more than [`bound`] and no more incoming rendezvous transfers than it announced, emits READs only inside a range the peer announced and a target it
/// allocated, delivers only targets it allocated, and posts nothing once it has failed.
/// The engine must not panic or overflow (debug arithmetic checks) on any input. Returns
/// the first broken promise.
pub fn run(steps: &[Step]) -> Result<(), String> {
    // Probing a late HELLO on (iWARP's connecting side): the probes come and go among the
    // hostile steps too.
    let c = EngineConfig {
        probe_hello: true,
        ..cfg()
    };
    let mut now = Instant::now();
    let mut e: Engine<Bytes> = Engine::new(c.clone(), Arc::new(Metrics::default()), now);
    let mut failed = false;
    // Announced ranges: (rkey, addr, len) of every RTS received, to check READs.
    let mut announced: Vec<(u32, u64, u64)> = Vec::new();
    let mut reads: VecDeque<(u64, usize)> = VecDeque::new();
    let mut targets: BTreeMap<u64, usize> = BTreeMap::new();
    let mut app: VecDeque<u64> = VecDeque::new();
    // Every other message is offered to the receiving half's fast path first, as the glue
    // does when the half polls on its own task; the rest take `on_recv` only.
    let mut fast = false;
    for s in steps {
        let r = match s {
            Step::Msg(m) => {
                fast = !fast;
                receive(&mut e, m.bytes(), fast, &mut announced, &mut app)?
            }
            Step::Raw(m) => {
                fast = !fast;
                receive(&mut e, m.clone(), fast, &mut announced, &mut app)?
            }
            Step::Hello => e
                .on_recv(encode(hello(DEPTH as u16 - 1), &[], &[]))
                .map(|_| ()),
            Step::Pump => {
                while let Some(w) = e.poll_work() {
                    if failed {
                        return Err("work after a failure".into());
                    }
                    if let Work::Read(r) = w {
                        if let Some(n) = r.alloc {
                            targets.insert(r.tag, n);
                        }
                        let t = targets.get(&r.tag).copied();
                        if t.is_none_or(|n| r.offset + r.len > n) {
                            return Err(format!("READ outside its target: {r:?}, target {t:?}"));
                        }
                        if !announced.iter().any(|&(k, a, l)| {
                            k == r.rkey
                                && r.remote_addr >= a
                                && r.remote_addr.checked_add(r.len as u64).is_some_and(|end| {
                                    a.checked_add(l).is_some_and(|limit| end <= limit)
                                })
                        }) {
                            return Err(format!("READ outside any announced range: {r:?}"));
                        }
                        reads.push_back((r.tag, r.len));
                    }
                }
                Ok(())
            }
            Step::ReadDone => {
                if let Some((tag, len)) = reads.pop_front() {
                    e.on_read_done(tag, len);
                }
                Ok(())
            }
            Step::Take(n) => {
                for _ in 0..*n % 10 {
                    app.pop_front();
                }
                e.set_backlog(app.len(), app.iter().sum());
                Ok(())
            }
            Step::Wait(secs) => {
                now += Duration::from_secs(u64::from(*secs % 40));
                e.handle_timeout(now)
            }
        };
        if r.is_err() {
            failed = true;
        }
        // As the glue does after every step.
        if e.needs_clock() {
            e.clock(now);
        }
        while let Some(d) = e.poll_delivery() {
            let n = match d {
                Delivery::Msg(m) => m.payload.len() as u64,
                Delivery::Rendezvous { tag, len, .. } => {
                    if targets.remove(&tag).is_none() {
                        return Err(format!("delivered target {tag} was never allocated"));
                    }
                    len as u64
                }
                _ => 0,
            };
            app.push_back(n);
        }
        e.set_backlog(app.len(), app.iter().sum());
        let held = e.held_bytes() + app.iter().sum::<u64>();
        if held > bound(&c) {
            return Err(format!("held {held} > bound {}", bound(&c)));
        }
        let (transfers_in, _) = e.rendezvous_counts();
        if transfers_in > c.max_rendezvous_in {
            return Err(format!(
                "{transfers_in} incoming rendezvous transfers outstanding, {} announced",
                c.max_rendezvous_in
            ));
        }
        if failed && e.poll_work().is_some() {
            return Err("a failed engine posts work".into());
        }
    }
    Ok(())
}

/// Hands `m` to the engine as a received message, noting the range an RTS announces. With
/// `fast`, offers it to [`Engine::recv_small`] first; a message taken there goes to `app` (the
/// application holds it) and must carry the bytes the peer sent (else the outer error: a
/// broken promise).
fn receive(
    e: &mut Engine<Bytes>,
    m: Vec<u8>,
    fast: bool,
    announced: &mut Vec<(u32, u64, u64)>,
    app: &mut VecDeque<u64>,
) -> Result<Result<(), crate::VerbsError>, String> {
    if fast {
        if let Some(msg) = e.recv_small(&m) {
            let carried = m.len() - TH_LEN - msg.header.len();
            if msg.payload.len() != carried || m.get(1) != Some(&(msg.header.len() as u8)) {
                return Err(format!(
                    "fast path: {} payload bytes taken from a message carrying {carried}",
                    msg.payload.len()
                ));
            }
            app.push_back(msg.payload.len() as u64);
            return Ok(Ok(()));
        }
    }
    if m.len() >= TH_LEN && m[0] == crate::proto::Kind::Rts as u8 {
        let word = |r: Range<usize>| {
            let mut b = [0u8; 8];
            b[..r.len()].copy_from_slice(&m[r]);
            u64::from_le_bytes(b)
        };
        announced.push((word(24..28) as u32, word(16..24), word(8..16)));
    }
    Ok(e.on_recv(Buf(m)).map(|_| ()))
}
