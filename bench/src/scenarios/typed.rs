//! Typed payloads: the marshalling half of the classic middleware benchmarks.
//!
//! The byte-sequence runs measure the transport; these add the cost of turning values into bytes
//! and back, the way an application using serde would pay it. Payloads are encoded with
//! [`postcard`]: a compact, documented and stable binary format for serde (varint integers,
//! length-prefixed strings and sequences), maintained and widely used, with no schema step.
//! (bincode, the other common choice, stopped being developed in 2025.)
//!
//! The element types are those of the Ice / omniORB / RMI comparisons:
//! - sequences of strings (10 characters each);
//! - sequences of `struct { string, f64 }` ([`StringDouble`]);
//! - sequences of `struct { i64, i64, f64 }` ([`Fixed`]);
//! - a structured request of about 2.2 KB ([`Structured`]), measured in calls/s.

use bytes::Bytes;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// A `struct { string, double }` element.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StringDouble {
    /// A 10-character string.
    pub s: String,
    /// A double.
    pub d: f64,
}

/// A `struct { long, long, double }` element.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Fixed {
    /// First integer.
    pub a: i64,
    /// Second integer.
    pub b: i64,
    /// A double.
    pub d: f64,
}

/// One line of a [`Structured`] request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Item name.
    pub name: String,
    /// Quantity.
    pub quantity: i64,
    /// Unit price.
    pub price: f64,
    /// Free-form tags.
    pub tags: Vec<String>,
}

/// A structured request of about 2.2 KB encoded: a few records and a string array, like the
/// "complex request" of the middleware comparisons.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Structured {
    /// Caller identity.
    pub user: String,
    /// Request time stamp (ns).
    pub timestamp: i64,
    /// The records.
    pub records: Vec<Record>,
    /// Notes.
    pub notes: Vec<String>,
}

/// A value type the typed scenarios can send in sequences.
pub trait Element:
    Serialize + DeserializeOwned + Clone + PartialEq + Send + Sync + 'static
{
    /// Short name used in tables and JSON.
    const NAME: &'static str;
    /// The `i`-th element of a generated sequence (deterministic).
    fn make(i: usize) -> Self;
}

fn ten_chars(i: usize) -> String {
    format!("s{:09}", i % 1_000_000_000)
}

impl Element for String {
    const NAME: &'static str = "string";
    fn make(i: usize) -> Self {
        ten_chars(i)
    }
}

impl Element for StringDouble {
    const NAME: &'static str = "string+f64";
    fn make(i: usize) -> Self {
        StringDouble {
            s: ten_chars(i),
            d: i as f64 * 0.5,
        }
    }
}

impl Element for Fixed {
    const NAME: &'static str = "i64+i64+f64";
    fn make(i: usize) -> Self {
        Fixed {
            a: i as i64 * 1_000_003,
            b: -(i as i64) * 7_919,
            d: i as f64 / 3.0,
        }
    }
}

/// A sequence of `n` generated elements.
pub fn sequence<E: Element>(n: usize) -> Vec<E> {
    (0..n).map(E::make).collect()
}

/// How many elements of `E` encode to about `bytes` bytes (at least 1).
pub fn elements_for<E: Element>(bytes: usize) -> usize {
    let probe = sequence::<E>(64);
    let per = (encode(&probe).len() as f64 / 64.0).max(1.0);
    ((bytes as f64 / per).round() as usize).max(1)
}

/// Encodes a value. Infallible for the types here (postcard only fails on unsupported serde
/// features or a full fixed buffer).
pub fn encode<T: Serialize>(value: &T) -> Bytes {
    Bytes::from(postcard::to_allocvec(value).expect("postcard encodes plain data"))
}

/// Decodes a value; a malformed payload is an error, not a panic.
pub fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, postcard::Error> {
    postcard::from_bytes(payload)
}

/// The ~2.2 KB structured request.
pub fn structured() -> Structured {
    Structured {
        user: "bench-client@example.org".into(),
        timestamp: 1_764_547_200_000_000_000,
        records: (0..12)
            .map(|i| Record {
                name: format!("item-{i:04}-{}", "x".repeat(40)),
                quantity: i * 17,
                price: 9.99 + i as f64,
                tags: (0..5).map(|t| format!("tag-{i}-{t}-abcdefgh")).collect(),
            })
            .collect(),
        notes: (0..10)
            .map(|i| format!("note {i}: {}", "lorem ipsum ".repeat(3)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<E: Element + std::fmt::Debug>() {
        let v = sequence::<E>(100);
        let back: Vec<E> = decode(&encode(&v)).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn sequences_round_trip() {
        round_trip::<String>();
        round_trip::<StringDouble>();
        round_trip::<Fixed>();
    }

    #[test]
    fn element_counts_hit_the_byte_target() {
        for target in [1_000, 64 << 10, 500_000] {
            let n = elements_for::<StringDouble>(target);
            let len = encode(&sequence::<StringDouble>(n)).len();
            assert!(
                (len as f64 - target as f64).abs() / (target as f64) < 0.1,
                "{n} elements encode to {len} bytes, target {target}"
            );
        }
        assert_eq!(elements_for::<Fixed>(1), 1);
    }

    #[test]
    fn structured_request_is_about_2_2_kb() {
        let s = structured();
        let len = encode(&s).len();
        assert!((2_000..=2_400).contains(&len), "{len} bytes");
        assert_eq!(decode::<Structured>(&encode(&s)).unwrap(), s);
    }

    #[test]
    fn garbage_decodes_to_an_error() {
        assert!(decode::<Vec<StringDouble>>(&[0xff, 0xff, 0xff, 0xff, 0xff, 0x0f]).is_err());
        assert!(decode::<Structured>(b"").is_err());
    }
}
