//! One tarpc message to one transport message and back, with postcard, in one of two forms:
//! - the header form: an item whose encoding fits in a transport header (64 bytes) once its
//!   first [`Payload`](crate::Payload) is set apart goes in the header, and that payload is
//!   the message's payload as it is (no copy, no pool buffer);
//! - the plain form: an empty header, and the whole encoding written straight into a buffer
//!   of the transport's pool as the payload.
//!
//! Received, `Payload`s are slices of the message (no copy) in either form.

use crate::{payload, Error};
use serde::de::DeserializeOwned;
use serde::Serialize;
use transport_core::{BufferPool, HeaderBytes, Message, MAX_HEADER_LEN};

/// Encodes `item` as one message, in the header form when it fits, else in the plain form
/// into a buffer of `pool` of exactly its encoded size. Fails before anything is allocated
/// when the message would be larger than `max` (the peer's message limit).
pub(crate) fn encode<T: Serialize>(
    item: &T,
    pool: &dyn BufferPool,
    max: usize,
) -> Result<Message, Error> {
    let mut head = [0u8; MAX_HEADER_LEN];
    let (fits, apart) =
        payload::keeping_first_aside(|| postcard::to_slice(item, &mut head).map(|h| h.len()));
    if let Ok(n) = fits {
        let apart = apart.unwrap_or_default();
        let len = n + apart.len();
        if len > max {
            return Err(Error::TooLarge { len, max });
        }
        let header = HeaderBytes::new(&head[..n]).expect("written within MAX_HEADER_LEN");
        return Ok(Message::new(header, apart));
    }
    let len = postcard::experimental::serialized_size(item).map_err(Error::Encode)?;
    if len > max {
        return Err(Error::TooLarge { len, max });
    }
    let mut buf = pool.alloc(len);
    let capacity = buf.capacity();
    let slot = buf.fill(len).ok_or(Error::PoolTooSmall { len, capacity })?;
    let written = postcard::to_slice(item, slot).map_err(Error::Encode)?.len();
    debug_assert_eq!(written, len, "postcard's size pass and write pass agree");
    Ok(Message::new(HeaderBytes::EMPTY, buf.freeze()))
}

/// Decodes one message sent by [`encode`]: exactly one value in the header (header form) or
/// in the payload (plain form, an empty header); bytes after the value, or a payload in the
/// header form that no `Payload` takes, are refused.
pub(crate) fn decode<T: DeserializeOwned>(msg: &Message) -> Result<T, Error> {
    let header = msg.header.as_slice();
    let (decoded, left) = if header.is_empty() {
        payload::receiving(Some(msg.payload.clone()), None, || {
            postcard::take_from_bytes::<T>(&msg.payload)
        })
    } else {
        payload::receiving(None, Some(msg.payload.clone()), || {
            postcard::take_from_bytes::<T>(header)
        })
    };
    let (item, rest) = decoded.map_err(Error::Decode)?;
    let unused = rest.len() + left.map_or(0, |b| b.len());
    if unused > 0 {
        return Err(Error::TrailingBytes(unused));
    }
    Ok(item)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Payload;
    use bytes::Bytes;
    use serde::Deserialize;
    use transport_core::HeapPool;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Call {
        id: u64,
        name: String,
        body: Vec<u8>,
    }

    fn call() -> Call {
        Call {
            id: 7,
            name: "ping".into(),
            body: vec![1, 2, 3],
        }
    }

    /// Larger than a header: the plain form.
    fn big() -> Call {
        Call {
            body: vec![3; 200],
            ..call()
        }
    }

    #[test]
    fn a_small_value_travels_in_the_header_and_a_large_one_in_one_payload() {
        let msg = encode(&call(), &HeapPool, 1024).unwrap();
        assert_eq!(
            msg.header.as_slice(),
            postcard::to_allocvec(&call()).unwrap()
        );
        assert!(msg.payload.is_empty());
        assert_eq!(decode::<Call>(&msg).unwrap(), call());
        let msg = encode(&big(), &HeapPool, 1024).unwrap();
        assert!(msg.header.is_empty());
        assert_eq!(msg.payload, postcard::to_allocvec(&big()).unwrap());
        assert_eq!(decode::<Call>(&msg).unwrap(), big());
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Echo {
        id: u64,
        data: Payload,
    }

    #[test]
    fn a_payload_beside_a_small_envelope_is_sent_and_received_as_it_is() {
        let data = Bytes::from(vec![5u8; 1 << 20]);
        let item = Echo {
            id: 1,
            data: Payload(data.clone()),
        };
        let msg = encode(&item, &HeapPool, 2 << 20).unwrap();
        assert_eq!(msg.payload.as_ptr(), data.as_ptr(), "sent without a copy");
        assert_eq!(msg.header.len(), 2, "the id and an empty stand-in");
        let back = decode::<Echo>(&msg).unwrap();
        assert_eq!(back, item);
        assert_eq!(
            back.data.as_ptr(),
            msg.payload.as_ptr(),
            "received without a copy"
        );
        // Over the limit counts the payload set apart too.
        assert!(matches!(
            encode(&item, &HeapPool, 1 << 20),
            Err(Error::TooLarge { len, .. }) if len == (1 << 20) + 2
        ));
    }

    #[test]
    fn a_payload_in_the_plain_form_is_a_slice_of_the_message() {
        // An envelope over 64 bytes: the plain form, the payload written into the pool.
        let item = (vec![7u8; 80], Payload::from(vec![6u8; 4096]));
        let msg = encode(&item, &HeapPool, 1 << 20).unwrap();
        assert!(msg.header.is_empty());
        let back = decode::<(Vec<u8>, Payload)>(&msg).unwrap();
        assert_eq!(back, item);
        let whole = msg.payload.as_ptr_range();
        assert!(whole.contains(&back.1.as_ptr()), "received without a copy");
    }

    #[test]
    fn over_the_limit_is_refused_before_allocating() {
        let len = postcard::to_allocvec(&big()).unwrap().len();
        match encode(&big(), &HeapPool, len - 1) {
            Err(Error::TooLarge { len: l, max }) => assert_eq!((l, max), (len, len - 1)),
            other => panic!("expected TooLarge, got {other:?}"),
        }
        assert!(
            encode(&big(), &HeapPool, len).is_ok(),
            "exactly the limit fits"
        );
    }

    #[test]
    fn a_header_trailing_bytes_or_garbage_are_typed_errors() {
        let good = encode(&big(), &HeapPool, 1024).unwrap();
        // A header that is not an item, a header form with a payload no `Payload` takes, an
        // envelope followed by more bytes in the header.
        let with_header = Message::new(HeaderBytes::new(b"x").unwrap(), good.payload.clone());
        assert!(matches!(
            decode::<Call>(&with_header),
            Err(Error::Decode(_))
        ));
        let small = encode(&call(), &HeapPool, 1024).unwrap();
        let extra = Message::new(small.header, Bytes::from_static(b"abc"));
        assert!(matches!(
            decode::<Call>(&extra),
            Err(Error::TrailingBytes(3))
        ));
        let mut longer_head = small.header.as_slice().to_vec();
        longer_head.push(0);
        let longer_head = Message::new(HeaderBytes::new(&longer_head).unwrap(), Bytes::new());
        assert!(matches!(
            decode::<Call>(&longer_head),
            Err(Error::TrailingBytes(1))
        ));
        let mut longer = good.payload.to_vec();
        longer.extend_from_slice(b"zz");
        assert!(matches!(
            decode::<Call>(&Message::new(HeaderBytes::EMPTY, longer.into())),
            Err(Error::TrailingBytes(2))
        ));
        let cut = good.payload.slice(..good.payload.len() - 1);
        assert!(matches!(
            decode::<Call>(&Message::new(HeaderBytes::EMPTY, cut)),
            Err(Error::Decode(_))
        ));
        // A length prefix claiming far more than the message holds: an error, not an
        // allocation of that size.
        let huge = Bytes::from_static(&[7, 0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert!(matches!(
            decode::<Call>(&Message::new(HeaderBytes::EMPTY, huge)),
            Err(Error::Decode(_))
        ));
    }
}
