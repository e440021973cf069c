//! A shared-memory connection behind transport-core's traits: [`ShmConnection`] and its halves
//! over the rings, the pools and the set-up socket of an [`Established`] set-up.
//!
//! # How a message travels
//!
//! The sending half encodes a message into entries of its data ring ([`crate::msg`]): inline
//! when the payload is short ([`ShmConfig::inline_limit`]), else named by the entry in a slot
//! of its pool: where the application wrote it, in a send buffer of
//! [`MessageSender::buffer_pool`], or copied into a free slot. It pushes a message's entries only when all of them fit (so a
//! send dropped while it waits leaves nothing half written) and rings the doorbell only when
//! the receiver announced that it sleeps ([`crate::ring`]). The receiving half pops and decodes
//! the entries, checking everything the peer wrote, and hands a slot's payload to the
//! application as [`Bytes`](bytes::Bytes) over the peer's mapping, without a copy; when the application
//! drops the last view, the slot goes back to the peer on this side's return ring.
//!
//! # Waiting and waking
//!
//! A half with nothing to do first spins on its ring for [`ShmConfig::spin`] (when this process
//! may use more than one CPU: on one CPU the peer can only run once this thread stops), then
//! announces its sleep and waits on the set-up socket, on which the peer writes one byte per
//! announced sleep (`D`: entries for the receiver; `R`: room, `S`: slots back, for the sender).
//! Whichever half reads the socket passes each byte on to the half it is for, so neither misses
//! a wake-up meant for the other. The socket also tells that the peer is gone: it closes when
//! the peer's process ends or drops its connection.
//!
//! # Limits of this version
//!
//! A payload travels in one slot, so [`ShmConfig::max_message_size`] sizes the slots: a larger
//! message is refused with [`TransportError::MessageTooLarge`] on send; one the peer sends
//! above this side's limit is skipped (its slot returned) with the same error on receive, and
//! the connection goes on. A heap payload is copied once into the sender's slot; one the
//! application wrote in a buffer of [`MessageSender::buffer_pool`] (a free slot of the
//! sender's pool, [`crate::pool::lend`]) is named where it lies, without a copy. A slot goes
//! back as the application drops the last view of its payload, on the thread that drops it,
//! whether or not the receiving half runs (so a side that holds payloads while it only sends
//! cannot wait for slots its peer waits for in turn); an application that keeps payloads
//! holds the peer's sends back once the peer's pool is lent out.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::socket::{send, MsgFlags};
use tokio::net::UnixStream;
use tokio::sync::Notify;
use transport_core::{
    BackendError, BufferPool, Capabilities, Connection, HeaderBytes, Message, MessageReceiver,
    MessageSender, Metrics, TransportError, TryRecv, MAX_HEADER_LEN,
};

use crate::msg::{
    encode_close, encode_returns, entries_for, Decoded, Decoder, Encoder, Entry, MsgError,
    MsgLimits, RETURNS_PER_ENTRY,
};
use crate::pool::lend::SlotLender;
use crate::pool::{PoolError, PoolReader, PoolWriter, Returns, SlotId};
use crate::region::Words;
use crate::ring::{Consumer, Producer, RingError, ENTRY_BYTES};
use crate::setup::{Established, Hello, Limits, SetupError};
use crate::side::SideLayout;
use crate::wait::{Lockstep, Next, Spin, Spinning};

/// The backend's name in [`Capabilities::name`].
pub const NAME: &str = "shm";

/// Doorbell byte: entries on the data ring (for the peer's receiving half).
const DATA: u8 = b'D';
/// Doorbell byte: room on the data ring (for the peer's sending half).
const ROOM: u8 = b'R';
/// Doorbell byte: slots returned (for the peer's sending half).
const SLOTS: u8 = b'S';

/// Settings of a shared-memory connection (both halves, and what this side accepts from the
/// peer in the set-up).
///
/// ```
/// use transport_shm::conn::ShmConfig;
/// let c = ShmConfig::with_max_message_size(1 << 20);
/// assert_eq!(c.max_message_size, 1 << 20);
/// assert!(c.slot_bytes as usize >= (1 << 20));
/// ```
#[derive(Debug, Clone)]
pub struct ShmConfig {
    /// Entries of the ring this side sends on (a power of two; default 4 096: 256 KiB, the
    /// slack a socket's buffer gives two peers that both send before they receive).
    pub ring_entries: u32,
    /// Slots of this side's pool (a power of two; default 8, fewer for slots above 32 MiB).
    pub pool_slots: u32,
    /// Bytes per slot (a multiple of 64): the longest payload (default 1 MiB).
    pub slot_bytes: u32,
    /// The longest payload sent inline in ring entries rather than in a slot (default 1 024,
    /// at most [`crate::msg::MAX_INLINE_LIMIT`]): copied in and out as through a socket, and
    /// takes no slot, which the receiving application holds until it drops the payload.
    pub inline_limit: u32,
    /// The largest message (header and payload) this side sends or accepts (default 1 MiB).
    pub max_message_size: usize,
    /// How long a half with nothing to do polls its ring before it sleeps, when this process
    /// may use more than one CPU (default 50 µs; zero never spins).
    pub spin: Duration,
    /// How long a message the peer began to write may go without its next entry before the
    /// receiver fails with [`TransportError::Stalled`] (default 30 s, as the socket backends;
    /// `None`: no limit). Needs tokio's time driver.
    pub frame_timeout: Option<Duration>,
    /// What this side accepts from the peer in the set-up.
    pub limits: Limits,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig::with_max_message_size(1 << 20)
    }
}

impl ShmConfig {
    /// The default settings, with slots large enough for a payload of `max_message_size`
    /// bytes (the pool's memory is [`ShmConfig::pool_slots`] times that, per side; the
    /// set-up's [`Limits::max_pool_bytes`] is raised to accept a peer with the same settings).
    pub fn with_max_message_size(max_message_size: usize) -> ShmConfig {
        let slot = max_message_size
            .clamp(64, u32::MAX as usize / 2)
            .div_ceil(64)
            * 64;
        // Eight slots, fewer (down to two) where eight would pass 256 MiB: a memfd's pages
        // are only allocated once written, so the pool costs what its payloads touch.
        let fit = ((256usize << 20) / slot).max(1);
        let pool_slots = (1u32 << fit.ilog2()).clamp(2, 8);
        let limits = Limits {
            max_pool_bytes: Limits::default()
                .max_pool_bytes
                .max(slot * pool_slots as usize),
            ..Limits::default()
        };
        ShmConfig {
            ring_entries: 4096,
            pool_slots,
            slot_bytes: slot as u32,
            inline_limit: 1024,
            max_message_size,
            spin: Duration::from_micros(50),
            frame_timeout: Some(transport_framed::DEFAULT_FRAME_TIMEOUT),
            limits,
        }
    }

    /// What this side announces in the set-up.
    pub fn hello(&self) -> Hello {
        Hello {
            ring_entries: self.ring_entries,
            // Room for a return of every slot the peer may lend (its pool is checked against
            // this side's limits, so at most as many slots as the largest ring it accepts).
            return_entries: self.limits.max_ring_entries.next_power_of_two(),
            pool_slots: self.pool_slots,
            slot_bytes: self.slot_bytes,
            inline_limit: self.inline_limit,
        }
    }

    /// What this connection can do.
    pub fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::new(NAME, self.max_message_size);
        c.inline_size = self.inline_limit as usize;
        c.zero_copy_recv = true;
        c.zero_copy_send = true;
        c.event_fd = true;
        c
    }
}

/// Why a shared-memory connection failed: what the peer wrote into shared memory broke a rule
/// (the connection is not used again), or the set-up failed.
#[derive(Debug, thiserror::Error)]
pub enum ShmFailure {
    /// A ring index where no honest peer could have put it.
    #[error("ring: {0}")]
    Ring(#[from] RingError),
    /// An entry that is not a valid message.
    #[error("message: {0}")]
    Msg(#[from] MsgError),
    /// A slot or length outside the pool, a slot named twice, or returned wrongly.
    #[error("pool: {0}")]
    Pool(#[from] PoolError),
    /// An entry of a kind that does not belong on its ring.
    #[error("a {0} entry on the {1} ring")]
    Misplaced(&'static str, &'static str),
    /// The set-up's parts do not fit together (a ring or pool its region cannot hold).
    #[error("set-up: {0}")]
    Setup(#[from] SetupError),
    /// A region smaller than the layout announced for it (the set-up maps each at its
    /// layout's size, so this is a bug, reported rather than panicked on).
    #[error("a region smaller than its announced layout")]
    Layout,
    /// The peer's process ended, or it dropped the connection, without closing it.
    #[error("the peer is gone (its set-up socket closed) without closing the connection")]
    PeerGone,
}

fn failed(f: ShmFailure) -> TransportError {
    TransportError::Backend(BackendError::new(f))
}

/// The set-up socket as the doorbell both halves share.
#[derive(Debug)]
struct Bell {
    sock: UnixStream,
    /// For the receiving half: entries came, a slot is to be returned, or the peer is gone.
    data: Notify,
    /// For the sending half: room came, slots came back, or the peer is gone.
    room: Notify,
    gone: AtomicBool,
}

impl Bell {
    /// Writes one doorbell byte, without waiting: a full socket already holds bytes the peer
    /// has not read, so it wakes anyway; a peer gone is seen by the reading side.
    fn ring(&self, what: u8, metrics: &Metrics) {
        metrics.doorbells.incr();
        metrics.syscalls.incr();
        let _ = send(
            self.sock.as_raw_fd(),
            &[what],
            MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
        );
    }

    fn gone(&self) -> bool {
        self.gone.load(Ordering::Acquire)
    }

    fn set_gone(&self) {
        self.gone.store(true, Ordering::Release);
        self.data.notify_one();
        self.room.notify_one();
    }

    /// Reads what the socket holds (a bounded amount: a peer that floods it costs this side a
    /// read per turn, not a loop) and passes each byte on. Returns whether anything came.
    fn drain(&self) -> bool {
        let mut buf = [0u8; 64];
        let mut any = false;
        for _ in 0..16 {
            match self.sock.try_read(&mut buf) {
                Ok(0) => {
                    self.set_gone();
                    return true;
                }
                Ok(n) => {
                    any = true;
                    let (mut data, mut room) = (false, false);
                    for &b in &buf[..n] {
                        match b {
                            DATA => data = true,
                            ROOM | SLOTS => room = true,
                            // Not a byte an honest peer writes: wake both, each looks.
                            _ => (data, room) = (true, true),
                        }
                    }
                    if data {
                        self.data.notify_one();
                    }
                    if room {
                        self.room.notify_one();
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    self.set_gone();
                    return true;
                }
            }
        }
        any
    }

    /// Waits until `mine` is notified or the socket brings anything (passed on by
    /// [`Bell::drain`]); the caller looks again either way.
    async fn wait(&self, mine: &Notify) {
        let notified = mine.notified();
        tokio::pin!(notified);
        loop {
            tokio::select! {
                () = &mut notified => return,
                r = self.sock.readable() => {
                    if r.is_err() {
                        self.set_gone();
                        return;
                    }
                    if self.drain() {
                        return;
                    }
                }
            }
        }
    }
}

/// A shared-memory connection.
#[derive(Debug)]
pub struct ShmConnection {
    sender: ShmSender,
    receiver: ShmReceiver,
    capabilities: Capabilities,
    metrics: Arc<Metrics>,
    peer: String,
}

impl ShmConnection {
    /// The connection over an established set-up, with `config`'s sizes (the same `config`
    /// whose [`ShmConfig::hello`] this side announced) and `peer` for logs.
    pub fn new(
        est: Established,
        config: &ShmConfig,
        peer: String,
    ) -> Result<ShmConnection, TransportError> {
        let setup = |e: SetupError| failed(ShmFailure::Setup(e));
        let mine: SideLayout = est.my_layout;
        let theirs: SideLayout = est.their_layout;
        let too_small = || failed(ShmFailure::Layout);
        let my_parts = mine.parts(&est.mine).ok_or_else(too_small)?;
        let their_parts = theirs.parts(&est.theirs).ok_or_else(too_small)?;
        let ring = |e: RingError| setup(SetupError::Ring(e));
        let pool = |e: PoolError| setup(SetupError::Pool(e));
        let metrics = Arc::new(Metrics::default());
        let spin = transport_core::spin::useful_budget(
            config.spin,
            transport_core::spin::available_cpus(),
        );
        let bell = Arc::new(Bell {
            sock: est.stream,
            data: Notify::new(),
            room: Notify::new(),
            gone: AtomicBool::new(false),
        });
        // Each direction decodes with its sender's inline limit; payload lengths are checked
        // against this side's limit by the receiving half itself (a message too large is
        // skipped, not a broken connection), so the decoder takes any length a slot holds.
        let msg_limits = |inline: u32| {
            MsgLimits::new(inline as usize, u32::MAX as usize)
                .map_err(|e| failed(ShmFailure::Msg(e)))
        };
        let mine_out = msg_limits(est.my_hello.inline_limit)?;
        let theirs_in = msg_limits(est.their_hello.inline_limit)?;
        let writer = PoolWriter::new(my_parts.pool, mine.pool()).map_err(pool)?;
        let sender = ShmSender {
            data: Producer::new(my_parts.data, mine.data()).map_err(ring)?,
            lender: Arc::new(writer.lender(mine_out.inline_limit())),
            pool: writer,
            returns: Consumer::new(their_parts.returns, theirs.returns()).map_err(ring)?,
            ret_dec: Decoder::new(theirs_in, theirs.pool(), mine.pool()),
            enc: Encoder::new(mine_out),
            entries: vec![[0u8; ENTRY_BYTES]; mine_out.max_entries()].into_boxed_slice(),
            bell: bell.clone(),
            max_message_size: config
                .max_message_size
                .min(MAX_HEADER_LEN + mine.pool().slot_bytes()),
            spin: Spin::new(spin),
            state: SendState::Open,
            metrics: metrics.clone(),
        };
        let mut reader =
            PoolReader::new_at(est.theirs.clone(), theirs.pool_offset(), theirs.pool())
                .map_err(pool)?;
        let back = Arc::new(ReturnPath {
            ring: Mutex::new(Producer::new(my_parts.returns, mine.returns()).map_err(ring)?),
            queue: reader.returns(),
            failed: OnceLock::new(),
            bell: bell.clone(),
            metrics: metrics.clone(),
        });
        // A slot goes back as its last view drops, on whatever thread drops it, whether or not
        // this side's receiving half runs; not once the half is gone.
        let weak = Arc::downgrade(&back);
        reader.on_return(Arc::new(move || {
            if let Some(back) = weak.upgrade() {
                back.flush();
            }
        }));
        let receiver = ShmReceiver {
            data: Consumer::new(their_parts.data, theirs.data())
                .map_err(ring)?
                .publish_every(theirs.data().entries() / 4),
            dec: Decoder::new(theirs_in, theirs.pool(), mine.pool()),
            pool: reader,
            back,
            bell,
            max_message_size: config.max_message_size,
            spin: Spin::new(spin),
            lockstep: Lockstep::default(),
            frame_timeout: config.frame_timeout,
            stall: None,
            done: None,
            metrics: metrics.clone(),
        };
        Ok(ShmConnection {
            sender,
            receiver,
            capabilities: config.capabilities(),
            metrics,
            peer,
        })
    }
}

impl Connection for ShmConnection {
    type Sender = ShmSender;
    type Receiver = ShmReceiver;

    fn capabilities(&self) -> Capabilities {
        self.capabilities.clone()
    }

    fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    fn peer(&self) -> String {
        self.peer.clone()
    }

    fn split(self) -> (ShmSender, ShmReceiver) {
        (self.sender, self.receiver)
    }
}

/// What a message needs of the sender's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotNeed {
    /// Nothing: its payload travels inline.
    None,
    /// A free slot to copy its payload into.
    Copy,
    /// Room for another outstanding send: its payload is in a send buffer of the pool.
    Lent,
}

#[derive(Debug)]
enum SendState {
    Open,
    Closed,
    Failed(Arc<TransportError>),
}

/// The sending half of a shared-memory connection.
#[derive(Debug)]
pub struct ShmSender {
    data: Producer<Words>,
    pool: PoolWriter<Words>,
    /// Send buffers in free slots of `pool` ([`MessageSender::buffer_pool`]).
    lender: Arc<SlotLender<Words>>,
    /// The peer's return ring: slots of this side's pool coming back.
    returns: Consumer<Words>,
    ret_dec: Decoder,
    enc: Encoder,
    entries: Box<[Entry]>,
    bell: Arc<Bell>,
    max_message_size: usize,
    spin: Spin,
    state: SendState,
    metrics: Arc<Metrics>,
}

impl ShmSender {
    fn check(&self) -> Result<(), TransportError> {
        match &self.state {
            SendState::Open => Ok(()),
            SendState::Closed => Err(TransportError::Closed),
            SendState::Failed(e) => Err(TransportError::Failed(e.clone())),
        }
    }

    fn fail(&mut self, f: ShmFailure) -> TransportError {
        let e = Arc::new(failed(f));
        self.state = SendState::Failed(e.clone());
        TransportError::Failed(e)
    }

    /// Takes back the slots the peer returned.
    fn take_returns(&mut self) -> Result<(), TransportError> {
        loop {
            let entry = match self.returns.try_pop() {
                Ok(Some(e)) => e,
                Ok(None) => return Ok(()),
                Err(e) => return Err(self.fail(e.into())),
            };
            match self.ret_dec.push(&entry) {
                Ok(Some(Decoded::Returns(r))) => {
                    for &slot in r.as_slice() {
                        if let Err(e) = self.pool.release(slot) {
                            return Err(self.fail(e.into()));
                        }
                    }
                }
                Ok(Some(_)) => return Err(self.fail(ShmFailure::Misplaced("message", "return"))),
                Ok(None) => {}
                Err(e) => return Err(self.fail(e.into())),
            }
        }
    }

    /// Whether `need` entries (and what `slot` needs) are free now.
    fn ready(&mut self, need: usize, slot: SlotNeed) -> Result<bool, TransportError> {
        self.take_returns()?;
        let room = match self.data.room() {
            Ok(r) => r,
            Err(e) => return Err(self.fail(e.into())),
        };
        Ok(room >= need && self.has_slot(slot))
    }

    /// Whether what `slot` needs of the pool is there now.
    fn has_slot(&self, slot: SlotNeed) -> bool {
        match slot {
            SlotNeed::None => true,
            SlotNeed::Copy => self.pool.available() > 0,
            SlotNeed::Lent => self.pool.can_send_lent(),
        }
    }

    /// A message above the size limit: refused before anything is written.
    fn check_size(&self, msg: &Message) -> Result<(), TransportError> {
        let len = msg.len();
        if len > self.max_message_size {
            return Err(TransportError::MessageTooLarge {
                len: len as u64,
                max: self.max_message_size as u64,
                header: HeaderBytes::EMPTY,
            });
        }
        Ok(())
    }

    /// The entries `msg` takes, and what it needs of the pool.
    fn needs(&self, msg: &Message) -> (usize, SlotNeed) {
        if self.enc.is_inline(msg.payload.len()) {
            (
                entries_for(msg.header.len() + msg.payload.len()),
                SlotNeed::None,
            )
        } else if self.pool.lent_slot(&msg.payload).is_some() {
            (entries_for(msg.header.len()), SlotNeed::Lent)
        } else {
            (entries_for(msg.header.len()), SlotNeed::Copy)
        }
    }

    /// Encodes `msg` (its payload into a slot when it is not inline) and pushes its entries,
    /// which fit ([`Self::ready`] said so); the doorbell is left to [`Self::wake_peer`].
    fn put(&mut self, msg: &Message) -> Result<(), TransportError> {
        let done = match self.enc.encode(msg, &mut self.pool, &mut self.entries) {
            Ok(d) => d,
            Err(e) => return Err(self.fail(e.into())),
        };
        self.push(done.entries)?;
        self.metrics.messages_sent.incr();
        self.metrics.bytes_sent.add(msg.len() as u64);
        if done.copied > 0 {
            self.metrics.payload_bytes_copied.add(done.copied as u64);
        }
        Ok(())
    }

    /// Pushes `n` encoded entries, which fit (checked by [`Self::ready`]).
    fn push(&mut self, n: usize) -> Result<(), TransportError> {
        for i in 0..n {
            match self.data.try_push(&self.entries[i]) {
                Ok(true) => {}
                Ok(false) => unreachable!("room for every entry was checked under the same index"),
                Err(e) => return Err(self.fail(e.into())),
            }
        }
        Ok(())
    }

    /// Rings the doorbell if the peer announced a sleep since it was last rung.
    fn wake_peer(&mut self) {
        if self.data.should_wake() {
            self.bell.ring(DATA, &self.metrics);
        }
    }

    /// Waits until `need` entries (and what `slot` needs) are free: spins first, then
    /// sleeps on the doorbell. Cancel safe: nothing is written while it waits.
    async fn wait_ready(&mut self, need: usize, slot: SlotNeed) -> Result<(), TransportError> {
        let mut w = self.spin.begin();
        loop {
            if self.ready(need, slot)? {
                self.spin.end(&mut w, true);
                return Ok(());
            }
            if self.bell.gone() {
                return Err(self.fail(ShmFailure::PeerGone));
            }
            // No burst: room and slots come back as the peer takes several of this side's
            // messages, not as a lockstep's answer.
            match w.next(false) {
                Next::Look => continue,
                Next::Turn => {
                    tokio::task::yield_now().await;
                    continue;
                }
                Next::Sleep => {}
            }
            self.spin.end(&mut w, false);
            // Sleep on what is missing: room on the data ring, or slots back (room may have
            // come since the look above: then nothing is missing, look again).
            let room_missing = match self.data.room() {
                Ok(r) => r < need,
                Err(e) => return Err(self.fail(e.into())),
            };
            if !room_missing && self.has_slot(slot) {
                continue;
            }
            let sleep = if room_missing {
                self.data.prepare_wait_room(need)
            } else {
                self.returns.prepare_sleep()
            };
            match sleep {
                Ok(true) => self.bell.wait(&self.bell.room).await,
                Ok(false) => {}
                Err(e) => return Err(self.fail(e.into())),
            }
            if room_missing {
                self.data.room_woke();
            } else {
                self.returns.woke();
            }
        }
    }
}

impl MessageSender for ShmSender {
    async fn send(&mut self, msg: Message) -> Result<(), TransportError> {
        self.check()?;
        self.check_size(&msg)?;
        let (need, slot) = self.needs(&msg);
        if !self.ready(need, slot)? {
            self.wait_ready(need, slot).await?;
        }
        self.put(&msg)?;
        self.wake_peer();
        Ok(())
    }

    /// Pushes the messages in order, ringing the doorbell once for all that went in one go.
    /// All or nothing on size: a message above the limit fails the batch before any is sent.
    /// Cancel safe: a message leaves `msgs` only once its entries are in the ring.
    async fn send_batch(&mut self, msgs: &mut Vec<Message>) -> Result<(), TransportError> {
        self.check()?;
        for m in msgs.iter() {
            self.check_size(m)?;
        }
        let mut sent = 0;
        let result = loop {
            let Some(msg) = msgs.get(sent) else {
                break Ok(());
            };
            let (need, slot) = self.needs(msg);
            match self.ready(need, slot) {
                Ok(true) => {}
                Ok(false) => {
                    // About to wait: what went leaves the batch first, and the peer hears.
                    msgs.drain(..sent);
                    sent = 0;
                    self.wake_peer();
                    match self.wait_ready(need, slot).await {
                        Ok(()) => continue,
                        Err(e) => break Err(e),
                    }
                }
                Err(e) => break Err(e),
            }
            if let Err(e) = self.put(&msgs[sent]) {
                break Err(e);
            }
            sent += 1;
        };
        msgs.drain(..sent);
        self.wake_peer();
        result
    }

    fn max_message_size(&self) -> usize {
        self.max_message_size
    }

    /// Send buffers in free slots of this side's pool, for payloads above the inline limit
    /// and up to a slot: sending one names its slot, without a copy (heap memory otherwise,
    /// or when the application holds all slots but a reserve; see [`crate::pool::lend`]).
    fn buffer_pool(&self) -> Arc<dyn BufferPool> {
        self.lender.clone()
    }

    /// Sends a close entry (after the messages before it): the peer's `recv` then returns
    /// `Ok(None)`. Later sends fail with [`TransportError::Closed`].
    async fn close(&mut self) -> Result<(), TransportError> {
        if matches!(self.state, SendState::Closed) {
            return Ok(());
        }
        self.check()?;
        if !self.ready(1, SlotNeed::None)? {
            self.wait_ready(1, SlotNeed::None).await?;
        }
        encode_close(&mut self.entries[0]);
        self.push(1)?;
        self.wake_peer();
        self.state = SendState::Closed;
        Ok(())
    }

    fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

impl Drop for ShmSender {
    /// A sender dropped without `close` closes if the ring has room now (it does not wait):
    /// the peer sees a clean end after the messages sent. Otherwise the peer sees the end when
    /// the set-up socket closes.
    fn drop(&mut self) {
        if matches!(self.state, SendState::Open)
            && matches!(self.ready(1, SlotNeed::None), Ok(true))
        {
            encode_close(&mut self.entries[0]);
            if self.push(1).is_ok() {
                self.wake_peer();
            }
        }
    }
}

/// This side's return ring, on which the peer's slots go back: shared by the receiving half
/// and the payloads it lent (through the pool's return hook), so that a slot goes back when its
/// last view drops, even while the receiving half is not running (an application that sends
/// while it holds payloads would otherwise wait for slots its peer waits for too).
#[derive(Debug)]
struct ReturnPath {
    ring: Mutex<Producer<Words>>,
    queue: Returns,
    /// How the peer broke the return ring: the receiving half fails at its next look.
    failed: OnceLock<RingError>,
    bell: Arc<Bell>,
    metrics: Arc<Metrics>,
}

impl ReturnPath {
    /// Pushes the slots whose payloads were dropped, as many as the ring has room for (all of
    /// them, unless the peer stopped taking returns: an honest peer leaves room for a return
    /// of every slot it lends), and wakes the peer's sending half if it sleeps waiting for
    /// them. What is left waits for the next drop.
    fn flush(&self) {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let mut back = [SlotId::new(0); RETURNS_PER_ENTRY];
        let mut pushed = false;
        loop {
            match ring.room() {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    let _ = self.failed.set(e);
                    break;
                }
            }
            let n = self.queue.pop(&mut back);
            if n == 0 {
                break;
            }
            let mut entry = [0u8; ENTRY_BYTES];
            encode_returns(&back[..n], &mut entry);
            match ring.try_push(&entry) {
                Ok(true) => pushed = true,
                Ok(false) => unreachable!("room was checked under the lock"),
                Err(e) => {
                    let _ = self.failed.set(e);
                    break;
                }
            }
        }
        if pushed && ring.should_wake() {
            self.bell.ring(SLOTS, &self.metrics);
        }
    }
}

/// The receiving half of a shared-memory connection.
#[derive(Debug)]
pub struct ShmReceiver {
    data: Consumer<Words>,
    dec: Decoder,
    /// The peer's pool, whose payloads this half hands out.
    pool: PoolReader,
    /// This side's return ring: the peer's slots going back.
    back: Arc<ReturnPath>,
    bell: Arc<Bell>,
    max_message_size: usize,
    spin: Spin,
    lockstep: Lockstep,
    frame_timeout: Option<Duration>,
    /// While a message is half there: the entries popped when it last made progress, and
    /// since when.
    stall: Option<(u64, Instant)>,
    /// The end (`Ok`) or the failure, once seen: every later `recv` answers it.
    done: Option<Result<(), Arc<TransportError>>>,
    metrics: Arc<Metrics>,
}

/// What one look at the ring found.
enum Found {
    Msg(Message),
    TooLarge(TransportError),
    End,
    Nothing,
}

impl ShmReceiver {
    fn fail(&mut self, f: ShmFailure) -> TransportError {
        let e = Arc::new(failed(f));
        self.done = Some(Err(e.clone()));
        TransportError::Failed(e)
    }

    /// One look: the next whole message if its entries are there.
    fn look(&mut self) -> Result<Found, TransportError> {
        if let Some(e) = self.back.failed.get() {
            return Err(self.fail(ShmFailure::Ring(*e)));
        }
        loop {
            let entry = match self.data.try_pop() {
                Ok(Some(e)) => e,
                Ok(None) => return Ok(Found::Nothing),
                Err(e) => return Err(self.fail(e.into())),
            };
            if self.data.should_signal_room() {
                self.bell.ring(ROOM, &self.metrics);
            }
            let decoded = match self.dec.push(&entry) {
                Ok(Some(d)) => d,
                Ok(None) => continue,
                Err(e) => return Err(self.fail(e.into())),
            };
            let (header, payload) = match decoded {
                Decoded::Message(m) => {
                    self.metrics
                        .payload_bytes_copied
                        .add(m.payload.len() as u64);
                    (m.header, m.payload)
                }
                Decoded::InSlot {
                    header,
                    slot,
                    offset,
                    len,
                } => match self.pool.take(slot, offset, len) {
                    Ok(p) => (header, p),
                    Err(e) => return Err(self.fail(e.into())),
                },
                Decoded::Close => return Ok(Found::End),
                Decoded::Returns(_) => {
                    return Err(self.fail(ShmFailure::Misplaced("slot return", "data")))
                }
            };
            let len = header.len() + payload.len();
            self.metrics.bytes_received.add(len as u64);
            if len > self.max_message_size {
                // Skipped: its slot goes back as the payload drops here.
                drop(payload);
                return Ok(Found::TooLarge(TransportError::MessageTooLarge {
                    len: len as u64,
                    max: self.max_message_size as u64,
                    header,
                }));
            }
            self.metrics.messages_received.incr();
            return Ok(Found::Msg(Message::new(header, payload)));
        }
    }

    /// With a message half there: how long it may still go without progress (its entries
    /// popped so far unchanged), or [`TransportError::Stalled`] once `limit` has passed.
    fn stall_left(&mut self, limit: Duration) -> Result<Duration, TransportError> {
        let popped = self.data.popped();
        let now = Instant::now();
        let since = match self.stall {
            Some((p, at)) if p == popped => at,
            _ => {
                self.stall = Some((popped, now));
                now
            }
        };
        let left = limit.saturating_sub(now.duration_since(since));
        if left.is_zero() {
            let e = Arc::new(TransportError::Stalled {
                received: 0,
                expected: 0,
                after: limit,
            });
            self.done = Some(Err(e.clone()));
            return Err(TransportError::Failed(e));
        }
        Ok(left)
    }

    fn outcome(&mut self, found: Found) -> Option<Result<Option<Message>, TransportError>> {
        if !matches!(found, Found::Nothing) {
            self.lockstep.came(&self.metrics);
        }
        match found {
            Found::Msg(m) => Some(Ok(Some(m))),
            Found::TooLarge(e) => Some(Err(e)),
            Found::End => {
                self.done = Some(Ok(()));
                Some(Ok(None))
            }
            Found::Nothing => None,
        }
    }
}

impl MessageReceiver for ShmReceiver {
    async fn recv(&mut self) -> Result<Option<Message>, TransportError> {
        match &self.done {
            Some(Ok(())) => return Ok(None),
            Some(Err(e)) => return Err(TransportError::Failed(e.clone())),
            None => {}
        }
        let mut w: Option<Spinning> = None;
        loop {
            // Read before the look: entries the peer pushed before it went are still taken.
            let gone = self.bell.gone();
            let found = self.look()?;
            if let Some(r) = self.outcome(found) {
                if let Some(w) = &mut w {
                    self.spin.end(w, true);
                }
                return r;
            }
            if gone {
                let e = if self.dec.in_message() {
                    TransportError::Truncated {
                        received: 0,
                        expected: 0,
                    }
                } else {
                    failed(ShmFailure::PeerGone)
                };
                let e = Arc::new(e);
                self.done = Some(Err(e.clone()));
                return Err(TransportError::Failed(e));
            }
            // The first look found nothing: this is a wait (a `recv` that finds its message at
            // once is not one, and teaches the spin nothing).
            let w = w.get_or_insert_with(|| self.spin.begin());
            match w.next(self.lockstep.check(&self.metrics)) {
                Next::Look => continue,
                Next::Turn => {
                    tokio::task::yield_now().await;
                    continue;
                }
                Next::Sleep => {}
            }
            self.spin.end(w, false);
            let limit = match self.frame_timeout {
                Some(t) if self.dec.in_message() => Some(self.stall_left(t)?),
                _ => {
                    self.stall = None;
                    None
                }
            };
            if self.data.publish() {
                self.bell.ring(ROOM, &self.metrics);
            }
            match self.data.prepare_sleep() {
                Ok(true) => match limit {
                    // Woken or not, the next turn looks (and fails if the time is up).
                    Some(left) => {
                        let _ = tokio::time::timeout(left, self.bell.wait(&self.bell.data)).await;
                    }
                    None => self.bell.wait(&self.bell.data).await,
                },
                Ok(false) => {}
                Err(e) => return Err(self.fail(e.into())),
            }
            self.data.woke();
        }
    }

    /// One look at the ring (returns sent, the next whole message taken if it is there).
    fn try_recv(&mut self) -> TryRecv {
        match &self.done {
            Some(Ok(())) => return TryRecv::Ready(Ok(None)),
            Some(Err(e)) => return TryRecv::Ready(Err(TransportError::Failed(e.clone()))),
            None => {}
        }
        let gone = self.bell.gone();
        match self.look() {
            Ok(found) => match self.outcome(found) {
                Some(r) => TryRecv::Ready(r),
                // `recv` tells how the peer went.
                None if gone => TryRecv::Unknown,
                None => TryRecv::Empty,
            },
            Err(e) => TryRecv::Ready(Err(e)),
        }
    }

    fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}
