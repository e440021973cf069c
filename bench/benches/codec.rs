//! Encode / decode cost of the stream frame prefix and the RPC header.

// criterion_group! generates an undocumented function.
#![allow(missing_docs)]

use bytes::{BufMut, BytesMut};
use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use tokio_util::codec::Decoder;
use transport_framed::frame::{encode_prefix, FrameDecoder, PREFIX_LEN};
use transport_rpc::{Kind, RpcHeader};

/// Decodes every whole frame in `buf`; returns how many.
fn decode_all(d: &mut FrameDecoder, buf: &mut BytesMut) -> usize {
    let mut n = 0;
    while let Ok(Some(m)) = d.decode(buf) {
        black_box(&m);
        n += 1;
    }
    n
}

fn frames(header: &[u8], payload: usize, n: usize) -> BytesMut {
    let mut b = BytesMut::with_capacity(n * (PREFIX_LEN + header.len() + payload));
    for _ in 0..n {
        b.put_slice(&encode_prefix(header.len(), payload));
        b.put_slice(header);
        b.put_bytes(0x5a, payload);
    }
    b
}

fn codec(c: &mut Criterion) {
    let h = RpcHeader::new(Kind::Request, 7, 123_456, 500_000);
    let wire = h.encode();
    c.bench_function("rpc_header/encode", |b| {
        b.iter(|| black_box(black_box(&h).encode()))
    });
    c.bench_function("rpc_header/decode", |b| {
        b.iter(|| RpcHeader::decode(black_box(&wire)).expect("valid"))
    });
    c.bench_function("frame/encode_prefix", |b| {
        b.iter(|| encode_prefix(black_box(24), black_box(500_000)))
    });

    let mut g = c.benchmark_group("frame/decode");
    for &(name, payload) in &[("rpc_ping_64x", 0usize), ("64KB_64x", 64 << 10)] {
        let input = frames(&wire, payload, 64);
        g.throughput(Throughput::Elements(64));
        g.bench_function(name, |b| {
            b.iter_batched(
                || (FrameDecoder::new(1 << 20), input.clone()),
                |(mut d, mut buf)| {
                    let n = decode_all(&mut d, &mut buf);
                    assert_eq!(n, 64);
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, codec);
criterion_main!(benches);
