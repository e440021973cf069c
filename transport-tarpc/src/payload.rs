//! [`Payload`]: bytes in a tarpc service's arguments or results that cross
//! [`MessageTransport`](crate::MessageTransport) without a copy.
//!
//! Two thread-local slots, each set only for the duration of one encode or decode by
//! [`crate::codec`] (and restored by a guard, even on a panic), let `Payload`'s serde impls
//! know they run inside this transport:
//! - encoding an item in the header form, the first `Payload` serialized is kept aside (it
//!   becomes the message's payload) and only an empty byte string stands in its place;
//! - decoding, the first `Payload` deserialized takes the message's payload when the item
//!   came in the header form; otherwise a `Payload`'s bytes are a slice of the received
//!   message (no copy).
//!
//! Outside this transport (tarpc's `serde_transport`, JSON, ...) a `Payload` is a plain byte
//! string, copied as `Vec<u8>` would be.

use bytes::Bytes;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::fmt;

/// Bytes that travel without a copy over [`MessageTransport`](crate::MessageTransport):
/// use it in a service's arguments and results where `Vec<u8>` or `Bytes` would be.
///
/// Sent, the first `Payload` of an item whose other fields fit in a transport header (64
/// bytes, which tarpc's envelope does) becomes the message's payload as it is, with no copy;
/// any other is written into the message. Received, every `Payload` is a slice of the message
/// it came in (`Bytes::slice_ref`), with no copy: it keeps that message's buffer (registered
/// memory on verbs) until dropped. Over other transports and formats it is a byte string.
/// The transport below still copies small messages where that is cheaper, by design: verbs
/// sends a payload of a few dozen bytes inline in the work request, and copies a small
/// received message out of its receive buffer (`payload_bytes_copied` counts both).
///
/// ```
/// use transport_tarpc::Payload;
/// let p = Payload::from(vec![1u8, 2, 3]);
/// assert_eq!(&p[..], &[1, 2, 3]);
/// let b: bytes::Bytes = p.into_bytes();
/// assert_eq!(b.len(), 3);
/// ```
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Payload(pub Bytes);

impl Payload {
    /// The bytes.
    pub fn into_bytes(self) -> Bytes {
        self.0
    }
}

impl fmt::Debug for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Payload({} bytes)", self.0.len())
    }
}

impl std::ops::Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl From<Bytes> for Payload {
    fn from(b: Bytes) -> Payload {
        Payload(b)
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Payload {
        Payload(Bytes::from(v))
    }
}

impl From<Payload> for Bytes {
    fn from(p: Payload) -> Bytes {
        p.0
    }
}

/// While encoding in the header form: `Some(None)` until the first `Payload` is kept aside,
/// then `Some(Some(it))`. `None` otherwise.
type Aside = Option<Option<Bytes>>;

/// While decoding a message: the bytes being decoded (when they are a `Bytes`, for slices of
/// them) and the message's payload, for the first `Payload` of an item in the header form.
#[derive(Default)]
struct Received {
    whole: Option<Bytes>,
    out_of_band: Option<Bytes>,
}

thread_local! {
    static ASIDE: RefCell<Aside> = const { RefCell::new(None) };
    static RECEIVED: RefCell<Option<Received>> = const { RefCell::new(None) };
}

/// Restores a thread-local slot's previous value when dropped.
struct Restore<T: 'static> {
    key: &'static std::thread::LocalKey<RefCell<T>>,
    previous: Option<T>,
}

impl<T> Drop for Restore<T> {
    fn drop(&mut self) {
        if let Some(p) = self.previous.take() {
            // `try_with`: nothing to restore while the thread itself is being torn down.
            let _ = self.key.try_with(|s| *s.borrow_mut() = p);
        }
    }
}

fn set<T>(key: &'static std::thread::LocalKey<RefCell<T>>, value: T) -> Restore<T> {
    let previous = key.with(|s| std::mem::replace(&mut *s.borrow_mut(), value));
    Restore {
        key,
        previous: Some(previous),
    }
}

/// Runs `encode` with the first `Payload` it serializes kept aside; returns what it returned
/// and that payload (`None`: it serialized none).
pub(crate) fn keeping_first_aside<R>(encode: impl FnOnce() -> R) -> (R, Option<Bytes>) {
    let _restore = set(&ASIDE, Some(None));
    let r = encode();
    let kept = ASIDE.with(|s| s.borrow_mut().take().flatten());
    (r, kept)
}

/// Runs `decode` over `whole` (the bytes it decodes, when they are a `Bytes`) with
/// `out_of_band` (the message's payload, for an item in the header form) for the first
/// `Payload`; returns what it returned and the out-of-band bytes no `Payload` took.
pub(crate) fn receiving<R>(
    whole: Option<Bytes>,
    out_of_band: Option<Bytes>,
    decode: impl FnOnce() -> R,
) -> (R, Option<Bytes>) {
    let _restore = set(&RECEIVED, Some(Received { whole, out_of_band }));
    let r = decode();
    let left = RECEIVED.with(|s| s.borrow_mut().take().and_then(|r| r.out_of_band));
    (r, left)
}

impl Serialize for Payload {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let aside = ASIDE.with(|slot| match &mut *slot.borrow_mut() {
            Some(first @ None) => {
                *first = Some(self.0.clone());
                true
            }
            _ => false,
        });
        s.serialize_bytes(if aside { &[] } else { &self.0 })
    }
}

impl<'de> Deserialize<'de> for Payload {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Payload, D::Error> {
        d.deserialize_bytes(PayloadVisitor)
    }
}

struct PayloadVisitor;

/// Within a decode of this transport: the out-of-band payload when one waits (its stand-in
/// must be empty), else a slice of the received bytes when `v` lies in them.
fn from_received<E: de::Error>(v: &[u8]) -> Result<Option<Payload>, E> {
    RECEIVED.with(|slot| {
        let mut slot = slot.borrow_mut();
        let Some(r) = slot.as_mut() else {
            return Ok(None);
        };
        if let Some(b) = r.out_of_band.take() {
            if !v.is_empty() {
                return Err(E::custom(format!(
                    "the stand-in of a payload sent apart holds {} bytes, not 0",
                    v.len()
                )));
            }
            return Ok(Some(Payload(b)));
        }
        Ok(r.whole.as_ref().and_then(|w| {
            let (whole, part) = (w.as_ptr_range(), v.as_ptr_range());
            let inside = whole.start <= part.start && part.end <= whole.end;
            (inside && !v.is_empty()).then(|| Payload(w.slice_ref(v)))
        }))
    })
}

impl<'de> Visitor<'de> for PayloadVisitor {
    type Value = Payload;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a byte string")
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Payload, E> {
        Ok(from_received(v)?.unwrap_or_else(|| Payload(Bytes::copy_from_slice(v))))
    }

    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Payload, E> {
        Ok(from_received(&v)?.unwrap_or_else(|| Payload(Bytes::from(v))))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Payload, A::Error> {
        // Formats that write bytes as a sequence (JSON): at most what the format says is
        // there, one element at a time, so a lying length allocates nothing.
        let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(b) = seq.next_element::<u8>()? {
            v.push(b);
        }
        Ok(Payload(Bytes::from(v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Two {
        id: u32,
        a: Payload,
        b: Payload,
    }

    /// `two()` encoded plainly: the id, then each payload as a length and its bytes.
    const PLAIN_LEN: usize = 1 + (1 + 100) + (1 + 5);

    fn two() -> Two {
        Two {
            id: 9,
            a: Payload::from(vec![1; 100]),
            b: Payload::from(vec![2; 5]),
        }
    }

    #[test]
    fn outside_the_transport_a_payload_is_a_byte_string() {
        let v = two();
        let enc = postcard::to_allocvec(&v).unwrap();
        // The id, then each payload as a length and its bytes.
        assert_eq!(enc.len(), PLAIN_LEN);
        assert_eq!(postcard::from_bytes::<Two>(&enc).unwrap(), v);
        let json = serde_json::to_string(&v.a).unwrap();
        assert_eq!(serde_json::from_str::<Payload>(&json).unwrap(), v.a);
    }

    #[test]
    fn the_first_payload_is_kept_aside_and_only_the_first() {
        let v = two();
        let (enc, kept) = keeping_first_aside(|| postcard::to_allocvec(&v).unwrap());
        assert_eq!(kept.as_deref(), Some(&[1u8; 100][..]));
        // id, an empty stand-in, then b inline.
        assert_eq!(enc, [&[9u8, 0, 5][..], &[2; 5]].concat());
        // Outside the closure nothing is kept aside any more.
        assert_eq!(postcard::to_allocvec(&v).unwrap().len(), PLAIN_LEN);
        let (back, left) = receiving(None, kept, || postcard::from_bytes::<Two>(&enc));
        assert_eq!(back.unwrap(), v);
        assert!(
            left.is_none(),
            "the first payload took the bytes sent apart"
        );
    }

    #[test]
    fn received_payloads_are_slices_of_the_message() {
        let v = two();
        let whole = Bytes::from(postcard::to_allocvec(&v).unwrap());
        let (back, left) = receiving(Some(whole.clone()), None, || {
            postcard::from_bytes::<Two>(&whole)
        });
        let back = back.unwrap();
        assert_eq!(back, v);
        assert!(left.is_none());
        let inside = |p: &Payload| whole.as_ptr_range().contains(&p.0.as_ptr());
        assert!(inside(&back.a) && inside(&back.b), "no copy");
    }

    #[test]
    fn a_stand_in_that_is_not_empty_is_a_decode_error() {
        let v = two();
        let plain = postcard::to_allocvec(&v).unwrap();
        let (r, left) = receiving(None, Some(Bytes::from_static(b"apart")), || {
            postcard::from_bytes::<Two>(&plain)
        });
        assert!(r.is_err(), "{r:?}");
        assert!(left.is_none());
    }

    #[test]
    fn the_slots_are_restored_after_a_panic() {
        let r = std::panic::catch_unwind(|| {
            keeping_first_aside(|| panic!("inside the encode"));
        });
        assert!(r.is_err());
        let v = two();
        assert_eq!(
            postcard::to_allocvec(&v).unwrap().len(),
            PLAIN_LEN,
            "nothing kept aside after the panic"
        );
        let r = std::panic::catch_unwind(|| {
            receiving(None, Some(Bytes::from_static(b"x")), || panic!("decode"));
        });
        assert!(r.is_err());
        let enc = postcard::to_allocvec(&v).unwrap();
        assert_eq!(postcard::from_bytes::<Two>(&enc).unwrap(), v);
    }
}
