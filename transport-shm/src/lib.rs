//! A shared-memory transport for processes on one host (issue 47), built bottom-up.
//!
//! **In progress.** What exists is the part everything else stands on: [`region`], a memfd
//! that its creator sizes and seals and both processes map (the other side refuses one that
//! could shrink under it); [`ring`], a single-producer single-consumer ring of 64-byte
//! entries laid out in such a region, safe against the peer that shares it; [`setup`], the
//! hello each side sends over a Unix socket with its ring's memfd (`SCM_RIGHTS`), checked
//! against this side's limits before anything is mapped; [`msg`], how a message (a header of
//! up to 64 bytes and a payload) becomes ring entries (inline up to a limit, so that an RPC
//! `void o()` request is one entry; otherwise naming a slot of the sender's pool) and the
//! decoder that checks every field of what the peer sent; and [`pool`], the fixed-size payload
//! slots in the sender's region, whose free list the sender keeps to itself and whose
//! payloads the receiver hands out as `Bytes` without a copy, returning each slot when its
//! last view is dropped. All of these are plain data structures (no sockets or threads inside
//! but the set-up's). [`connect`] makes connections: a listener on transport-uds's socket (an
//! owner-only socket file, peer credentials checked) and a client, each running the set-up.
//! The pool's region in the hello, wake-ups and the `transport_core` traits come next; until
//! then this crate is not a transport, and no other crate uses it.
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

pub mod connect;
pub mod msg;
pub mod pool;
pub mod region;
pub mod ring;
pub mod setup;
pub mod side;
