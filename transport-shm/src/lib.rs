//! A shared-memory transport for processes on one host: transport-core's traits over rings
//! and payload pools in memory both processes map, set up over a Unix socket.
//!
//! [`ShmTransport`] connects and listens by socket path ([`transport_uds::UdsAddr`]) as
//! transport-uds does (an owner-only socket file, peer credentials checked, the uids allowed),
//! then each side sends the other a sealed memfd holding what it writes; from then on messages
//! travel in shared memory, and the socket only carries doorbell bytes to a peer that sleeps
//! and tells, by closing, that the peer is gone. It passes transport-test's conformance suite.
//!
//! ```no_run
//! # async fn demo() -> Result<(), transport_core::TransportError> {
//! use bytes::Bytes;
//! use transport_core::{Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport};
//! use transport_shm::ShmTransport;
//!
//! let shm = ShmTransport::default();
//! let addr = "/tmp/app.shm".parse()?;
//! let mut listener = shm.listen(&addr).await?;
//! let (mut tx, _) = shm.connect(&addr).await?.split();
//! let (_, mut rx) = listener.accept().await?.split();
//! tx.send(Message::new(HeaderBytes::EMPTY, Bytes::from_static(b"ping"))).await?;
//! assert_eq!(&rx.recv().await?.unwrap().payload[..], b"ping");
//! # Ok(()) }
//! ```
//!
//! The layers, bottom-up, each a plain data structure but for the last three:
//! - [`region`]: a memfd its creator sizes and seals; the other side refuses one that could
//!   shrink under its mapping.
//! - [`ring`]: a single-producer single-consumer ring of 64-byte entries, with the sleep and
//!   wake protocol that loses no wake-up.
//! - [`msg`]: a message (a header of up to 64 bytes and a payload) as ring entries: inline up
//!   to a limit (a `void o()` request is one entry), else naming a slot of the sender's pool;
//!   the decoder checks every field the peer wrote.
//! - [`pool`]: the sender's payload slots, whose free list it keeps to itself; the receiver
//!   lends a slot's payload to the application as `Bytes` without a copy and returns the slot
//!   when the last view drops.
//! - [`side`]: one region per side, holding its data ring, its return ring and its pool.
//! - [`setup`]: the hello each side sends with its memfd (`SCM_RIGHTS`), checked against this
//!   side's [`setup::Limits`] before anything is mapped.
//! - [`connect`]: the listener (set-ups in the background, bounded in number and time) and
//!   the client, over transport-uds's checked sockets.
//! - [`conn`]: the connection and its halves (spinning, then sleeping on the socket), and
//!   [`transport`]: the [`transport_core::Transport`].
//!
//! What this version does not do yet: a payload travels in one slot (slots are sized by
//! [`conn::ShmConfig::max_message_size`]), the sender copies the payload into its slot once
//! (no buffer pool in shared memory for the application to write into), and slots go back
//! only as the receiving half runs (see [`conn`]).
//!
//! # The peer shares the memory
//!
//! The process on the other side can write any byte of a shared region at any time, including
//! while this side reads it. So every index the peer publishes is read once into a local,
//! checked against what this side knows, and only then used; an entry is copied out in one
//! pass and handed on as a copy, never read twice; nothing the peer writes can make this side
//! index outside the region, allocate, or loop. A check that fails is a typed error
//! ([`ring::RingError::Corrupt`], the *peer* variants of [`pool::PoolError`], the decoder's
//! [`msg::MsgError`]s), and it sticks: the ring, pool or decoder is not used again. Payload
//! bytes in the peer's pool are the one exception to "copied out once": they reach the
//! application without a copy, stay writable by the peer while held, and are never read by
//! this crate to decide anything ([`region::PeerBytes`]).
//!
//! # Example
//!
//! ```
//! use std::sync::atomic::AtomicU64;
//! use std::sync::Arc;
//! use transport_shm::ring::{Consumer, Producer, RingLayout, ENTRY_BYTES};
//!
//! let layout = RingLayout::new(8)?;
//! // In a process pair this is a mapping of the same memfd on both sides.
//! let region: Arc<[AtomicU64]> = (0..layout.words()).map(|_| AtomicU64::new(0)).collect();
//! let mut tx = Producer::new(region.clone(), layout)?;
//! let mut rx = Consumer::new(region, layout)?;
//! assert!(tx.try_push(&[7u8; ENTRY_BYTES])?);
//! assert_eq!(rx.try_pop()?, Some([7u8; ENTRY_BYTES]));
//! assert_eq!(rx.try_pop()?, None);
//! # Ok::<(), transport_shm::ring::RingError>(())
//! ```

pub mod conn;
pub mod connect;
pub mod msg;
pub mod pool;
pub mod region;
pub mod ring;
pub mod setup;
pub mod side;
pub mod transport;
mod wait;

pub use transport::{ShmTransport, ShmTransportListener};
