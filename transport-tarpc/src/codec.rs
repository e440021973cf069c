//! One tarpc message to one transport message and back: postcard, straight into a buffer of
//! the transport's pool, with an empty transport header.

use crate::Error;
use serde::de::DeserializeOwned;
use serde::Serialize;
use transport_core::{BufferPool, HeaderBytes, Message};

/// Encodes `item` into a buffer of `pool` of exactly its encoded size, as the payload of a
/// message with an empty header. Fails before anything is allocated when the encoding is
/// larger than `max` (the peer's message limit).
pub(crate) fn encode<T: Serialize>(
    item: &T,
    pool: &dyn BufferPool,
    max: usize,
) -> Result<Message, Error> {
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

/// Decodes one message sent by [`encode`]: a header means the peer does not speak this
/// protocol, and the payload must be exactly one value (trailing bytes are refused).
pub(crate) fn decode<T: DeserializeOwned>(msg: &Message) -> Result<T, Error> {
    if !msg.header.is_empty() {
        return Err(Error::UnexpectedHeader(msg.header.len()));
    }
    let (item, rest) = postcard::take_from_bytes(&msg.payload).map_err(Error::Decode)?;
    if !rest.is_empty() {
        return Err(Error::TrailingBytes(rest.len()));
    }
    Ok(item)
}

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn a_value_round_trips_in_one_payload_with_no_header() {
        let msg = encode(&call(), &HeapPool, 1024).unwrap();
        assert!(msg.header.is_empty());
        assert_eq!(
            msg.payload.len(),
            postcard::to_allocvec(&call()).unwrap().len()
        );
        assert_eq!(decode::<Call>(&msg).unwrap(), call());
    }

    #[test]
    fn over_the_limit_is_refused_before_allocating() {
        let len = postcard::to_allocvec(&call()).unwrap().len();
        match encode(&call(), &HeapPool, len - 1) {
            Err(Error::TooLarge { len: l, max }) => assert_eq!((l, max), (len, len - 1)),
            other => panic!("expected TooLarge, got {other:?}"),
        }
        assert!(
            encode(&call(), &HeapPool, len).is_ok(),
            "exactly the limit fits"
        );
    }

    #[test]
    fn a_header_trailing_bytes_or_garbage_are_typed_errors() {
        let good = encode(&call(), &HeapPool, 1024).unwrap();
        let with_header = Message::new(HeaderBytes::new(b"x").unwrap(), good.payload.clone());
        assert!(matches!(
            decode::<Call>(&with_header),
            Err(Error::UnexpectedHeader(1))
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
