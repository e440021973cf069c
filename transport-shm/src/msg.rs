//! Messages on the rings: how one message (a header of up to [`MAX_HEADER_LEN`] bytes and a
//! payload, as [`transport_core::Message`]) becomes ring entries, and back.
//!
//! # Entries
//!
//! A message is a **first entry** and `cont` **continuation entries** (`cont` from 0 to 255,
//! always the fewest that hold the message's data). The first entry starts with a 16-byte
//! descriptor; integers are little-endian:
//!
//! | bytes | field |
//! |---|---|
//! | 0 | kind: 1 data inline, 2 data in a pool slot, 3 slot returns, 4 close ([`Kind`]) |
//! | 1 | header length, 0 to [`MAX_HEADER_LEN`] (0 unless data) |
//! | 2 | `cont`: continuation entries that follow (0 unless data) |
//! | 3 | zero |
//! | 4..8 | payload length (data); number of slot ids (slot returns, 1 to [`RETURNS_PER_ENTRY`]); 0 (close) |
//! | 8..12 | slot id (data in a slot, in the *sender's* pool); 0 otherwise |
//! | 12..16 | offset of the payload in its slot (data in a slot); 0 otherwise |
//! | 16..64 | data: the header's bytes, then (kind 1) the payload's; or (kind 3) the slot ids, 4 bytes each |
//!
//! The data goes on in each continuation entry, 64 bytes of it per entry. Every byte after the
//! data (in the first entry or the last continuation) is zero. So a message whose header and
//! inline payload take at most [`FIRST_DATA`] = 48 bytes is one entry: an RPC `void o()`
//! request (a 24-byte header, an empty payload) is one entry, like any header with a payload
//! of up to 24 bytes.
//!
//! A payload of at most [`MsgLimits::inline_limit`] bytes travels inline; a longer one goes
//! in a slot of the sender's pool ([`crate::pool`]), and the entry carries its slot, its
//! offset in the slot (not 0 when the application sent part of a send buffer it wrote in a
//! slot, [`crate::pool::lend`]) and its length.
//! The receiver returns slots in kind-3 entries, up to [`RETURNS_PER_ENTRY`] ids each.
//!
//! # Who trusts what
//!
//! An entry is copied out of the ring once ([`crate::ring::Consumer::try_pop`]) and the
//! [`Decoder`] reads only that copy, checking every field before using it: the kind, the
//! header length, the payload length against the limits (inline or in a slot), the
//! continuation count against the lengths, the slot ids against the pools' layouts, and that
//! every reserved or padding byte is zero. A failed check is a typed [`MsgError`] that sticks
//! (the decoder is not used again), never a panic; the decoder allocates once, when built
//! (its buffer, sized by this side's limits), and per message at most a copy of an inline
//! payload (within the inline limit).

use crate::pool::{PoolError, PoolLayout, PoolWriter, SlotId};
use crate::ring::ENTRY_BYTES;
use bytes::Bytes;
use std::ops::Deref;
use std::sync::atomic::AtomicU64;
use transport_core::{HeaderBytes, Message, MAX_HEADER_LEN};

/// One ring entry.
pub type Entry = [u8; ENTRY_BYTES];

/// Bytes of the descriptor at the start of a message's first entry.
pub const DESCRIPTOR_BYTES: usize = 16;
/// Bytes of data (header, inline payload) the first entry holds after its descriptor.
pub const FIRST_DATA: usize = ENTRY_BYTES - DESCRIPTOR_BYTES;
/// Slot ids in one slot-return entry.
pub const RETURNS_PER_ENTRY: usize = FIRST_DATA / 4;
/// The largest inline limit a side may set: 4 KiB (libfabric's inject size), 66 entries.
pub const MAX_INLINE_LIMIT: usize = 4096;
/// The default inline limit: a payload of up to 192 bytes travels inline, so a message with
/// an RPC header (24 bytes) and an inline payload takes at most 4 entries.
pub const DEFAULT_INLINE_LIMIT: usize = 192;
/// The default largest payload: 16 MiB (and never more than a slot).
pub const DEFAULT_MAX_PAYLOAD: usize = 16 << 20;

/// Bytes of the descriptor's fields.
const KIND: usize = 0;
const HEADER_LEN: usize = 1;
const CONT: usize = 2;
const PAYLOAD_LEN: usize = 4;
const SLOT: usize = 8;
const OFFSET: usize = 12;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A header and a payload, both in the entries.
    Inline = 1,
    /// A header in the entries, the payload in a slot of the sender's pool.
    InSlot = 2,
    /// Slots of the receiver's pool that the sender of this entry returns.
    SlotReturns = 3,
    /// The sender will send nothing more.
    Close = 4,
}

impl Kind {
    fn from_byte(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Inline,
            2 => Kind::InSlot,
            3 => Kind::SlotReturns,
            4 => Kind::Close,
            _ => return None,
        })
    }
}

/// Why a message cannot be encoded, or what was wrong with one received.
///
/// The decoder's errors (all but [`MsgError::BadLimits`], [`MsgError::NoRoom`] and
/// [`MsgError::Pool`]) mean the peer is corrupt; they fail the [`Decoder`] for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MsgError {
    /// An inline limit over [`MAX_INLINE_LIMIT`] or a payload limit over `u32::MAX`.
    #[error(
        "inline limit {inline_limit} (at most 4096), payload limit {max_payload} (at most 2^32-1)"
    )]
    BadLimits {
        /// The inline limit asked for.
        inline_limit: usize,
        /// The payload limit asked for.
        max_payload: usize,
    },
    /// Encoding: the entries given cannot hold the message (nothing was taken from the pool).
    #[error("the message needs {need} entries, {got} were given")]
    NoRoom {
        /// Entries the message needs.
        need: usize,
        /// Entries given.
        got: usize,
    },
    /// Encoding: the pool refused (no free slot is `NoSlot`, not this).
    #[error("pool: {0}")]
    Pool(#[from] PoolError),
    /// Encoding: every slot of the pool is lent; try again when some are returned.
    #[error("every slot of the pool is lent")]
    NoSlot,
    /// A kind that is none of [`Kind`]'s.
    #[error("an entry of kind {0}, which does not exist")]
    UnknownKind(u8),
    /// A byte that must be zero is not (a reserved field or padding after the data).
    #[error("byte {byte} of the message's entry {entry} must be zero")]
    Reserved {
        /// Which entry of the message: 0 for the first.
        entry: u8,
        /// Which byte of it.
        byte: u8,
    },
    /// A header longer than [`MAX_HEADER_LEN`].
    #[error("a header of {0} bytes, at most 64 are allowed")]
    HeaderTooLong(usize),
    /// An inline payload longer than the inline limit.
    #[error("an inline payload of {len} bytes, at most {max} are allowed")]
    InlineTooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A payload longer than the payload limit or than a slot.
    #[error("a payload of {len} bytes, at most {max} are allowed")]
    PayloadTooLong {
        /// Its length.
        len: usize,
        /// The limit (the smaller of the payload limit and, in a slot, the slot's size).
        max: usize,
    },
    /// The continuation count is not the one the lengths need.
    #[error("{got} continuation entries announced, the lengths need {want}")]
    BadContinuation {
        /// What the entry said.
        got: u8,
        /// What the lengths need.
        want: usize,
    },
    /// A slot id past the end of its pool.
    #[error("slot {slot} of a pool of {slots}")]
    SlotOutOfRange {
        /// The id.
        slot: u32,
        /// Slots in the pool.
        slots: usize,
    },
    /// A payload in a slot that starts at an offset but ends past the slot.
    #[error("a payload of {len} bytes at offset {offset} of a slot of {slot_bytes}")]
    PastSlotEnd {
        /// The offset.
        offset: u32,
        /// Its length.
        len: usize,
        /// Bytes per slot.
        slot_bytes: usize,
    },
    /// A slot-return entry with no ids or more than [`RETURNS_PER_ENTRY`].
    #[error("a slot-return entry with {0} ids (1 to 12 fit)")]
    BadReturnCount(u32),
}

/// What one side sends inline and accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsgLimits {
    inline_limit: usize,
    max_payload: usize,
}

impl Default for MsgLimits {
    fn default() -> Self {
        MsgLimits {
            inline_limit: DEFAULT_INLINE_LIMIT,
            max_payload: DEFAULT_MAX_PAYLOAD,
        }
    }
}

impl MsgLimits {
    /// Payloads of up to `inline_limit` bytes (at most [`MAX_INLINE_LIMIT`]) travel inline;
    /// none may exceed `max_payload` (at most `u32::MAX`). Both sides of a connection must use
    /// the same inline limit (the decoder refuses longer inline payloads).
    ///
    /// ```
    /// use transport_shm::msg::{MsgLimits, MAX_INLINE_LIMIT};
    /// let l = MsgLimits::new(64, 1 << 20)?;
    /// assert_eq!(l.max_entries(), 3); // a 64-byte header and 64 inline bytes
    /// assert!(MsgLimits::new(MAX_INLINE_LIMIT + 1, 1 << 20).is_err());
    /// # Ok::<(), transport_shm::msg::MsgError>(())
    /// ```
    pub fn new(inline_limit: usize, max_payload: usize) -> Result<MsgLimits, MsgError> {
        if inline_limit > MAX_INLINE_LIMIT || max_payload > u32::MAX as usize {
            return Err(MsgError::BadLimits {
                inline_limit,
                max_payload,
            });
        }
        Ok(MsgLimits {
            inline_limit,
            max_payload,
        })
    }

    /// The longest payload that travels inline.
    pub fn inline_limit(&self) -> usize {
        self.inline_limit
    }

    /// The longest payload.
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    /// The longest inline payload accepted: the smaller limit.
    fn inline_max(&self) -> usize {
        self.inline_limit.min(self.max_payload)
    }

    /// Entries the longest message takes (a full header and the longest inline payload): how
    /// many to give [`Encoder::encode`] so that any message fits.
    pub fn max_entries(&self) -> usize {
        entries_for(MAX_HEADER_LEN + self.inline_max())
    }
}

/// Entries a message whose header and inline payload take `data` bytes needs.
///
/// ```
/// use transport_shm::msg::entries_for;
/// assert_eq!(entries_for(0), 1);
/// assert_eq!(entries_for(48), 1);
/// assert_eq!(entries_for(49), 2);
/// assert_eq!(entries_for(48 + 64), 2);
/// ```
pub const fn entries_for(data: usize) -> usize {
    1 + continuations_for(data)
}

const fn continuations_for(data: usize) -> usize {
    data.saturating_sub(FIRST_DATA).div_ceil(ENTRY_BYTES)
}

/// Where byte `pos` of a message's data lies: (entry, byte in the entry).
fn locate(pos: usize) -> (usize, usize) {
    if pos < FIRST_DATA {
        (0, DESCRIPTOR_BYTES + pos)
    } else {
        let p = pos - FIRST_DATA;
        (1 + p / ENTRY_BYTES, p % ENTRY_BYTES)
    }
}

/// Copies `src` into the data of `out` from data byte `pos`.
fn put_data(out: &mut [Entry], mut pos: usize, mut src: &[u8]) {
    while !src.is_empty() {
        let (e, o) = locate(pos);
        let n = (ENTRY_BYTES - o).min(src.len());
        out[e][o..o + n].copy_from_slice(&src[..n]);
        pos += n;
        src = &src[n..];
    }
}

/// Writes the descriptor of a data message into zeroed `out[..need]` and its data; `need` was
/// checked against `out.len()`. `(slot, offset)` say where a payload in a slot lies (zeros
/// for an inline one).
fn put_message(
    out: &mut [Entry],
    need: usize,
    kind: Kind,
    header: &HeaderBytes,
    payload_len: u32,
    (slot, offset): (u32, u32),
    inline: &[u8],
) {
    for e in &mut out[..need] {
        *e = [0; ENTRY_BYTES];
    }
    let first = &mut out[0];
    first[KIND] = kind as u8;
    first[HEADER_LEN] = header.len() as u8;
    // At most 66 entries for the largest inline limit: fits in a byte.
    first[CONT] = (need - 1) as u8;
    first[PAYLOAD_LEN..PAYLOAD_LEN + 4].copy_from_slice(&payload_len.to_le_bytes());
    first[SLOT..SLOT + 4].copy_from_slice(&slot.to_le_bytes());
    first[OFFSET..OFFSET + 4].copy_from_slice(&offset.to_le_bytes());
    put_data(out, 0, header.as_slice());
    put_data(out, header.len(), inline);
}

/// Turns messages into entries. Allocates nothing.
///
/// ```
/// use transport_core::HeaderBytes;
/// use transport_shm::msg::{Decoded, Decoder, Encoder, MsgLimits};
/// use transport_shm::pool::PoolLayout;
///
/// let limits = MsgLimits::default();
/// let enc = Encoder::new(limits);
/// let mut entries = [[0u8; 64]; 4];
/// let header = HeaderBytes::new(&[1; 24]).unwrap();
/// let n = enc.encode_inline(&header, b"", &mut entries)?;
/// assert_eq!(n, 1, "a void o() request is one entry");
///
/// let pool = PoolLayout::new(16, 4096).unwrap();
/// let mut dec = Decoder::new(limits, pool, pool);
/// match dec.push(&entries[0])? {
///     Some(Decoded::Message(m)) => assert_eq!(m.header, header),
///     other => panic!("{other:?}"),
/// }
/// # Ok::<(), transport_shm::msg::MsgError>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Encoder {
    limits: MsgLimits,
}

impl Encoder {
    /// An encoder that sends inline what `limits` say.
    pub fn new(limits: MsgLimits) -> Encoder {
        Encoder { limits }
    }

    /// Whether a payload of `len` bytes travels inline.
    pub fn is_inline(&self, len: usize) -> bool {
        len <= self.limits.inline_max()
    }

    /// Writes a message with an inline payload into `out` (at most [`MsgLimits::inline_limit`]
    /// bytes of payload) and returns the entries used, `out[..n]`, to push in order.
    pub fn encode_inline(
        &self,
        header: &HeaderBytes,
        payload: &[u8],
        out: &mut [Entry],
    ) -> Result<usize, MsgError> {
        if payload.len() > self.limits.inline_max() {
            return Err(MsgError::InlineTooLong {
                len: payload.len(),
                max: self.limits.inline_max(),
            });
        }
        let need = entries_for(header.len() + payload.len());
        if need > out.len() {
            return Err(MsgError::NoRoom {
                need,
                got: out.len(),
            });
        }
        // Below the inline limit, so below 2^32.
        put_message(
            out,
            need,
            Kind::Inline,
            header,
            payload.len() as u32,
            (0, 0),
            payload,
        );
        Ok(need)
    }

    /// Writes a message whose `len`-byte payload is at `offset` in `slot` of this side's pool
    /// (already written) into `out`, and returns the entries used.
    pub fn encode_in_slot(
        &self,
        header: &HeaderBytes,
        slot: SlotId,
        offset: u32,
        len: usize,
        out: &mut [Entry],
    ) -> Result<usize, MsgError> {
        if len > self.limits.max_payload {
            return Err(MsgError::PayloadTooLong {
                len,
                max: self.limits.max_payload,
            });
        }
        let need = entries_for(header.len());
        if need > out.len() {
            return Err(MsgError::NoRoom {
                need,
                got: out.len(),
            });
        }
        // At most `max_payload`, itself at most u32::MAX.
        put_message(
            out,
            need,
            Kind::InSlot,
            header,
            len as u32,
            (slot.get(), offset),
            &[],
        );
        Ok(need)
    }

    /// Writes `msg` into `out`: inline if its payload is short enough, else through a slot of
    /// `pool`: the slot of an application's send buffer the payload lies in
    /// ([`PoolWriter::lent_slot`], no copy), or a slot taken and written here. Returns the
    /// entries used and the payload bytes copied. When no slot is free (or `pool` has as many
    /// sends outstanding as slots) this is [`MsgError::NoSlot`] and nothing changed;
    /// [`MsgError::NoRoom`] takes no slot either.
    pub fn encode<R: Deref<Target = [AtomicU64]>>(
        &self,
        msg: &Message,
        pool: &mut PoolWriter<R>,
        out: &mut [Entry],
    ) -> Result<Encoded, MsgError> {
        let payload = &msg.payload[..];
        if self.is_inline(payload.len()) {
            let entries = self.encode_inline(&msg.header, payload, out)?;
            return Ok(Encoded {
                entries,
                copied: payload.len(),
            });
        }
        let max = self.limits.max_payload.min(pool.layout().slot_bytes());
        if payload.len() > max {
            return Err(MsgError::PayloadTooLong {
                len: payload.len(),
                max,
            });
        }
        let need = entries_for(msg.header.len());
        if need > out.len() {
            return Err(MsgError::NoRoom {
                need,
                got: out.len(),
            });
        }
        let no_slot = |pool: &PoolWriter<R>| match pool.failed() {
            Some(e) => MsgError::Pool(e),
            None => MsgError::NoSlot,
        };
        if let Some((slot, offset)) = pool.lent_slot(payload) {
            if !pool.can_send_lent() {
                return Err(no_slot(pool));
            }
            let entries = self.encode_in_slot(&msg.header, slot, offset, payload.len(), out)?;
            pool.send_lent(slot, &msg.payload)?;
            return Ok(Encoded { entries, copied: 0 });
        }
        let slot = pool.alloc().ok_or_else(|| no_slot(pool))?;
        pool.write(slot, payload)?;
        let entries = self.encode_in_slot(&msg.header, slot, 0, payload.len(), out)?;
        Ok(Encoded {
            entries,
            copied: payload.len(),
        })
    }
}

/// What [`Encoder::encode`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Encoded {
    /// Entries written, `out[..entries]`, to push in order.
    pub entries: usize,
    /// Payload bytes copied (into the entries or a slot); 0 for an application's send buffer
    /// in a slot.
    pub copied: usize,
}

/// Writes a slot-return entry for the first [`RETURNS_PER_ENTRY`] (at most) of `slots` and
/// returns how many it took; 0 (and `out` untouched) when `slots` is empty.
///
/// ```
/// use transport_shm::msg::{encode_returns, RETURNS_PER_ENTRY};
/// use transport_shm::pool::SlotId;
/// let slots: Vec<SlotId> = (0..20).map(SlotId::new).collect();
/// let mut entry = [0u8; 64];
/// assert_eq!(encode_returns(&slots, &mut entry), RETURNS_PER_ENTRY);
/// assert_eq!(encode_returns(&slots[12..], &mut entry), 8);
/// assert_eq!(encode_returns(&[], &mut entry), 0);
/// ```
pub fn encode_returns(slots: &[SlotId], out: &mut Entry) -> usize {
    let n = slots.len().min(RETURNS_PER_ENTRY);
    if n == 0 {
        return 0;
    }
    *out = [0; ENTRY_BYTES];
    out[KIND] = Kind::SlotReturns as u8;
    out[PAYLOAD_LEN..PAYLOAD_LEN + 4].copy_from_slice(&(n as u32).to_le_bytes());
    for (i, s) in slots[..n].iter().enumerate() {
        let at = DESCRIPTOR_BYTES + 4 * i;
        out[at..at + 4].copy_from_slice(&s.get().to_le_bytes());
    }
    n
}

/// Writes a close entry.
pub fn encode_close(out: &mut Entry) {
    *out = [0; ENTRY_BYTES];
    out[KIND] = Kind::Close as u8;
}

/// Slot ids from one slot-return entry, checked against this side's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotReturns {
    n: u8,
    ids: [SlotId; RETURNS_PER_ENTRY],
}

impl SlotReturns {
    /// The ids, in the entry's order. Each is in range; whether it was lent is for
    /// [`PoolWriter::release`] to check.
    pub fn as_slice(&self) -> &[SlotId] {
        &self.ids[..self.n as usize]
    }
}

/// One message received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// A message whose payload came inline (copied out of the entries).
    Message(Message),
    /// A message whose payload is in `slot` of the peer's pool, `len` bytes from `offset`: all
    /// checked against the pool's layout; [`crate::pool::PoolReader::take`] hands it out.
    InSlot {
        /// The header.
        header: HeaderBytes,
        /// The slot, in the peer's pool.
        slot: SlotId,
        /// Where the payload starts in the slot.
        offset: u32,
        /// The payload's length.
        len: u32,
    },
    /// Slots of this side's pool that the peer returns.
    Returns(SlotReturns),
    /// The peer will send nothing more.
    Close,
}

/// A data message whose continuation entries are still to come.
#[derive(Debug, Clone, Copy)]
struct Pending {
    kind: Kind,
    header_len: usize,
    payload_len: u32,
    slot: u32,
    offset: u32,
    /// Bytes of data (header, and inline payload) in all.
    data: usize,
    /// Bytes of data received so far.
    filled: usize,
    /// Continuation entries received so far.
    entries: u8,
}

/// Turns entries from the peer back into messages, one entry at a time, checking everything.
///
/// Its buffer is allocated once, by [`Decoder::new`], at the size this side's limits allow;
/// nothing the peer sends changes that.
#[derive(Debug)]
pub struct Decoder {
    limits: MsgLimits,
    their_pool: PoolLayout,
    my_slots: usize,
    buf: Box<[u8]>,
    pending: Option<Pending>,
    failed: Option<MsgError>,
}

impl Decoder {
    /// A decoder for entries from a peer that sends with `limits` and writes its payloads in
    /// `their_pool`; the peer returns slots of `my_pool`.
    pub fn new(limits: MsgLimits, their_pool: PoolLayout, my_pool: PoolLayout) -> Decoder {
        let buf = vec![0u8; limits.max_entries() * ENTRY_BYTES].into_boxed_slice();
        Decoder {
            limits,
            their_pool,
            my_slots: my_pool.slots(),
            buf,
            pending: None,
            failed: None,
        }
    }

    /// Takes the next entry from the peer: `Ok(Some(_))` when it completes a message,
    /// `Ok(None)` when more entries of the message are to come, or the error that failed this
    /// decoder (for good: every later call returns it).
    pub fn push(&mut self, entry: &Entry) -> Result<Option<Decoded>, MsgError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let r = match self.pending {
            None => self.first(entry),
            Some(p) => self.continuation(p, entry),
        };
        if let Err(e) = r {
            self.failed = Some(e);
            self.pending = None;
        }
        r
    }

    /// Whether part of a message has come and the rest has not.
    pub fn in_message(&self) -> bool {
        self.pending.is_some()
    }

    /// The error that failed the decoder, if one did.
    pub fn failed(&self) -> Option<MsgError> {
        self.failed
    }

    fn first(&mut self, e: &Entry) -> Result<Option<Decoded>, MsgError> {
        let kind = Kind::from_byte(e[KIND]).ok_or(MsgError::UnknownKind(e[KIND]))?;
        zero(e, 0, 3..4)?;
        let header_len = e[HEADER_LEN] as usize;
        let cont = e[CONT];
        let payload_len = u32::from_le_bytes([e[4], e[5], e[6], e[7]]);
        let slot = u32::from_le_bytes([e[8], e[9], e[10], e[11]]);
        let offset = u32::from_le_bytes([e[12], e[13], e[14], e[15]]);
        if kind != Kind::InSlot {
            zero(e, 0, OFFSET..OFFSET + 4)?;
        }
        match kind {
            Kind::Close => {
                zero(e, 0, 1..ENTRY_BYTES)?;
                Ok(Some(Decoded::Close))
            }
            Kind::SlotReturns => {
                zero(e, 0, 1..4)?;
                zero(e, 0, 8..12)?;
                let n = payload_len as usize;
                if !(1..=RETURNS_PER_ENTRY).contains(&n) {
                    return Err(MsgError::BadReturnCount(payload_len));
                }
                let end = DESCRIPTOR_BYTES + 4 * n;
                zero(e, 0, end..ENTRY_BYTES)?;
                let mut ids = [SlotId::new(0); RETURNS_PER_ENTRY];
                for (i, id) in ids[..n].iter_mut().enumerate() {
                    let at = DESCRIPTOR_BYTES + 4 * i;
                    let raw = u32::from_le_bytes([e[at], e[at + 1], e[at + 2], e[at + 3]]);
                    if raw as usize >= self.my_slots {
                        return Err(MsgError::SlotOutOfRange {
                            slot: raw,
                            slots: self.my_slots,
                        });
                    }
                    *id = SlotId::new(raw);
                }
                Ok(Some(Decoded::Returns(SlotReturns { n: n as u8, ids })))
            }
            Kind::Inline | Kind::InSlot => {
                if header_len > MAX_HEADER_LEN {
                    return Err(MsgError::HeaderTooLong(header_len));
                }
                let len = payload_len as usize;
                let data = if kind == Kind::Inline {
                    let max = self.limits.inline_max();
                    if len > max {
                        return Err(MsgError::InlineTooLong { len, max });
                    }
                    zero(e, 0, SLOT..SLOT + 4)?;
                    header_len + len
                } else {
                    let max = self.limits.max_payload.min(self.their_pool.slot_bytes());
                    if len > max {
                        return Err(MsgError::PayloadTooLong { len, max });
                    }
                    if slot as usize >= self.their_pool.slots() {
                        return Err(MsgError::SlotOutOfRange {
                            slot,
                            slots: self.their_pool.slots(),
                        });
                    }
                    // `len` is at most a slot here: no underflow.
                    let slot_bytes = self.their_pool.slot_bytes();
                    if offset as usize > slot_bytes - len {
                        return Err(MsgError::PastSlotEnd {
                            offset,
                            len,
                            slot_bytes,
                        });
                    }
                    header_len
                };
                let want = continuations_for(data);
                if cont as usize != want {
                    return Err(MsgError::BadContinuation { got: cont, want });
                }
                // `data` is at most a full header and the inline maximum: within `buf`.
                let here = data.min(FIRST_DATA);
                zero(e, 0, DESCRIPTOR_BYTES + here..ENTRY_BYTES)?;
                self.buf[..here].copy_from_slice(&e[DESCRIPTOR_BYTES..DESCRIPTOR_BYTES + here]);
                let p = Pending {
                    kind,
                    header_len,
                    payload_len,
                    slot,
                    offset,
                    data,
                    filled: here,
                    entries: 0,
                };
                if cont == 0 {
                    return self.finish(p).map(Some);
                }
                self.pending = Some(p);
                Ok(None)
            }
        }
    }

    fn continuation(&mut self, mut p: Pending, e: &Entry) -> Result<Option<Decoded>, MsgError> {
        p.entries += 1;
        let n = (p.data - p.filled).min(ENTRY_BYTES);
        zero(e, p.entries, n..ENTRY_BYTES)?;
        self.buf[p.filled..p.filled + n].copy_from_slice(&e[..n]);
        p.filled += n;
        if p.filled < p.data {
            self.pending = Some(p);
            return Ok(None);
        }
        self.pending = None;
        self.finish(p).map(Some)
    }

    fn finish(&self, p: Pending) -> Result<Decoded, MsgError> {
        let header = HeaderBytes::new(&self.buf[..p.header_len])
            .ok_or(MsgError::HeaderTooLong(p.header_len))?;
        Ok(match p.kind {
            Kind::Inline => {
                let payload = Bytes::copy_from_slice(&self.buf[p.header_len..p.data]);
                Decoded::Message(Message::new(header, payload))
            }
            _ => Decoded::InSlot {
                header,
                slot: SlotId::new(p.slot),
                offset: p.offset,
                len: p.payload_len,
            },
        })
    }
}

/// Checks that `e[range]` is all zero.
fn zero(e: &Entry, entry: u8, range: std::ops::Range<usize>) -> Result<(), MsgError> {
    let start = range.start;
    match e[range].iter().position(|b| *b != 0) {
        None => Ok(()),
        Some(i) => Err(MsgError::Reserved {
            entry,
            // Below 64.
            byte: (start + i) as u8,
        }),
    }
}

#[cfg(test)]
mod tests;
