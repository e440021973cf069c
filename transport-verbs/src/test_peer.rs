//! A raw verbs peer for tests (feature `test-peer`): it connects through rdma_cm like a
//! `VerbsTransport` client but speaks the wire format by hand, so a test can break
//! every rule of the protocol and try every memory access a hostile peer could.
//!
//! ```no_run
//! # async fn demo(addr: std::net::SocketAddr) -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use transport_verbs::test_peer::{wire, RawPeer};
//!
//! let mut peer = RawPeer::connect(addr, Default::default()).await?;
//! peer.send(&[peer.hello(), wire::rts(1, u64::MAX, 0x1000, 7)])?;
//! let reply = peer.recv(Duration::from_secs(5)).await?; // the server's HELLO
//! # let _ = reply; Ok(()) }
//! ```
//!
//! The peer polls its completion queue in a loop with a short pause (it is a test tool, not
//! a data path); every wait has a time limit.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use sideway::rdmacm::communication_manager::Identifier;
use transport_core::{Metrics, TransportError};

use crate::cm::Established;
use crate::config::VerbsConfig;
use crate::error::{VerbsError, WcStatus};
use crate::ffi::{Completion, Endpoint, ReadSpec, SqLocal};
use crate::pool::{Pool, PoolBuf};

/// Builders of raw protocol messages (see the crate docs for the layout), on the crate's own
/// encoder and decoder.
pub mod wire {
    use crate::proto::{Kind, Th, VERSION};
    use transport_core::HeaderBytes;

    /// The protocol version this crate speaks.
    pub const PROTOCOL_VERSION: u64 = VERSION;

    /// A valid HELLO: receive queue `depth` buffers of `buf_size` bytes, `depth - 1` credits,
    /// rendezvous limits of `count` transfers and `kib` KiB, one RDMA READ served at a time.
    pub fn hello(depth: u32, buf_size: u64, count: u32, kib: u32) -> Vec<u8> {
        let th = Th {
            credits: depth.saturating_sub(1).min(u16::MAX as u32) as u16,
            ..Th::hello(depth, buf_size, count, kib, 1)
        };
        encode(th, &[], &[])
    }

    /// An eager message carrying `payload`.
    pub fn eager(header: &[u8], payload: &[u8]) -> Vec<u8> {
        let th = Th {
            len: payload.len() as u64,
            ..Th::new(Kind::Eager)
        };
        encode(th, header, payload)
    }

    /// An RTS announcing `len` bytes at `addr` readable with `rkey`.
    pub fn rts(id: u32, len: u64, addr: u64, rkey: u32) -> Vec<u8> {
        let th = Th {
            id,
            len,
            addr,
            rkey,
            ..Th::new(Kind::Rts)
        };
        encode(th, &[], &[])
    }

    /// A FIN for rendezvous `id`, granting `credits`.
    pub fn fin(id: u32, credits: u16) -> Vec<u8> {
        let th = Th {
            id,
            credits,
            ..Th::new(Kind::Fin)
        };
        encode(th, &[], &[])
    }

    fn encode(th: Th, header: &[u8], payload: &[u8]) -> Vec<u8> {
        let h = HeaderBytes::new(header).unwrap_or(HeaderBytes::EMPTY);
        let mut out = vec![0u8; crate::proto::TH_LEN + h.len()];
        th.encode(&h, &mut out);
        out.extend_from_slice(payload);
        out
    }

    /// A received message, field by field.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Parsed {
        /// Kind byte (1 HELLO, 2 EAGER, 3 RTS, 4 FIN, 5 CREDIT, 6 CLOSE).
        pub kind: u8,
        /// Credits granted.
        pub credits: u16,
        /// Rendezvous id (HELLO: queue depth).
        pub id: u32,
        /// Payload length (HELLO: buffer size).
        pub len: u64,
        /// Address (HELLO: version).
        pub addr: u64,
        /// Remote key (HELLO: rendezvous count).
        pub rkey: u32,
        /// HELLO: rendezvous KiB.
        pub aux: u32,
        /// The message header.
        pub header: Vec<u8>,
        /// The eager payload.
        pub payload: Vec<u8>,
    }

    /// Decodes a received message with the crate's decoder; `None` if it is malformed.
    pub fn parse(m: &[u8]) -> Option<Parsed> {
        let (th, header, off) = Th::decode(m).ok()?;
        Some(Parsed {
            kind: th.kind as u8,
            credits: th.credits,
            id: th.id,
            len: th.len,
            addr: th.addr,
            rkey: th.rkey,
            aux: th.aux,
            header: header.as_slice().to_vec(),
            payload: m[off..].to_vec(),
        })
    }
}

/// A connected queue pair driven by hand (see the module docs).
pub struct RawPeer {
    // The endpoint goes before the memory it may touch (targets, pool).
    ep: Endpoint<PoolBuf>,
    targets: HashMap<u64, Arc<PoolBuf>>,
    pool: Pool,
    _id: Arc<Identifier>,
    cfg: VerbsConfig,
    received: VecDeque<Vec<u8>>,
    reads: HashMap<u64, Result<(), WcStatus>>,
    send_error: Option<WcStatus>,
    next_tag: u64,
    comps: Vec<Completion<PoolBuf>>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for RawPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawPeer").finish_non_exhaustive()
    }
}

fn timeout(what: &'static str, after: Duration) -> TransportError {
    VerbsError::Timeout { what, after }.into()
}

impl RawPeer {
    /// Connects to a verbs listener at `addr`, with `cfg`'s queue sizes; nothing is sent.
    pub async fn connect(addr: SocketAddr, cfg: VerbsConfig) -> Result<RawPeer, TransportError> {
        let cfg_arc = Arc::new(cfg);
        // Its own event channel (held by its identifier), like a separate process.
        let domains = Arc::default();
        let ch = crate::cm::CmChannel::default().get(&domains)?;
        let Established { res, id, .. } =
            crate::cm::connect(ch, domains, cfg_arc, addr, crate::cm::RecvMode::Own).await?;
        Ok(RawPeer {
            // What the connection uses (the device's paths applied: its receive depth).
            cfg: (*res.cfg).clone(),
            ep: res.ep,
            targets: HashMap::new(),
            pool: res.pool,
            _id: id,
            received: VecDeque::new(),
            reads: HashMap::new(),
            send_error: None,
            next_tag: 0,
            comps: Vec::new(),
            metrics: res.metrics,
        })
    }

    /// A valid HELLO for this peer's configuration.
    pub fn hello(&self) -> Vec<u8> {
        wire::hello(
            self.cfg.recv_depth as u32,
            self.cfg.recv_buf_size() as u64,
            self.cfg.max_rendezvous_in as u32,
            (self.cfg.max_rendezvous_in_bytes / 1024) as u32,
        )
    }

    /// Sends `msgs` (raw bytes each), one doorbell. Credits are not checked: that is the point.
    pub fn send(&mut self, msgs: &[Vec<u8>]) -> Result<(), TransportError> {
        for m in msgs {
            if self.ep.sq_room() == 0 {
                // Staged requests hold room until they are posted and complete.
                self.ep.ring()?;
            }
            while self.ep.sq_room() == 0 {
                self.poll()?;
            }
            let mut buf = self.pool.get_for(m.len().max(1))?;
            buf.as_mut_slice()[..m.len()].copy_from_slice(m);
            self.ep.stage_send(SqLocal::Buf { buf, len: m.len() });
        }
        self.ep.ring()?;
        Ok(())
    }

    /// A payload of `len` bytes (`fill` each) in registered memory this peer can expose.
    pub fn payload(&self, len: usize, fill: u8) -> Result<Bytes, TransportError> {
        let mut buf = self.pool.get_for(len)?;
        buf.as_mut_slice()[..len].fill(fill);
        Ok(Bytes::from_owner(buf).slice(0..len))
    }

    /// Exposes `payload` (from [`RawPeer::payload`]) for reading as rendezvous `id` through a
    /// memory window; returns (address, rkey) for an RTS. Staged: posted by the next
    /// [`RawPeer::send`].
    pub fn expose(&mut self, id: u32, payload: &Bytes) -> Result<(u64, u32), TransportError> {
        let held = self.pool.register(payload)?;
        self.ep
            .stage_expose(id, held)
            .map_err(|e| VerbsError::verbs("ibv_bind_mw", "raw peer", e).into())
    }

    /// The next received message (its receive buffer is re-posted), within `within`.
    pub async fn recv(&mut self, within: Duration) -> Result<Vec<u8>, TransportError> {
        let deadline = Instant::now() + within;
        loop {
            self.poll()?;
            if let Some(m) = self.received.pop_front() {
                return Ok(m);
            }
            if Instant::now() >= deadline {
                return Err(timeout("raw peer: no message", within));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// The next received message of `kind`, skipping others (CREDITs, ...), within `within`.
    pub async fn recv_kind(
        &mut self,
        kind: u8,
        within: Duration,
    ) -> Result<wire::Parsed, TransportError> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let m = self.recv(left).await?;
            if let Some(p) = wire::parse(&m).filter(|p| p.kind == kind) {
                return Ok(p);
            }
        }
    }

    /// RDMA READs `len` bytes at `addr` with `rkey`: the bytes, or the completion's status
    /// (a failed READ puts this peer's queue pair in the error state).
    pub async fn read(
        &mut self,
        addr: u64,
        rkey: u32,
        len: usize,
        within: Duration,
    ) -> Result<Result<Vec<u8>, WcStatus>, TransportError> {
        let tag = self.next_tag;
        self.next_tag += 1;
        let target = Arc::new(self.pool.get_for(len)?);
        self.targets.insert(tag, target.clone());
        while self.ep.sq_room() == 0 {
            self.poll()?;
        }
        self.ep
            .stage_read(ReadSpec {
                target,
                offset: 0,
                len,
                remote_addr: addr,
                rkey,
                tag,
            })
            .map_err(|e| VerbsError::verbs("RDMA READ", "raw peer", e))?;
        self.ep.ring()?;
        let deadline = Instant::now() + within;
        loop {
            self.poll()?;
            if let Some(st) = self.reads.remove(&tag) {
                let t = self.targets.remove(&tag).expect("target kept");
                return Ok(st.map(|()| t.as_slice()[..len].to_vec()));
            }
            if Instant::now() >= deadline {
                return Err(timeout("raw peer: READ did not complete", within));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// The status of the first failed send, if any.
    pub fn send_error(&mut self) -> Result<Option<WcStatus>, TransportError> {
        self.poll()?;
        Ok(self.send_error)
    }

    /// This peer's counters (registrations of its pool, ...).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    fn poll(&mut self) -> Result<(), TransportError> {
        let mut comps = std::mem::take(&mut self.comps);
        self.ep
            .poll(&mut comps)
            .map_err(|e| VerbsError::verbs("ibv_poll_cq", "raw peer", e))?;
        for c in comps.drain(..) {
            match c {
                Completion::Recv { buf, len, status } => {
                    if status.is_ok() {
                        self.received.push_back(buf.as_slice()[..len].to_vec());
                        let _ = self.ep.stage_recv(buf);
                    }
                }
                Completion::Read { tag, status, .. } => {
                    self.reads
                        .insert(tag, status.map_err(|e| WcStatus::from_raw(e.status)));
                }
                Completion::Sent { status, .. } => {
                    if let Err(e) = status {
                        self.send_error.get_or_insert(WcStatus::from_raw(e.status));
                    }
                }
            }
        }
        self.comps = comps;
        self.ep.ring()?;
        Ok(())
    }
}
