//! Property tests of the RPC header codec: arbitrary bytes never panic, whatever decodes
//! re-encodes to the same bytes, and every header round-trips.

use proptest::prelude::*;
use transport_rpc::{HeaderError, Kind, RpcHeader, RPC_HEADER_LEN};

proptest! {
    /// The RPC header decoder accepts arbitrary bytes without panicking, and whatever it accepts
    /// re-encodes to the same bytes.
    #[test]
    fn rpc_header_decode_is_total(bytes in prop::collection::vec(any::<u8>(), 0..40)) {
        match RpcHeader::decode(&bytes) {
            Ok(h) => prop_assert_eq!(&h.encode()[..], &bytes[..RPC_HEADER_LEN]),
            Err(HeaderError::Truncated(n)) => prop_assert!(n < RPC_HEADER_LEN),
            Err(_) => {}
        }
    }

    /// Every header round-trips.
    #[test]
    fn rpc_header_round_trips(
        kind in prop_oneof![Just(Kind::Request), Just(Kind::Response), Just(Kind::Oneway),
                            Just(Kind::Error), Just(Kind::Cancel)],
        method: u32, id: u64, len: u32,
    ) {
        let h = RpcHeader::new(kind, method, id, len as usize);
        prop_assert_eq!(RpcHeader::decode(&h.encode()), Ok(h));
    }
}
