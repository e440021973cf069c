//! What the C ABI costs (`bench scenario c-abi`): the C client (`csrc/c_ping.c`, the loop of
//! transport-ffi's `examples/c/ping.c`) against its Rust twin, the same calls in the same
//! shape: one call at a time, blocked on from the calling thread, which drives a
//! current-thread runtime with the spin-before-park hook (what `tp_runtime_new(0, ..)`
//! builds), the request written once in the connection's pool and sent without a copy. What
//! differs is the boundary: the C calls, the checks, the reply's box.
//!
//! The two run in turns, in the same process and on the same thread, against one server.

use bytes::BufMut;
use std::ffi::{c_char, c_int, c_long, CStr, CString};
use std::time::{Duration, Instant};
use transport_core::{Connection, MessageSender, Transport};
use transport_rpc::{CallOptions, ClientConfig, RpcClient};

// The C client calls the `tp_*` functions this crate exports: linked from its rlib.
use transport_ffi as _;

extern "C" {
    /// csrc/c_ping.c.
    fn bench_c_ping(
        uri: *const c_char,
        method: u32,
        size: usize,
        warmup: c_long,
        calls: c_long,
        us: *mut f64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// One client's run: `warmup` calls, then `calls` timed ones of `method` with `size` bytes,
/// each reply as long as the request.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    /// RPC method (an echo).
    pub method: u32,
    /// Request bytes.
    pub size: usize,
    /// Untimed calls first.
    pub warmup: u64,
    /// Timed calls.
    pub calls: u64,
}

/// The C client connects to `uri` and makes `run`'s calls; the timed calls' time.
pub fn c_client(uri: &str, run: Run) -> Result<Duration, String> {
    let c_uri = CString::new(uri).map_err(|_| format!("{uri}: a NUL byte in the URI"))?;
    let count = |n: u64| c_long::try_from(n).map_err(|_| format!("{n} calls are too many"));
    let (warmup, calls) = (count(run.warmup)?, count(run.calls)?);
    let mut us = 0.0;
    let mut err = [0 as c_char; 512];
    // SAFETY: `c_uri` is a NUL-terminated string and `us` and `err` are writable for their
    // sizes, all alive through the call; the C client keeps none of them after it returns.
    let rc = unsafe {
        bench_c_ping(
            c_uri.as_ptr(),
            run.method,
            run.size,
            warmup,
            calls,
            &mut us,
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if rc != 0 {
        // SAFETY: the C client wrote a NUL-terminated message into `err` (snprintf).
        let why = unsafe { CStr::from_ptr(err.as_ptr()) };
        return Err(format!("C client: {}", why.to_string_lossy()));
    }
    Ok(Duration::from_secs_f64(us.max(0.0) / 1e6))
}

/// The Rust twin: connects with `transport` to `addr` and makes `run`'s calls; the timed
/// calls' time.
pub fn rust_client<T: Transport>(
    transport: &T,
    addr: &T::Addr,
    run: Run,
) -> Result<Duration, String>
where
    <T::Connection as Connection>::Sender: MessageSender + Sync,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_park(transport_core::spin::park_hook(
            transport_core::spin::DEFAULT_BUDGET,
        ))
        .build()
        .map_err(|e| e.to_string())?;
    let deadline = Duration::from_secs(10);
    let conn = rt
        .block_on(async { tokio::time::timeout(deadline, transport.connect(addr)).await })
        .map_err(|_| format!("no connection to {addr} within 10 s"))?
        .map_err(|e| format!("connect to {addr}: {e}"))?;
    let client = {
        let _in_rt = rt.enter();
        RpcClient::new(conn, ClientConfig::default())
    };
    let payload = {
        let mut b = client.alloc(run.size);
        b.put_bytes(0, run.size);
        b.freeze()
    };
    let mut start = Instant::now();
    for i in 0..run.warmup + run.calls {
        if i == run.warmup {
            start = Instant::now();
        }
        let call = client.call_with(run.method, payload.clone(), CallOptions::deadline(deadline));
        let reply = rt
            .block_on(call)
            .map_err(|e| format!("Rust client: call: {e}"))?;
        if reply.len() != run.size {
            return Err("Rust client: a reply of the wrong length".into());
        }
    }
    let took = start.elapsed();
    rt.block_on(client.close())
        .map_err(|e| format!("Rust client: close: {e}"))?;
    Ok(took)
}

/// C against Rust over one transport, in rounds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CAbiRow {
    /// Transport name.
    pub transport: &'static str,
    /// Rounds run (each: both clients, in alternating order).
    pub rounds: usize,
    /// Small calls: request bytes.
    pub small_bytes: usize,
    /// Small calls: µs per call, median of the rounds: C, Rust.
    pub small_us: (f64, f64),
    /// Large calls: request bytes.
    pub large_bytes: usize,
    /// Large calls: MB/s of request payload, median of the rounds: C, Rust.
    pub large_mb_per_s: (f64, f64),
    /// C's time per call over Rust's, small and large (median of the rounds' ratios; 1.05
    /// is an ABI that costs 5%).
    pub c_over_rust: (f64, f64),
    /// The lowest and highest of the rounds' ratios, small and large: the spread (on tcp a
    /// 1 MiB echo's rate changes from one connection to the next, whichever the client).
    pub c_over_rust_range: ((f64, f64), (f64, f64)),
}

/// The median of `v` (NaN when empty).
fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Runs `rounds` rounds of `small` and `large` calls with both clients (C first in even
/// rounds, Rust first in odd ones) and sums them up. `c` and `rust` run one client's calls.
pub fn compare(
    transport: &'static str,
    rounds: usize,
    small: Run,
    large: Run,
    c: impl Fn(Run) -> Result<Duration, String>,
    rust: impl Fn(Run) -> Result<Duration, String>,
) -> Result<CAbiRow, String> {
    let per_call = |d: Duration, r: Run| d.as_secs_f64() / r.calls.max(1) as f64;
    let mut small_t = (Vec::new(), Vec::new());
    let mut large_t = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for (run, into) in [(small, &mut small_t), (large, &mut large_t)] {
            let (ct, rt) = if round % 2 == 0 {
                let ct = c(run)?;
                (ct, rust(run)?)
            } else {
                let rt = rust(run)?;
                (c(run)?, rt)
            };
            into.0.push(per_call(ct, run));
            into.1.push(per_call(rt, run));
        }
    }
    let ratios = |t: &(Vec<f64>, Vec<f64>)| -> Vec<f64> {
        t.0.iter().zip(&t.1).map(|(c, r)| c / r).collect()
    };
    let range = |v: Vec<f64>| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (lo, hi)
    };
    let mb_s = |secs: f64| large.size as f64 / secs / 1e6;
    Ok(CAbiRow {
        transport,
        rounds,
        small_bytes: small.size,
        small_us: (
            median(small_t.0.clone()) * 1e6,
            median(small_t.1.clone()) * 1e6,
        ),
        large_bytes: large.size,
        large_mb_per_s: (
            mb_s(median(large_t.0.clone())),
            mb_s(median(large_t.1.clone())),
        ),
        c_over_rust: (median(ratios(&small_t)), median(ratios(&large_t))),
        c_over_rust_range: (range(ratios(&small_t)), range(ratios(&large_t))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }

    #[test]
    fn compare_alternates_the_order_and_keeps_small_and_large_apart() {
        let order = std::cell::RefCell::new(Vec::new());
        let small = Run {
            method: 4,
            size: 0,
            warmup: 1,
            calls: 10,
        };
        let large = Run {
            size: 1 << 20,
            calls: 2,
            ..small
        };
        // C takes 10% longer than Rust on small calls, 20% on large ones.
        let row = compare(
            "t",
            2,
            small,
            large,
            |r| {
                order.borrow_mut().push(('c', r.size));
                Ok(Duration::from_micros(if r.size == 0 { 110 } else { 2400 }))
            },
            |r| {
                order.borrow_mut().push(('r', r.size));
                Ok(Duration::from_micros(if r.size == 0 { 100 } else { 2000 }))
            },
        )
        .unwrap();
        assert_eq!(
            *order.borrow(),
            [
                ('c', 0),
                ('r', 0),
                ('c', 1 << 20),
                ('r', 1 << 20),
                ('r', 0),
                ('c', 0),
                ('r', 1 << 20),
                ('c', 1 << 20),
            ]
        );
        assert!((row.c_over_rust.0 - 1.1).abs() < 1e-9, "{row:?}");
        assert!((row.c_over_rust.1 - 1.2).abs() < 1e-9, "{row:?}");
        let (lo, hi) = row.c_over_rust_range.0;
        assert!(
            (lo - 1.1).abs() < 1e-9 && (hi - 1.1).abs() < 1e-9,
            "{row:?}"
        );
        assert!((row.small_us.0 - 11.0).abs() < 1e-9, "{row:?}");
        // 1 MiB in 1 ms per call (Rust): 1048.576 MB/s.
        assert!((row.large_mb_per_s.1 - 1048.576).abs() < 1e-6, "{row:?}");
    }

    #[test]
    fn a_failing_client_fails_the_comparison() {
        let run = Run {
            method: 4,
            size: 0,
            warmup: 0,
            calls: 1,
        };
        let e = compare(
            "t",
            1,
            run,
            run,
            |_| Err("C client: connect: refused".into()),
            |_| Ok(Duration::from_micros(1)),
        )
        .unwrap_err();
        assert!(e.contains("refused"), "{e}");
    }
}
