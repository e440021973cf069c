//! The verbs protocol of one connection as a plain state machine (sans-IO, after quinn-proto).
//!
//! The engine knows nothing of queue pairs, memory registration or tokio. The glue
//! (`conn.rs`) feeds it what happened, and asks it what to do:
//!
//! - inputs: [`Engine::send`] / [`Engine::close`] (the application), [`Engine::on_recv`] (a
//!   received message), [`Engine::on_read_done`] (an RDMA READ finished),
//!   [`Engine::on_activity`] (any other completion), [`Engine::set_backlog`] (what the
//!   application has not taken yet), [`Engine::clock`] and [`Engine::handle_timeout`] (time:
//!   the clock is read only when a step armed a deadline, never per message);
//! - outputs: [`Engine::poll_work`] (work requests to post: control messages, eager messages,
//!   RTS, memory-window invalidations, RDMA READs), [`Engine::poll_delivery`] (messages for the
//!   application, in order), [`Engine::poll_timeout`] (when to call back).
//!
//! It owns the rules: credits, eager and rendezvous, reassembly, close and linger,
//! backpressure. Every number a peer sends is checked against the connection's state and
//! limits before it changes anything; a violation is a [`ProtocolViolation`] that fails the
//! connection, never a panic, a wrap or unbounded work.
//!
//! ## Credits
//!
//! Each side has `recv_depth` receive buffers' worth of credits to grant (posted buffers of its
//! own, or a quota over the device's shared receive queue: the engine does not know which) and
//! starts with one credit, spent on its HELLO. A SEND consumes one of the peer's buffers, so it
//! needs a credit; every message carries the credits for the buffers re-posted since the last
//! grant. Data (EAGER, RTS) needs three credits and a FIN two, so the last credit is always
//! left for a CREDIT or CLOSE and the one before it for a FIN: the two sides cannot deadlock on
//! credits. The buffer a control message (HELLO, CREDIT, FIN) took is granted back even while
//! credits are withheld (it adds nothing to the backlog), and one a FIN took is granted back at
//! once, by a CREDIT of its own, when the peer holds fewer than two: a FIN is what lets a peer's
//! blocked sender go on, and it must not wait for the application that waits for it. For the
//! same reason, while payloads of this side are out by rendezvous and the peer holds fewer
//! than two, withheld credits are lent to it up to three (at most three between two of its
//! FINs): a peer that spent its second-to-last credit on a CREDIT could not send the FIN this
//! side's application waits for. The engine also counts the credits the peer holds: a
//! message that arrives without one, or a grant beyond the peer's announced queue, is a
//! violation.
//!
//! ## Bounds on what a peer can make this side hold
//!
//! - Rendezvous in: at most `max_rendezvous_in` transfers and `max_rendezvous_in_bytes` bytes
//!   outstanding (announced in HELLO; one transfer of any size up to the message limit is
//!   always allowed); a rendezvous target is allocated only when its first READ is posted, and
//!   READs are posted only while the application keeps up.
//! - Received messages the application has not taken (delivered or waiting behind a
//!   rendezvous): above `backlog_max` messages or `backlog_bytes` bytes the credits of re-posted
//!   buffers are withheld, so the peer runs out of credits and waits (lent at most three of
//!   them per FIN of its own while a rendezvous of this side waits for one).
//! - Rendezvous out: at most `min(max_rendezvous_out, peer's limit)` payloads exposed and not
//!   yet acknowledged by FIN; the next one waits (a `rendezvous_stall`), and no FIN for
//!   `rendezvous_timeout` fails the connection.
//! - A peer that never sends HELLO fails the connection after `handshake_timeout`.
//! - On iWARP the side that spoke first probes a peer whose HELLO is late with a zero-length
//!   RDMA READ ([`Work::Probe`]), after [`HELLO_PROBE_FIRST`] and then at doubling gaps: soft-iWARP
//!   (siw) can leave the first message in the accepting side's socket unread when it arrives
//!   before siw has handed the socket to the queue pair, and only a later message of the same
//!   connection makes siw read it (docs/notes/2026-12-07-siw-first-message-stuck.md). A READ
//!   takes none of the peer's receive buffers, so it costs no credit.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use transport_core::{HeaderBytes, Message, Metrics};

use crate::error::{ProtocolViolation, VerbsError};
use crate::proto::{Kind, Th, TH_LEN, VERSION};

/// Smallest receive buffer a peer may announce: smaller ones would push every message into
/// rendezvous (a round trip and a READ each).
pub(crate) const MIN_PEER_BUF: u64 = 4096;
/// Largest receive buffer size a peer may announce.
pub(crate) const MAX_PEER_BUF: u64 = 1 << 30;
/// Receive queue depths a peer may announce.
pub(crate) const MIN_DEPTH: u32 = 4;
/// See [`MIN_DEPTH`].
pub(crate) const MAX_DEPTH: u32 = 16_384;
/// Largest number of outstanding rendezvous transfers a peer may announce.
pub(crate) const MAX_RNDV_COUNT: u32 = 4096;
/// Most RDMA READs a peer may announce it serves at once (the QP attribute is a u8).
pub(crate) const MAX_READ_DEPTH: u32 = 255;
/// Most work requests one [`Work`] item posts (an RTS: window bind + SEND).
pub(crate) const MAX_WRS_PER_WORK: usize = 2;
/// How long the side that spoke first waits for the peer's HELLO before it probes
/// ([`Work::Probe`]; iWARP only); the gap doubles after each probe.
pub(crate) const HELLO_PROBE_FIRST: Duration = Duration::from_millis(100);

/// Withheld credits lent to a peer for the FINs this side waits for, between two of its FINs
/// (`Engine::lend_for_fins`): a FIN and the CREDIT kept with it, and one for the grant back.
const LEND_MAX: u32 = 3;

/// The engine's settings (from [`crate::VerbsConfig`]).
#[derive(Debug, Clone)]
pub(crate) struct EngineConfig {
    /// This side made the connection and sends its HELLO at once; the accepting side sends
    /// its HELLO only after the peer's has arrived (iWARP's rule that the active side sends
    /// first, kept on every transport).
    pub(crate) speaks_first: bool,
    /// Receive buffers posted (credits granted to the peer in total).
    pub(crate) recv_depth: u32,
    /// Size of each posted receive buffer (announced in HELLO).
    pub(crate) recv_buf_size: usize,
    /// Largest message (header + payload) accepted.
    pub(crate) max_message_size: usize,
    /// Eager payloads of at least this size are handed over in their receive buffer.
    pub(crate) zero_copy_recv_min: usize,
    /// Bytes per RDMA READ.
    pub(crate) rendezvous_chunk: usize,
    /// RDMA READs in flight.
    pub(crate) rendezvous_window: usize,
    /// Incoming rendezvous transfers accepted outstanding (announced).
    pub(crate) max_rendezvous_in: u32,
    /// Incoming rendezvous bytes accepted outstanding (announced, in whole KiB).
    pub(crate) max_rendezvous_in_bytes: u64,
    /// Outgoing rendezvous payloads exposed and not acknowledged, at most.
    pub(crate) max_rendezvous_out: u32,
    /// Received messages not taken by the application before credits are withheld.
    pub(crate) backlog_max: usize,
    /// Received bytes not taken by the application before credits are withheld.
    pub(crate) backlog_bytes: u64,
    /// Time the peer has to send its HELLO.
    pub(crate) handshake_timeout: Duration,
    /// Time the peer has to acknowledge (FIN) an outstanding rendezvous, counted from the
    /// last FIN or from the first RTS after none was outstanding.
    pub(crate) rendezvous_timeout: Duration,
    /// How long a connection whose halves are both gone waits without any progress.
    pub(crate) linger: Duration,
    /// RDMA READs this side's queue pair serves at once as their target (its responder
    /// resources), announced in HELLO: the peer keeps no more in flight towards it.
    pub(crate) read_depth: u32,
    /// The transport is iWARP: the side that speaks first probes a late HELLO of the peer
    /// ([`Work::Probe`]); the engine checks `speaks_first` itself.
    pub(crate) probe_hello: bool,
}

impl EngineConfig {
    fn announced_rndv_kib(&self) -> u32 {
        (self.max_rendezvous_in_bytes / 1024).clamp(1, u32::MAX as u64) as u32
    }
}

/// A received message as the glue hands it over: its bytes, and the way to keep them as a
/// payload without copying.
pub(crate) trait RecvBuf: Sized {
    /// The bytes received (exactly the message).
    fn bytes(&self) -> &[u8];
    /// The buffer itself as a payload covering `range` of [`RecvBuf::bytes`].
    fn into_payload(self, range: Range<usize>) -> Bytes;
}

/// A message queued for sending. `payload` is the glue's owner of the payload bytes.
pub(crate) struct OutMsg<P> {
    pub(crate) header: HeaderBytes,
    pub(crate) len: usize,
    pub(crate) payload: P,
}

/// One RDMA READ of a rendezvous payload: `len` bytes at `remote_addr`/`rkey` into the
/// transfer's target at `offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ReadChunk {
    pub(crate) tag: u64,
    pub(crate) offset: usize,
    pub(crate) len: usize,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    /// Set on the first READ of a transfer: allocate its target (this many bytes) now.
    pub(crate) alloc: Option<usize>,
}

/// A work request (or two) to post, in this order.
pub(crate) enum Work<P> {
    /// SEND a control message (HELLO, FIN, CREDIT, CLOSE): the transport header alone.
    Control(Th),
    /// SEND a whole message: transport header, message header, payload.
    Eager {
        th: Th,
        header: HeaderBytes,
        payload: P,
    },
    /// Expose `payload` to the peer for reading (fill `th.addr` and `th.rkey`) and SEND the
    /// RTS. The exposure lasts until [`Work::Unexpose`] with `th.id`.
    Rts {
        th: Th,
        header: HeaderBytes,
        payload: P,
    },
    /// The peer acknowledged rendezvous `id`: revoke its access, then release the payload.
    Unexpose { id: u32 },
    /// RDMA READ.
    Read(ReadChunk),
    /// A zero-length RDMA READ, signaled, before the peer's HELLO (iWARP): it moves nothing
    /// and takes no receive buffer, but it is a message on the connection, which makes siw
    /// read what it left in the peer's socket (the module docs).
    Probe,
}

/// Something for the application, in the order the peer sent it.
#[derive(Debug)]
pub(crate) enum Delivery {
    Msg(Message),
    /// A rendezvous payload, complete in the target of `tag` (the glue holds the target).
    Rendezvous {
        tag: u64,
        header: HeaderBytes,
        len: usize,
    },
    /// A message above the size limit, refused without reading its payload.
    TooLarge {
        len: u64,
        max: u64,
        header: HeaderBytes,
    },
    /// The peer closed its sending direction.
    End,
}

impl Delivery {
    fn bytes(&self) -> u64 {
        match self {
            Delivery::Msg(m) => m.payload.len() as u64,
            Delivery::Rendezvous { len, .. } => *len as u64,
            Delivery::TooLarge { .. } | Delivery::End => 0,
        }
    }
}

/// The rendezvous limit, the same on both sides: one transfer of any size when none is
/// outstanding, else at most `max_count` transfers and `max_bytes` bytes in all. The sender
/// waits until its next one fits; a receiver that sees one that does not is facing a violation.
fn rendezvous_fits(
    outstanding: usize,
    bytes: u64,
    len: u64,
    max_count: usize,
    max_bytes: u64,
) -> bool {
    outstanding == 0 || (outstanding < max_count && bytes.saturating_add(len) <= max_bytes)
}

/// A deadline: off, armed at a time the engine does not know yet (the glue reads the clock
/// once, after the step that armed it: see [`Engine::needs_clock`]), or at a known instant.
/// Reading the clock per message would cost a system call on some machines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Deadline {
    Off,
    Pending,
    At(Instant),
}

impl Deadline {
    fn resolve(&mut self, now: Instant, after: Duration) {
        if *self == Deadline::Pending {
            *self = Deadline::At(now + after);
        }
    }

    fn at(self) -> Option<Instant> {
        match self {
            Deadline::At(t) => Some(t),
            Deadline::Off | Deadline::Pending => None,
        }
    }

    fn passed(self, now: Instant) -> bool {
        self.at().is_some_and(|t| now >= t)
    }
}

/// Copies of small received payloads, carved out of shared chunks: a message of a few bytes
/// costs a copy and a reference count, not an allocation of its own (one allocation per chunk).
/// A chunk is freed when the last payload carved from it is dropped, so an application that
/// keeps one small message holds at most [`SMALL_CHUNK`] bytes for it.
#[derive(Default)]
struct SmallCopies {
    chunk: bytes::BytesMut,
}

/// Bytes per chunk of [`SmallCopies`].
const SMALL_CHUNK: usize = 1024;
/// Payloads up to this size are copied into a chunk; larger ones get an allocation each.
const SMALL_COPY_MAX: usize = 128;

impl SmallCopies {
    fn copy(&mut self, src: &[u8]) -> Bytes {
        if src.is_empty() {
            return Bytes::new();
        }
        if src.len() > SMALL_COPY_MAX {
            return Bytes::copy_from_slice(src);
        }
        if self.chunk.capacity() - self.chunk.len() < src.len() {
            // A fresh chunk: the old one stays alive only through the payloads carved from it.
            self.chunk = bytes::BytesMut::with_capacity(SMALL_CHUNK);
        }
        self.chunk.extend_from_slice(src);
        self.chunk.split().freeze()
    }
}

/// What the peer announced in its HELLO.
#[derive(Debug, Clone, Copy)]
struct Peer {
    buf_size: u64,
    depth: u32,
    rndv_count: u32,
    rndv_bytes: u64,
    /// RDMA READs its queue pair serves at once: this side keeps no more in flight.
    reads: u32,
}

enum Out<P> {
    Msg(OutMsg<P>),
    Close,
}

enum Inbound {
    Ready(Delivery),
    Reading(u64),
}

/// An incoming rendezvous transfer.
struct Xfer {
    id: u32,
    header: HeaderBytes,
    len: usize,
    addr: u64,
    rkey: u32,
    /// Bytes for which a READ has been emitted.
    posted: usize,
    /// Bytes whose READ completed.
    received: usize,
    /// Whether its target has been allocated (first READ emitted).
    allocated: bool,
}

/// The protocol state of one connection.
pub(crate) struct Engine<P> {
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
    failed: bool,

    // Handshake.
    hello_sent: bool,
    peer: Option<Peer>,
    hello_deadline: Instant,
    /// When to probe a late HELLO next ([`Work::Probe`]), and the gap after that one.
    probe_at: Option<Instant>,
    probe_gap: Duration,
    probe_due: bool,

    // Credits.
    /// Credits we hold: sends we may make into the peer's buffers.
    credits: u32,
    /// Credits the peer holds: granted by us (or implicit), not yet used.
    peer_credits: u32,
    /// Buffers re-posted and not yet granted.
    owed: u32,
    /// Buffers re-posted whose credit is held back while the application is behind.
    withheld: u32,
    /// Withheld credits lent to the peer for the FINs this side waits for, since its last FIN
    /// (at most [`LEND_MAX`]).
    lent: u32,
    /// Messages / bytes handed to the application and not taken yet (set by the glue).
    backlog: usize,
    backlog_bytes: u64,
    credit_stalled: bool,
    /// A buffer a FIN took is owed: grant it at once if the peer is short (see the module docs).
    fin_owed: bool,
    rndv_stalled: bool,

    // Sending.
    outq: VecDeque<Out<P>>,
    fins: VecDeque<u32>,
    unexpose: VecDeque<u32>,
    /// Our rendezvous payloads exposed to the peer, by id: their lengths.
    rndv_out: HashMap<u32, u64>,
    rndv_out_bytes: u64,
    next_rndv: u32,
    rndv_deadline: Deadline,
    close_sent: bool,

    // Receiving.
    peer_closed: bool,
    receiver_gone: bool,
    inbound: VecDeque<Inbound>,
    /// Bytes of the ready deliveries in `inbound`.
    inbound_bytes: u64,
    xfers: HashMap<u64, Xfer>,
    /// Rendezvous ids of the transfers in `xfers`.
    xfer_ids: HashSet<u32>,
    /// Transfers with READs left to post, in arrival order.
    read_queue: VecDeque<u64>,
    /// READs are not handed out by [`Engine::poll_work`] while set (`set_reads_held`).
    reads_held: bool,
    reads_in_flight: usize,
    /// Bytes of the admitted incoming transfers (`xfers`: READs not all completed).
    rndv_in_bytes: u64,
    /// Bytes of targets allocated for transfers not yet delivered.
    target_bytes: u64,
    next_tag: u64,

    /// Where small received payloads are copied ([`SmallCopies`]).
    small: SmallCopies,

    // Teardown.
    linger_deadline: Deadline,
    linger_expired: bool,
}

impl<P> Engine<P> {
    /// A new connection's engine, created when its receive buffers are posted and the queue
    /// pair is connected (`now`).
    pub(crate) fn new(cfg: EngineConfig, metrics: Arc<Metrics>, now: Instant) -> Engine<P> {
        let owed = cfg.recv_depth.saturating_sub(1);
        Engine {
            hello_deadline: now + cfg.handshake_timeout,
            probe_at: (cfg.probe_hello && cfg.speaks_first).then(|| now + HELLO_PROBE_FIRST),
            probe_gap: HELLO_PROBE_FIRST,
            probe_due: false,
            cfg,
            metrics,
            failed: false,
            hello_sent: false,
            peer: None,
            credits: 1,
            peer_credits: 1,
            owed,
            withheld: 0,
            lent: 0,
            backlog: 0,
            backlog_bytes: 0,
            credit_stalled: false,
            fin_owed: false,
            rndv_stalled: false,
            outq: VecDeque::new(),
            fins: VecDeque::new(),
            unexpose: VecDeque::new(),
            rndv_out: HashMap::new(),
            rndv_out_bytes: 0,
            next_rndv: 0,
            rndv_deadline: Deadline::Off,
            close_sent: false,
            peer_closed: false,
            receiver_gone: false,
            inbound: VecDeque::new(),
            inbound_bytes: 0,
            xfers: HashMap::new(),
            xfer_ids: HashSet::new(),
            read_queue: VecDeque::new(),
            reads_held: false,
            reads_in_flight: 0,
            rndv_in_bytes: 0,
            target_bytes: 0,
            next_tag: 0,
            small: SmallCopies::default(),
            linger_deadline: Deadline::Off,
            linger_expired: false,
        }
    }

    // ---- Inputs --------------------------------------------------------------------------

    /// Queues a message (its size was checked against the limit by the caller).
    pub(crate) fn send(&mut self, msg: OutMsg<P>) {
        self.outq.push_back(Out::Msg(msg));
    }

    /// Queues the end of the sending direction (after everything queued before).
    pub(crate) fn close(&mut self) {
        if !self.close_sent && !self.outq.iter().any(|o| matches!(o, Out::Close)) {
            self.outq.push_back(Out::Close);
        }
    }

    /// Holds back (`true`) or lets go the RDMA READs [`Engine::poll_work`] hands out; the rest
    /// of the work is unaffected. The glue holds them where posting one would hold up the
    /// caller (see `conn.rs`, `Core::pump_out`).
    pub(crate) fn set_reads_held(&mut self, held: bool) {
        self.reads_held = held;
    }

    /// Whether a READ would be handed out now if READs were not held.
    pub(crate) fn read_ready(&self) -> bool {
        // No more than the window, nor than the peer's queue pair serves at once: a READ
        // beyond its responder resources would fail the connection.
        let serves = self.peer.map_or(1, |p| p.reads as usize);
        let Some(x) = self.read_queue.front().and_then(|t| self.xfers.get(t)) else {
            return false;
        };
        // A transfer not yet started waits while the application is behind: its target would
        // be one more payload held for it.
        !self.failed
            && self.reads_in_flight < self.cfg.rendezvous_window.max(1).min(serves)
            && (x.allocated || !self.app_behind())
    }

    /// Messages queued and not yet posted.
    pub(crate) fn queued(&self) -> usize {
        self.outq.len()
    }

    /// The application's receiving half is gone: nothing is delivered any more, incoming
    /// rendezvous payloads are acknowledged without being read.
    pub(crate) fn receiver_gone(&mut self) {
        self.receiver_gone = true;
        self.backlog = 0;
        self.backlog_bytes = 0;
        // Transfers not started are not worth reading now; those with READs in flight finish.
        let queued: Vec<u64> = self.read_queue.drain(..).collect();
        for tag in queued {
            let started = self.xfers.get(&tag).is_some_and(|x| x.posted > 0);
            if started {
                self.read_queue.push_back(tag);
            } else if let Some(x) = self.xfers.remove(&tag) {
                self.xfer_ids.remove(&x.id);
                self.rndv_in_bytes -= x.len as u64;
                self.fins.push_back(x.id);
            }
        }
        self.inbound.clear();
        self.inbound_bytes = 0;
        self.release_withheld();
    }

    /// Both halves are gone: close the sending direction, finish what is outstanding, and
    /// give up after `linger` without progress.
    pub(crate) fn local_gone(&mut self, now: Instant) {
        self.close();
        if !self.receiver_gone {
            self.receiver_gone();
        }
        if self.linger_deadline == Deadline::Off {
            self.linger_deadline = Deadline::At(now + self.cfg.linger);
        }
    }

    /// Messages and bytes delivered to the application and not taken yet.
    pub(crate) fn set_backlog(&mut self, messages: usize, bytes: u64) {
        if self.receiver_gone {
            return;
        }
        self.backlog = messages;
        self.backlog_bytes = bytes;
        if !self.behind() {
            self.release_withheld();
        }
    }

    /// A completion other than a receive or a READ (a send finished): progress for linger.
    pub(crate) fn on_activity(&mut self) {
        if self.linger_deadline != Deadline::Off {
            self.linger_deadline = Deadline::Pending;
        }
    }

    /// Whether a deadline was armed without a time: call [`Engine::clock`] after this step.
    pub(crate) fn needs_clock(&self) -> bool {
        self.rndv_deadline == Deadline::Pending || self.linger_deadline == Deadline::Pending
    }

    /// The time now: deadlines armed since the last call count from it.
    pub(crate) fn clock(&mut self, now: Instant) {
        self.rndv_deadline.resolve(now, self.cfg.rendezvous_timeout);
        self.linger_deadline.resolve(now, self.cfg.linger);
    }

    /// A message arrived in a posted receive buffer. Returns the buffer to re-post, or `None`
    /// when its payload was handed over (post a fresh buffer in its place). Either way the
    /// buffer's credit is accounted for: the glue must post one buffer per call.
    pub(crate) fn on_recv<B: RecvBuf>(&mut self, buf: B) -> Result<Option<B>, VerbsError> {
        if self.failed {
            return Err(ProtocolViolation::AfterClose { kind: "any" }.into());
        }
        self.on_activity();
        match self.recv_inner(buf) {
            Ok(b) => Ok(b),
            Err(v) => {
                self.failed = true;
                Err(v.into())
            }
        }
    }

    fn recv_inner<B: RecvBuf>(&mut self, buf: B) -> Result<Option<B>, ProtocolViolation> {
        let data_len = buf.bytes().len();
        let (th, header, off) = Th::decode(buf.bytes())?;
        if self.peer_credits == 0 {
            return Err(ProtocolViolation::NoCredit);
        }
        let peer = match (self.peer, th.kind) {
            (None, Kind::Hello) => self.check_hello(&th)?,
            (None, k) => return Err(ProtocolViolation::BeforeHello { kind: k.name() }),
            (Some(_), Kind::Hello) => return Err(ProtocolViolation::DuplicateHello),
            (Some(p), _) => p,
        };
        let credits =
            self.credits_with(th.credits, peer)
                .ok_or(ProtocolViolation::CreditOverflow {
                    held: self.credits,
                    granted: th.credits,
                    depth: peer.depth,
                })?;
        if self.peer_closed && matches!(th.kind, Kind::Eager | Kind::Rts | Kind::Close) {
            return Err(ProtocolViolation::AfterClose {
                kind: th.kind.name(),
            });
        }
        // Kind-specific checks, before any state changes.
        let max = self.cfg.max_message_size as u64;
        let rts_total = (header.len() as u64).saturating_add(th.len);
        match th.kind {
            Kind::Rts if rts_total <= max => {
                if th.len == 0 {
                    return Err(ProtocolViolation::EmptyRendezvous);
                }
                if th.addr.checked_add(th.len).is_none() {
                    return Err(ProtocolViolation::AddressWraps {
                        addr: th.addr,
                        len: th.len,
                    });
                }
                if self.xfer_ids.contains(&th.id) {
                    return Err(ProtocolViolation::DuplicateRendezvous(th.id));
                }
                let max_bytes = self.cfg.announced_rndv_kib() as u64 * 1024;
                let fits = rendezvous_fits(
                    self.xfers.len(),
                    self.rndv_in_bytes,
                    th.len,
                    self.cfg.max_rendezvous_in as usize,
                    max_bytes,
                );
                if !fits {
                    return Err(ProtocolViolation::RendezvousLimit {
                        len: th.len,
                        outstanding: self.xfers.len() as u32,
                        bytes: self.rndv_in_bytes,
                        max_count: self.cfg.max_rendezvous_in,
                        max_bytes,
                    });
                }
            }
            Kind::Fin if !self.rndv_out.contains_key(&th.id) => {
                return Err(ProtocolViolation::UnknownFin(th.id));
            }
            _ => {}
        }

        // Valid: apply.
        self.peer_credits -= 1;
        self.credits = credits;
        self.metrics.bytes_received.add(off as u64);
        if th.kind == Kind::Hello {
            self.peer = Some(peer);
            self.probe_at = None;
            self.probe_due = false;
        }
        let mut keep = Some(buf);
        match th.kind {
            Kind::Hello | Kind::Credit => {}
            Kind::Eager => {
                let plen = th.len as usize;
                self.metrics.bytes_received.add(plen as u64);
                let total = header.len() as u64 + plen as u64;
                if self.receiver_gone {
                    // Nobody to deliver to.
                } else if total > max {
                    self.push_ready(Delivery::TooLarge {
                        len: total,
                        max,
                        header,
                    });
                } else if plen >= self.cfg.zero_copy_recv_min {
                    let b = keep.take().expect("buffer present");
                    let payload = b.into_payload(off..off + plen);
                    self.push_ready(Delivery::Msg(Message::new(header, payload)));
                } else {
                    let b = keep.as_ref().expect("buffer present");
                    let payload = self.small.copy(&b.bytes()[off..off + plen]);
                    self.metrics.payload_bytes_copied.add(plen as u64);
                    self.push_ready(Delivery::Msg(Message::new(header, payload)));
                }
                debug_assert!(off + plen == data_len);
            }
            Kind::Rts => {
                if rts_total > max || self.receiver_gone {
                    // Refused without reading: FIN at once (the sender releases its payload).
                    if !self.receiver_gone {
                        self.push_ready(Delivery::TooLarge {
                            len: rts_total,
                            max,
                            header,
                        });
                    }
                    self.fins.push_back(th.id);
                } else {
                    let tag = self.next_tag;
                    self.next_tag += 1;
                    let len = th.len as usize;
                    self.xfers.insert(
                        tag,
                        Xfer {
                            id: th.id,
                            header,
                            len,
                            addr: th.addr,
                            rkey: th.rkey,
                            posted: 0,
                            received: 0,
                            allocated: false,
                        },
                    );
                    self.xfer_ids.insert(th.id);
                    self.rndv_in_bytes += th.len;
                    self.read_queue.push_back(tag);
                    self.inbound.push_back(Inbound::Reading(tag));
                }
            }
            Kind::Fin => {
                let len = self.rndv_out.remove(&th.id).expect("checked above");
                // What was lent for it served: the next wait may lend again.
                self.lent = 0;
                self.rndv_out_bytes -= len;
                self.unexpose.push_back(th.id);
                // The peer made progress: the time limit counts again from now.
                self.rndv_deadline = if self.rndv_out.is_empty() {
                    Deadline::Off
                } else {
                    Deadline::Pending
                };
            }
            Kind::Close => {
                self.peer_closed = true;
                if !self.receiver_gone {
                    self.inbound.push_back(Inbound::Ready(Delivery::End));
                }
            }
        }
        // The buffer goes back to the receive queue (or a fresh one in its place). Its credit
        // is withheld only for data while the application is behind.
        if matches!(th.kind, Kind::Eager | Kind::Rts) && self.behind() {
            self.withheld += 1;
        } else {
            self.owed += 1;
            self.fin_owed |= th.kind == Kind::Fin;
        }
        Ok(keep)
    }

    /// The receiving half's fast path (`conn.rs`, `Core::receive_small`): a plain eager
    /// message small enough to be copied, arriving with nothing ahead of it (no delivery
    /// waiting, the handshake done, the application not behind, no linger running, the peer
    /// not closed), is checked as [`Engine::on_recv`] checks it and returned at once, its
    /// buffer's credit owed as there: the caller posts the same buffer again. `None`: nothing
    /// changed, and the message takes `on_recv` (which reports any violation).
    pub(crate) fn recv_small(&mut self, msg: &[u8]) -> Option<Message> {
        let peer = self.peer?;
        let clear = !self.failed
            && !self.peer_closed
            && !self.receiver_gone
            && self.inbound.is_empty()
            && self.peer_credits > 0
            && self.linger_deadline == Deadline::Off;
        if !clear {
            return None;
        }
        let (th, header, off) = Th::decode(msg).ok()?;
        // `decode` checked that an eager message carries exactly its announced length.
        let plen = th.len as usize;
        if th.kind != Kind::Eager
            || plen >= self.cfg.zero_copy_recv_min
            || header.len() + plen > self.cfg.max_message_size
            // Counted as delivered and not taken, as `on_recv` counts it: withheld when behind.
            || self.backlog + 1 >= self.cfg.backlog_max
            || self.backlog_bytes + plen as u64 >= self.cfg.backlog_bytes
        {
            return None;
        }
        let credits = self.credits_with(th.credits, peer)?;
        self.peer_credits -= 1;
        self.credits = credits;
        self.metrics.bytes_received.add((off + plen) as u64);
        self.metrics.payload_bytes_copied.add(plen as u64);
        self.owed += 1;
        let payload = self.small.copy(&msg[off..off + plen]);
        Some(Message::new(header, payload))
    }

    /// The credits held once the peer's grant is added: `None` when that would exceed the
    /// receive depth it announced (or overflow).
    fn credits_with(&self, granted: u16, peer: Peer) -> Option<u32> {
        self.credits
            .checked_add(u32::from(granted))
            .filter(|&c| c <= peer.depth)
    }

    /// Whether a step would find anything to do ([`Engine::poll_work`], deadlines, withheld
    /// credits): after a fast receive or send, the glue steps only then.
    pub(crate) fn has_work(&self) -> bool {
        !self.hello_sent
            || self.probe_due
            || !self.outq.is_empty()
            || !self.fins.is_empty()
            || !self.unexpose.is_empty()
            || !self.read_queue.is_empty()
            || self.withheld > 0
            || self.credit_due()
            || self.needs_clock()
    }

    /// Credits go on their own (a CREDIT) when enough are owed and nothing carried them: at
    /// least 2, since a CREDIT costs the peer one buffer, which must not trigger a CREDIT back;
    /// and at once when a FIN's buffer is owed to a peer left with fewer than two credits (its
    /// next FIN would wait for them), or when that peer owes a FIN of ours ([`Self::fins_short`]).
    fn credit_due(&self) -> bool {
        let threshold = (self.cfg.recv_depth / 4).max(2);
        let fin_short = self.fin_owed && self.peer_credits < 2;
        (self.owed >= threshold || fin_short || self.fins_short())
            && self.owed > 0
            && self.credits >= 1
    }

    fn check_hello(&self, th: &Th) -> Result<Peer, ProtocolViolation> {
        let version = th.hello_version();
        if version != VERSION {
            return Err(ProtocolViolation::Version {
                got: version,
                want: VERSION,
            });
        }
        let reads = th.hello_reads();
        if !(1..=MAX_READ_DEPTH).contains(&reads) {
            return Err(ProtocolViolation::PeerReadDepth {
                reads,
                max: MAX_READ_DEPTH,
            });
        }
        if !(MIN_PEER_BUF..=MAX_PEER_BUF).contains(&th.len) {
            return Err(ProtocolViolation::PeerBufferSize {
                size: th.len,
                min: MIN_PEER_BUF,
                max: MAX_PEER_BUF,
            });
        }
        if !(MIN_DEPTH..=MAX_DEPTH).contains(&th.id) {
            return Err(ProtocolViolation::PeerDepth {
                depth: th.id,
                min: MIN_DEPTH,
                max: MAX_DEPTH,
            });
        }
        if !(1..=MAX_RNDV_COUNT).contains(&th.rkey) || th.aux == 0 {
            return Err(ProtocolViolation::PeerRendezvousLimits {
                count: th.rkey,
                kib: th.aux,
                max_count: MAX_RNDV_COUNT,
            });
        }
        Ok(Peer {
            buf_size: th.len,
            depth: th.id,
            rndv_count: th.rkey,
            rndv_bytes: th.aux as u64 * 1024,
            reads,
        })
    }

    /// An RDMA READ emitted by [`Engine::poll_work`] completed successfully.
    pub(crate) fn on_read_done(&mut self, tag: u64, len: usize) {
        self.on_activity();
        self.reads_in_flight = self.reads_in_flight.saturating_sub(1);
        self.metrics.bytes_received.add(len as u64);
        let Some(x) = self.xfers.get_mut(&tag) else {
            return; // cannot happen: a READ is emitted only for a live transfer
        };
        x.received += len;
        if x.received < x.len {
            return;
        }
        let x = self.xfers.remove(&tag).expect("present");
        self.xfer_ids.remove(&x.id);
        self.rndv_in_bytes -= x.len as u64;
        self.target_bytes -= x.len as u64;
        self.fins.push_front(x.id);
        let delivery = Delivery::Rendezvous {
            tag,
            header: x.header,
            len: x.len,
        };
        if self.receiver_gone {
            // Nobody takes it: delivered at once so the glue releases the target.
            self.push_ready(delivery);
            return;
        }
        if let Some(slot) = self
            .inbound
            .iter_mut()
            .find(|i| matches!(i, Inbound::Reading(t) if *t == tag))
        {
            self.inbound_bytes += delivery.bytes();
            *slot = Inbound::Ready(delivery);
        }
    }

    /// Time passed: fails the connection when the peer missed a deadline.
    pub(crate) fn handle_timeout(&mut self, now: Instant) -> Result<(), VerbsError> {
        if self.failed {
            return Ok(());
        }
        self.clock(now);
        if self.peer.is_none() && now >= self.hello_deadline {
            self.failed = true;
            return Err(VerbsError::Timeout {
                what: "no HELLO from the RDMA peer",
                after: self.cfg.handshake_timeout,
            });
        }
        if let Some(at) = self.probe_at.filter(|&at| self.peer.is_none() && now >= at) {
            self.probe_due = true;
            self.probe_gap *= 2;
            self.probe_at = Some(at.max(now) + self.probe_gap);
        }
        if self.rndv_deadline.passed(now) {
            self.failed = true;
            return Err(VerbsError::Timeout {
                what: "no FIN from the RDMA peer for an outstanding rendezvous",
                after: self.cfg.rendezvous_timeout,
            });
        }
        if self.linger_deadline.passed(now) {
            self.linger_expired = true;
        }
        Ok(())
    }

    // ---- Outputs -------------------------------------------------------------------------

    /// The next work request to post, if credits, limits and the send queue allow. Call only
    /// with room for [`MAX_WRS_PER_WORK`] work requests.
    pub(crate) fn poll_work(&mut self) -> Option<Work<P>> {
        if self.failed {
            return None;
        }
        if let Some(id) = self.unexpose.pop_front() {
            return Some(Work::Unexpose { id });
        }
        if let Some(r) = self.next_read() {
            return Some(Work::Read(r));
        }
        if !self.hello_sent {
            if self.credits < 1 || (!self.cfg.speaks_first && self.peer.is_none()) {
                return None;
            }
            let th = Th::hello(
                self.cfg.recv_depth,
                self.cfg.recv_buf_size as u64,
                self.cfg.max_rendezvous_in,
                self.cfg.announced_rndv_kib(),
                self.cfg.read_depth.clamp(1, MAX_READ_DEPTH),
            );
            self.hello_sent = true;
            return Some(self.control(th));
        }
        if self.probe_due {
            self.probe_due = false;
            return Some(Work::Probe);
        }
        let peer = self.peer?;
        if let Some(&id) = self.fins.front() {
            if self.credits >= 2 {
                self.fins.pop_front();
                let mut th = Th::new(Kind::Fin);
                th.id = id;
                return Some(self.control(th));
            }
            self.note_credit_stall();
        } else if let Some(w) = self.next_out(peer) {
            return Some(w);
        }
        if self.fins_short() {
            self.lend_for_fins();
        }
        if self.credit_due() {
            return Some(self.control(Th::new(Kind::Credit)));
        }
        None
    }

    /// Whether the peer holds too few credits for the FIN this side waits for: this side has
    /// payloads out by rendezvous, and the peer holds fewer than the two a FIN needs. Without a
    /// grant now, a peer that spent its second-to-last credit on a CREDIT would wait for this
    /// side, whose application may wait (for rendezvous room) on that very FIN.
    fn fins_short(&self) -> bool {
        !self.rndv_out.is_empty() && self.peer_credits < 2
    }

    /// Credits withheld because the application is behind are lent to the peer up to three:
    /// two for the FIN and the CREDIT it keeps, and one so that its own grant back leaves it
    /// at two (a CREDIT answered by a CREDIT of one would go back and forth). At most
    /// [`LEND_MAX`] between two FINs of the peer, so a peer that spends them on data instead
    /// gets at most that many messages past the backlog limit per rendezvous of ours.
    fn lend_for_fins(&mut self) {
        let have = self.peer_credits + self.owed;
        let lend = 3u32
            .saturating_sub(have)
            .min(self.withheld)
            .min(LEND_MAX - self.lent);
        self.withheld -= lend;
        self.owed += lend;
        self.lent += lend;
    }

    fn next_out(&mut self, peer: Peer) -> Option<Work<P>> {
        // Data needs three credits (the last two are kept for a FIN and a CREDIT or CLOSE); a message that does
        // not fit the peer's receive buffer goes by rendezvous, within the peer's limits.
        let (need, rndv_len) = match self.outq.front()? {
            Out::Close => (1, None),
            Out::Msg(m) => {
                let whole = (TH_LEN + m.header.len() + m.len) as u64;
                (3, (whole > peer.buf_size).then_some(m.len as u64))
            }
        };
        if self.credits < need {
            self.note_credit_stall();
            return None;
        }
        let rendezvous = rndv_len.is_some();
        if let Some(len) = rndv_len {
            let cap = self.cfg.max_rendezvous_out.min(peer.rndv_count) as usize;
            if !rendezvous_fits(
                self.rndv_out.len(),
                self.rndv_out_bytes,
                len,
                cap,
                peer.rndv_bytes,
            ) {
                if !self.rndv_stalled {
                    self.metrics.rendezvous_stalls.incr();
                    self.rndv_stalled = true;
                }
                return None;
            }
            self.rndv_stalled = false;
        }
        self.credit_stalled = false;
        match self.outq.pop_front()? {
            Out::Close => {
                self.close_sent = true;
                Some(self.control(Th::new(Kind::Close)))
            }
            Out::Msg(m) => {
                let kind = if rendezvous { Kind::Rts } else { Kind::Eager };
                let mut th = self.data_th(kind, m.header.len(), m.len);
                if rendezvous {
                    let mut id = self.next_rndv;
                    while self.rndv_out.contains_key(&id) {
                        id = id.wrapping_add(1);
                    }
                    self.next_rndv = id.wrapping_add(1);
                    th.id = id;
                    if self.rndv_out.is_empty() {
                        self.rndv_deadline = Deadline::Pending;
                    }
                    self.rndv_out.insert(id, m.len as u64);
                    self.rndv_out_bytes += m.len as u64;
                    Some(Work::Rts {
                        th,
                        header: m.header,
                        payload: m.payload,
                    })
                } else {
                    Some(Work::Eager {
                        th,
                        header: m.header,
                        payload: m.payload,
                    })
                }
            }
        }
    }

    /// The transport header of a data message leaving now: it carries every owed credit and
    /// spends one of ours.
    fn data_th(&mut self, kind: Kind, header_len: usize, len: usize) -> Th {
        let mut th = Th::new(kind);
        th.credits = self.take_owed();
        th.len = len as u64;
        self.credits -= 1;
        self.metrics
            .bytes_sent
            .add((TH_LEN + header_len + len) as u64);
        th
    }

    /// The fast path of a small message (`conn.rs`, `Core::send_now`): when nothing is queued
    /// or owed ahead of it (no message, FIN, invalidation or READ waiting, the handshake done)
    /// and it may go at once by the rules [`Engine::poll_work`] applies (three credits, eager
    /// into the peer's buffer), returns its header, as `poll_work` would have handed it out
    /// after [`Engine::send`]; else `None`, and the message takes the queue.
    pub(crate) fn send_now(&mut self, header_len: usize, len: usize) -> Option<Th> {
        let peer = self.peer?;
        let whole = (TH_LEN + header_len + len) as u64;
        let clear = !self.failed
            && self.hello_sent
            && self.outq.is_empty()
            && self.fins.is_empty()
            && self.unexpose.is_empty()
            && self.read_queue.is_empty();
        if !clear || self.credits < 3 || whole > peer.buf_size {
            return None;
        }
        self.credit_stalled = false;
        Some(self.data_th(Kind::Eager, header_len, len))
    }

    fn note_credit_stall(&mut self) {
        if !self.credit_stalled {
            self.metrics.credit_stalls.incr();
            self.credit_stalled = true;
        }
    }

    /// A control message carrying every owed credit.
    fn control(&mut self, mut th: Th) -> Work<P> {
        th.credits = self.take_owed();
        self.credits -= 1;
        self.metrics.bytes_sent.add(TH_LEN as u64);
        Work::Control(th)
    }

    fn take_owed(&mut self) -> u16 {
        let n = self.owed.min(u16::MAX as u32);
        self.owed -= n;
        self.fin_owed &= self.owed > 0;
        self.peer_credits += n;
        n as u16
    }

    fn next_read(&mut self) -> Option<ReadChunk> {
        if self.reads_held || !self.read_ready() {
            return None;
        }
        let &tag = self.read_queue.front()?;
        let x = self.xfers.get_mut(&tag)?;
        let chunk = self.cfg.rendezvous_chunk.max(4096);
        let offset = x.posted;
        let len = chunk.min(x.len - offset);
        let alloc = if x.allocated {
            None
        } else {
            x.allocated = true;
            self.target_bytes += x.len as u64;
            Some(x.len)
        };
        x.posted += len;
        let r = ReadChunk {
            tag,
            offset,
            len,
            // Cannot wrap: addr + len was checked when the RTS arrived.
            remote_addr: x.addr + offset as u64,
            rkey: x.rkey,
            alloc,
        };
        if x.posted == x.len {
            self.read_queue.pop_front();
        }
        self.reads_in_flight += 1;
        Some(r)
    }

    /// The next delivery for the application, in order.
    pub(crate) fn poll_delivery(&mut self) -> Option<Delivery> {
        match self.inbound.front() {
            Some(Inbound::Ready(_)) => {}
            _ => return None,
        }
        let Some(Inbound::Ready(d)) = self.inbound.pop_front() else {
            unreachable!("checked above")
        };
        self.inbound_bytes -= d.bytes();
        Some(d)
    }

    /// Whether [`Engine::poll_delivery`] would hand something out now.
    pub(crate) fn has_delivery(&self) -> bool {
        matches!(self.inbound.front(), Some(Inbound::Ready(_)))
    }

    /// When [`Engine::handle_timeout`] must be called next.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let none_armed = self.peer.is_some()
            && self.rndv_deadline == Deadline::Off
            && self.linger_deadline == Deadline::Off;
        if self.failed || none_armed {
            return None;
        }
        let hello = self.peer.is_none().then_some(self.hello_deadline);
        let probe = self.probe_at.filter(|_| self.peer.is_none());
        [
            hello,
            probe,
            self.rndv_deadline.at(),
            self.linger_deadline.at(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    // ---- State ---------------------------------------------------------------------------

    /// The application is behind: received messages pile up (delivered and not taken, or
    /// ready behind a rendezvous still being read).
    fn behind(&self) -> bool {
        !self.receiver_gone
            && (self.backlog + self.inbound.len() >= self.cfg.backlog_max
                || self.backlog_bytes + self.inbound_bytes >= self.cfg.backlog_bytes)
    }

    /// The application has not taken what was delivered (what waits behind a transfer does
    /// not count: that transfer must proceed).
    fn app_behind(&self) -> bool {
        !self.receiver_gone
            && (self.backlog >= self.cfg.backlog_max
                || self.backlog_bytes >= self.cfg.backlog_bytes)
    }

    fn release_withheld(&mut self) {
        self.owed += self.withheld;
        self.withheld = 0;
        self.lent = 0;
    }

    fn push_ready(&mut self, d: Delivery) {
        self.inbound_bytes += d.bytes();
        self.inbound.push_back(Inbound::Ready(d));
    }

    /// Whether the engine waits for the application to take deliveries (credits withheld, or
    /// a transfer not started): the glue should call [`Engine::set_backlog`] when it does.
    pub(crate) fn waiting_for_app(&self) -> bool {
        self.withheld > 0 || (!self.read_queue.is_empty() && self.app_behind())
    }

    /// Whether the CLOSE went out.
    pub(crate) fn close_sent(&self) -> bool {
        self.close_sent
    }

    /// Whether the peer closed its sending direction.
    pub(crate) fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// The transfer being read when the connection ends: (bytes received, bytes expected).
    pub(crate) fn reading(&self) -> Option<(u64, u64)> {
        let tag = self.inbound.iter().find_map(|i| match i {
            Inbound::Reading(t) => Some(*t),
            Inbound::Ready(_) => None,
        })?;
        let x = self.xfers.get(&tag)?;
        Some((x.received as u64, x.len as u64))
    }

    /// Nothing left to do: CLOSE sent, no payload exposed, no transfer, nothing queued.
    pub(crate) fn is_idle(&self) -> bool {
        self.close_sent
            && self.outq.is_empty()
            && self.fins.is_empty()
            && self.unexpose.is_empty()
            && self.rndv_out.is_empty()
            && self.xfers.is_empty()
            && self.reads_in_flight == 0
    }

    /// The linger period ran out without progress.
    pub(crate) fn linger_expired(&self) -> bool {
        self.linger_expired
    }

    /// Bytes this side holds because of the peer: allocated rendezvous targets not yet
    /// delivered, and ready messages waiting in order.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn held_bytes(&self) -> u64 {
        self.target_bytes + self.inbound_bytes
    }

    /// Incoming transfers outstanding and outgoing payloads exposed.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn rendezvous_counts(&self) -> (u32, usize) {
        (self.xfers.len() as u32, self.rndv_out.len())
    }

    /// (credits we hold, credits the peer holds, owed, withheld).
    #[cfg(test)]
    pub(crate) fn credit_state(&self) -> (u32, u32, u32, u32) {
        (self.credits, self.peer_credits, self.owed, self.withheld)
    }
}

#[cfg(any(test, feature = "fuzzing"))]
pub(crate) mod hostile;
#[cfg(test)]
mod tests;
