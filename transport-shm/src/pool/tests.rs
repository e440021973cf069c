use super::*;
use proptest::prelude::*;
use std::os::fd::AsFd;

fn words(layout: PoolLayout) -> Arc<[AtomicU64]> {
    (0..layout.bytes() / 8).map(|_| AtomicU64::new(0)).collect()
}

/// A writer and a reader of one pool across two mappings of one memfd, as two processes
/// would have it.
fn pair(slots: usize, slot_bytes: usize) -> (PoolWriter<Region>, PoolReader) {
    let layout = PoolLayout::new(slots, slot_bytes).unwrap();
    let (mine, fd) = Region::create("pool", layout.bytes()).unwrap();
    let theirs = Region::map(fd.as_fd(), layout.bytes()).unwrap();
    (
        PoolWriter::new(mine, layout).unwrap(),
        PoolReader::new(theirs, layout).unwrap(),
    )
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
        .collect()
}

#[test]
fn layouts_outside_the_limits_are_refused() {
    for bad in [0, 3, 6, 100] {
        assert_eq!(PoolLayout::new(bad, 64), Err(PoolError::BadSlotCount(bad)));
    }
    for bad in [0, 1, 32, 65, 100, 4097] {
        assert_eq!(PoolLayout::new(4, bad), Err(PoolError::BadSlotSize(bad)));
    }
    assert_eq!(
        PoolLayout::new(1 << 20, 2048),
        Err(PoolError::TooLarge {
            slots: 1 << 20,
            slot_bytes: 2048
        })
    );
    // Overflow of slots * slot_bytes is refused, not wrapped.
    let huge = 1usize << (usize::BITS - 1);
    assert!(matches!(
        PoolLayout::new(huge, 64),
        Err(PoolError::TooLarge { .. })
    ));
    let l = PoolLayout::new(1, 64).unwrap();
    assert_eq!((l.slots(), l.slot_bytes(), l.bytes()), (1, 64, 64));
    let l = PoolLayout::new(1 << 14, 1 << 16).unwrap();
    assert_eq!(l.bytes(), MAX_REGION_BYTES);
}

#[test]
fn a_region_smaller_than_the_pool_is_refused() {
    let layout = PoolLayout::new(4, 128).unwrap();
    let short: Arc<[AtomicU64]> = (0..63).map(|_| AtomicU64::new(0)).collect();
    assert_eq!(
        PoolWriter::new(short, layout).unwrap_err(),
        PoolError::RegionTooSmall {
            got: 504,
            need: 512
        }
    );
    let (r, _fd) = Region::create("short", 256).unwrap();
    assert_eq!(
        PoolReader::new(r, layout).unwrap_err(),
        PoolError::RegionTooSmall {
            got: 256,
            need: 512
        }
    );
}

#[test]
fn alloc_lends_every_slot_once_then_none_and_a_release_makes_one_usable_again() {
    let layout = PoolLayout::new(8, 64).unwrap();
    let mut tx = PoolWriter::new(words(layout), layout).unwrap();
    let mut got: Vec<u32> = std::iter::from_fn(|| tx.alloc()).map(SlotId::get).collect();
    assert_eq!(got.len(), 8);
    got.sort_unstable();
    assert_eq!(got, (0..8).collect::<Vec<_>>(), "each slot exactly once");
    assert_eq!((tx.available(), tx.lent()), (0, 8));
    assert_eq!(tx.alloc(), None);
    tx.release(SlotId::new(5)).unwrap();
    assert_eq!((tx.available(), tx.lent()), (1, 7));
    assert_eq!(tx.alloc(), Some(SlotId::new(5)));
    assert_eq!(tx.alloc(), None);
    // A slot released and lent again may be released again.
    tx.release(SlotId::new(5)).unwrap();
    tx.release(SlotId::new(0)).unwrap();
    assert_eq!(tx.failed(), None);
    assert_eq!(tx.available(), 2);
}

#[test]
fn a_bad_return_is_a_typed_error_that_sticks() {
    let layout = PoolLayout::new(4, 64).unwrap();
    /// Prepares the writer and gives the slot the peer returns.
    type Setup = dyn Fn(&mut PoolWriter<Arc<[AtomicU64]>>) -> SlotId;
    let cases: [(&Setup, PoolError); 4] = [
        (
            &|_| SlotId::new(4),
            PoolError::SlotOutOfRange { slot: 4, slots: 4 },
        ),
        (
            &|_| SlotId::new(u32::MAX),
            PoolError::SlotOutOfRange {
                slot: u32::MAX,
                slots: 4,
            },
        ),
        // Lent: 0 and 1. Slot 3 never was.
        (&|_| SlotId::new(3), PoolError::NeverLent(SlotId::new(3))),
        (
            &|tx| {
                tx.release(SlotId::new(1)).unwrap();
                SlotId::new(1)
            },
            PoolError::ReturnedTwice(SlotId::new(1)),
        ),
    ];
    for (bad, want) in cases {
        let mut tx = PoolWriter::new(words(layout), layout).unwrap();
        let (a, _b) = (tx.alloc().unwrap(), tx.alloc().unwrap());
        let slot = bad(&mut tx);
        assert_eq!(tx.release(slot), Err(want));
        // It sticks: a good return fails the same way, and nothing more is lent.
        assert_eq!(tx.release(a), Err(want));
        assert_eq!(tx.failed(), Some(want));
        assert_eq!(tx.alloc(), None);
        assert_eq!(tx.available(), 0);
    }
}

#[test]
fn this_sides_write_mistakes_are_typed_and_do_not_fail_the_pool() {
    let layout = PoolLayout::new(2, 64).unwrap();
    let mut tx = PoolWriter::new(words(layout), layout).unwrap();
    assert_eq!(
        tx.write(SlotId::new(0), b"x"),
        Err(PoolError::NotAllocated(SlotId::new(0)))
    );
    assert_eq!(
        tx.write(SlotId::new(9), b"x"),
        Err(PoolError::NotAllocated(SlotId::new(9)))
    );
    let s = tx.alloc().unwrap();
    assert_eq!(
        tx.write(s, &[0; 65]),
        Err(PoolError::TooLong {
            len: 65,
            slot_bytes: 64
        })
    );
    tx.write(s, &[1; 64]).unwrap();
    tx.release(s).unwrap();
    assert_eq!(tx.write(s, b"x"), Err(PoolError::NotAllocated(s)));
    assert_eq!(tx.failed(), None);
}

#[test]
fn payloads_of_every_boundary_length_cross_two_mappings_exactly() {
    let (mut tx, mut rx) = pair(4, 128);
    for (n, len) in [0usize, 1, 7, 8, 9, 63, 64, 65, 127, 128]
        .into_iter()
        .enumerate()
    {
        let s = tx.alloc().unwrap();
        // Leftovers of a longer payload in the slot must not show.
        tx.write(s, &[0xee; 128]).unwrap();
        let want = pattern(len, n as u8);
        tx.write(s, &want).unwrap();
        let got = rx.take(s, 0, len as u32).unwrap();
        assert_eq!(&got[..], &want[..], "length {len}");
        drop(got);
        let mut back = [SlotId::new(0); 2];
        assert_eq!(rx.pop_returns(&mut back), 1);
        assert_eq!(back[0], s);
        tx.release(s).unwrap();
    }
}

#[test]
fn a_bad_slot_or_length_from_the_peer_is_refused_before_any_range_and_sticks() {
    let cases = [
        (4, 0, PoolError::SlotOutOfRange { slot: 4, slots: 4 }),
        (
            u32::MAX,
            u32::MAX,
            PoolError::SlotOutOfRange {
                slot: u32::MAX,
                slots: 4,
            },
        ),
        (
            3,
            129,
            PoolError::LenTooLong {
                len: 129,
                slot_bytes: 128,
            },
        ),
        (
            0,
            u32::MAX,
            PoolError::LenTooLong {
                len: u32::MAX,
                slot_bytes: 128,
            },
        ),
    ];
    // A payload that starts inside the slot and ends past it (no sum may wrap).
    for (offset, len) in [(1, 128), (128, 1), (65, 64), (u32::MAX, 1)] {
        let want = PoolError::PastSlotEnd {
            offset,
            len,
            slot_bytes: 128,
        };
        let (_tx, mut rx) = pair(4, 128);
        assert_eq!(rx.take(SlotId::new(1), offset, len), Err(want));
        assert_eq!(rx.take(SlotId::new(0), 0, 1), Err(want), "sticks");
    }
    for (slot, len, want) in cases {
        let (_tx, mut rx) = pair(4, 128);
        assert_eq!(rx.take(SlotId::new(slot), 0, len), Err(want));
        assert_eq!(rx.take(SlotId::new(0), 0, 1), Err(want), "sticks");
        assert_eq!(rx.failed(), Some(want));
        assert_eq!(rx.held(), 0);
    }
    // The last byte of the last slot is in range.
    let (_tx, mut rx) = pair(4, 128);
    assert_eq!(rx.take(SlotId::new(3), 0, 128).unwrap().len(), 128);
}

#[test]
fn a_slot_may_be_held_several_times_but_never_more_payloads_than_slots() {
    // An application's send buffer sent twice before its first send came back: the same
    // slot, held twice, returned twice.
    let (_tx, mut rx) = pair(4, 64);
    let a = rx.take(SlotId::new(1), 0, 8).unwrap();
    let b = rx.take(SlotId::new(1), 8, 8).unwrap();
    let c = rx.take(SlotId::new(2), 0, 8).unwrap();
    // Queued for return but not popped: still counted until it is sent back.
    drop(rx.take(SlotId::new(1), 0, 8).unwrap());
    assert_eq!((rx.held(), rx.pending_returns()), (4, 1));
    let want = PoolError::TooManyHeld(SlotId::new(3));
    assert_eq!(rx.take(SlotId::new(3), 0, 8), Err(want));
    drop((a, b, c));
    assert_eq!(rx.take(SlotId::new(0), 0, 8), Err(want), "sticks");
}

#[test]
fn a_popped_return_makes_room_for_another_payload() {
    let (_tx, mut rx) = pair(2, 64);
    drop(rx.take(SlotId::new(1), 0, 8).unwrap());
    let _held = rx.take(SlotId::new(1), 0, 8).unwrap();
    let mut back = [SlotId::new(0); 2];
    assert_eq!(rx.pop_returns(&mut back), 1);
    assert_eq!(rx.held(), 1);
    assert_eq!(&rx.take(SlotId::new(0), 56, 8).unwrap()[..], &[0u8; 8][..]);
}

#[test]
fn a_slot_is_queued_for_return_only_when_the_last_view_is_dropped() {
    let (mut tx, mut rx) = pair(4, 64);
    let s = tx.alloc().unwrap();
    tx.write(s, b"hello, world").unwrap();
    let whole = rx.take(s, 0, 12).unwrap();
    let part = whole.slice(7..);
    let clone = whole.clone();
    let mut out = [SlotId::new(99); 4];
    drop(whole);
    assert_eq!(rx.pending_returns(), 0);
    drop(clone);
    assert_eq!(rx.pending_returns(), 0);
    assert_eq!(rx.pop_returns(&mut out), 0);
    assert_eq!(&part[..], b"world");
    assert_eq!(rx.held(), 1);
    // The last view goes on another thread (the application's): the slot is queued.
    std::thread::spawn(move || drop(part)).join().unwrap();
    assert_eq!(rx.pending_returns(), 1);
    assert_eq!(rx.held(), 1, "held until popped");
    assert_eq!(rx.pop_returns(&mut out), 1);
    assert_eq!(out[0], s);
    assert_eq!((rx.held(), rx.pending_returns()), (0, 0));
    // Popped: the peer may name the slot again.
    tx.release(s).unwrap();
    assert_eq!(tx.alloc(), Some(s));
    tx.write(s, b"again").unwrap();
    assert_eq!(&rx.take(s, 0, 5).unwrap()[..], b"again");
}

#[test]
fn the_return_hook_runs_once_per_slot_after_its_last_view_is_queued() {
    use std::sync::atomic::AtomicUsize;
    let (mut tx, mut rx) = pair(4, 64);
    let calls = Arc::new(AtomicUsize::new(0));
    let (counted, queue) = (calls.clone(), rx.returns());
    rx.on_return(Arc::new(move || {
        // The slot is in the queue by the time the hook runs.
        assert!(queue.pending() > 0);
        counted.fetch_add(1, Ordering::SeqCst);
    }));
    let (a, b) = (tx.alloc().unwrap(), tx.alloc().unwrap());
    tx.write(a, b"a").unwrap();
    tx.write(b, b"b").unwrap();
    let pa = rx.take(a, 0, 1).unwrap();
    let pb = rx.take(b, 0, 1).unwrap();
    let pa2 = pa.clone();
    drop(pa);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "a view of slot a is still held"
    );
    drop(pa2);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    std::thread::spawn(move || drop(pb)).join().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[test]
fn returns_come_out_in_drop_order_and_pop_takes_at_most_what_fits() {
    let (_tx, mut rx) = pair(8, 64);
    let views: Vec<Bytes> = (0..5)
        .map(|s| rx.take(SlotId::new(s), 0, 1).unwrap())
        .collect();
    for i in [3, 0, 4, 1, 2] {
        drop(views[i].clone());
    }
    drop(views.into_iter().rev().collect::<Vec<_>>());
    let mut out = [SlotId::new(99); 3];
    assert_eq!(rx.pop_returns(&mut out), 3);
    let mut rest = [SlotId::new(99); 3];
    assert_eq!(rx.pop_returns(&mut rest), 2);
    let all: Vec<u32> = out.iter().chain(&rest[..2]).map(|s| s.get()).collect();
    // Dropped in reverse of `take` order (the Vec was reversed, then dropped front first).
    assert_eq!(all, [4, 3, 2, 1, 0]);
    assert_eq!(rx.pop_returns(&mut rest), 0);
}

#[test]
fn a_view_keeps_the_mapping_alive_after_the_reader_and_writer_are_gone() {
    let (mut tx, mut rx) = pair(2, 64);
    let s = tx.alloc().unwrap();
    tx.write(s, b"still here").unwrap();
    let view = rx.take(s, 0, 10).unwrap();
    drop((tx, rx));
    assert_eq!(&view[..], b"still here");
    // The return queue outlives the reader too: dropping the view does not panic.
    drop(view);
}

#[derive(Debug, Clone)]
enum Op {
    Alloc,
    /// Return the `n`th lent slot (an honest peer).
    Return(usize),
    /// A peer returns any id.
    Bogus(u32),
}

proptest! {
    /// The writer against a model: honest returns always succeed and make the slot
    /// lendable again; a bogus return succeeds exactly when the model says the slot is
    /// lent, otherwise fails with the model's error, which then sticks.
    #[test]
    fn the_writer_matches_a_model_whatever_the_peer_returns(
        ops in proptest::collection::vec(prop_oneof![
            3 => Just(Op::Alloc),
            3 => any::<usize>().prop_map(Op::Return),
            1 => prop_oneof![0u32..10, any::<u32>()].prop_map(Op::Bogus),
        ], 1..100)
    ) {
        let layout = PoolLayout::new(8, 64).unwrap();
        let mut tx = PoolWriter::new(words(layout), layout).unwrap();
        let mut lent: Vec<u32> = Vec::new();
        let mut ever = [false; 8];
        let mut failed = None;
        for op in ops {
            match op {
                Op::Alloc => match tx.alloc() {
                    Some(s) => {
                        prop_assert!(failed.is_none());
                        prop_assert!(!lent.contains(&s.get()), "lent twice: {s}");
                        lent.push(s.get());
                        ever[s.get() as usize] = true;
                    }
                    None => prop_assert!(failed.is_some() || lent.len() == 8),
                },
                Op::Return(_) if lent.is_empty() => {}
                Op::Return(_) | Op::Bogus(_) => {
                    let slot = match op {
                        Op::Return(n) => lent[n % lent.len()],
                        Op::Bogus(id) => id,
                        Op::Alloc => unreachable!(),
                    };
                    let want = if let Some(e) = failed {
                        Err(e)
                    } else if slot >= 8 {
                        Err(PoolError::SlotOutOfRange { slot, slots: 8 })
                    } else if lent.contains(&slot) {
                        Ok(())
                    } else if ever[slot as usize] {
                        Err(PoolError::ReturnedTwice(SlotId::new(slot)))
                    } else {
                        Err(PoolError::NeverLent(SlotId::new(slot)))
                    };
                    prop_assert_eq!(tx.release(SlotId::new(slot)), want);
                    match want {
                        Ok(()) => lent.retain(|l| *l != slot),
                        Err(e) => failed = Some(e),
                    }
                }
            }
            prop_assert_eq!(tx.failed(), failed);
            prop_assert_eq!(tx.lent(), lent.len());
        }
    }
}
