//! Two threads ping-pong one 64-byte entry through two rings in one shared region pair,
//! busy-polling: the floor under a shared-memory round trip on this machine.
//!
//! `cargo run --release -p transport-shm --example ring_pingpong [ROUND_TRIPS]` (default
//! 1 000 000); prints the round trips' mean and the best of ten slices, in ns.

use std::os::fd::AsFd;
use std::time::{Duration, Instant};
use transport_shm::region::Region;
use transport_shm::ring::{Consumer, Producer, RingLayout, ENTRY_BYTES};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: u64 = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(1_000_000);
    let layout = RingLayout::new(64)?;
    // One region per direction, each mapped twice, as two processes would.
    let (ping_w, ping_fd) = Region::create("ping", layout.bytes())?;
    let ping_r = Region::map(ping_fd.as_fd(), layout.bytes())?;
    let (pong_w, pong_fd) = Region::create("pong", layout.bytes())?;
    let pong_r = Region::map(pong_fd.as_fd(), layout.bytes())?;
    let (mut ping_tx, mut ping_rx) = (
        Producer::new(ping_w, layout)?,
        Consumer::new(ping_r, layout)?,
    );
    let (mut pong_tx, mut pong_rx) = (
        Producer::new(pong_w, layout)?,
        Consumer::new(pong_r, layout)?,
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    let echo = std::thread::spawn(move || {
        let mut done = 0;
        while done < n {
            if let Some(e) = ping_rx.try_pop().expect("ping ring") {
                while !pong_tx.try_push(&e).expect("pong ring") {}
                done += 1;
            } else if Instant::now() > deadline {
                panic!("echo stuck at {done}");
            }
        }
    });
    let slice = n / 10;
    let mut best = f64::MAX;
    let start = Instant::now();
    let mut slice_start = start;
    for i in 0..n {
        let e = [i as u8; ENTRY_BYTES];
        while !ping_tx.try_push(&e)? {}
        loop {
            if let Some(back) = pong_rx.try_pop()? {
                assert_eq!(back, e);
                break;
            }
            assert!(Instant::now() < deadline, "stuck at {i}");
        }
        if slice > 0 && (i + 1) % slice == 0 {
            best = best.min(slice_start.elapsed().as_nanos() as f64 / slice as f64);
            slice_start = Instant::now();
        }
    }
    let mean = start.elapsed().as_nanos() as f64 / n as f64;
    echo.join().expect("echo thread");
    println!("{n} round trips of {ENTRY_BYTES} B: mean {mean:.0} ns, best tenth {best:.0} ns");
    Ok(())
}
