//! The engine without a device: one unit test per rule a peer can break, and property tests
//! that drive it with an honest peer (two engines over a simulated wire: every message arrives
//! byte-exact and in order) and with a hostile one (arbitrary messages and completions: no
//! panic, no overflow, held memory within the configured bounds).

use super::*;

use super::hostile::{bound, cfg, encode, hello, Buf, HostileMsg, Step as Hostile, BUF, DEPTH};

type E = Engine<Bytes>;

/// An engine with these settings and metrics of its own, started at `now`.
fn engine_with(cfg: EngineConfig, now: Instant) -> E {
    E::new(cfg, Arc::new(Metrics::default()), now)
}

fn eager(payload: &[u8]) -> Buf {
    let mut th = Th::new(Kind::Eager);
    th.len = payload.len() as u64;
    encode(th, b"h", payload)
}

fn rts(id: u32, len: u64, addr: u64) -> Buf {
    let mut th = Th::new(Kind::Rts);
    th.id = id;
    th.len = len;
    th.addr = addr;
    th.rkey = 77;
    encode(th, b"r", &[])
}

/// The READs among the work the engine asks for now.
fn reads_of(e: &mut E) -> Vec<ReadChunk> {
    drain(e)
        .into_iter()
        .filter_map(|w| match w {
            Work::Read(r) => Some(r),
            _ => None,
        })
        .collect()
}

fn kind_of(w: &Work<Bytes>) -> &'static str {
    match w {
        Work::Control(th) => th.kind.name(),
        Work::Eager { .. } => "EAGER",
        Work::Rts { .. } => "RTS",
        Work::Unexpose { .. } => "UNEXPOSE",
        Work::Probe => "PROBE",
        Work::Read(_) => "READ",
    }
}

fn drain(e: &mut E) -> Vec<Work<Bytes>> {
    let mut v = Vec::new();
    while let Some(w) = e.poll_work() {
        v.push(w);
        assert!(v.len() < 10_000, "poll_work never ends");
    }
    v
}

/// An engine that has sent its HELLO and received the peer's (granting `DEPTH - 1` credits).
fn connected() -> (E, Instant) {
    let now = Instant::now();
    let mut e = engine_with(cfg(), now);
    let w = drain(&mut e);
    assert_eq!(w.iter().map(kind_of).collect::<Vec<_>>(), ["HELLO"]);
    e.on_recv(encode(hello(DEPTH as u16 - 1), &[], &[]))
        .expect("valid HELLO");
    (e, now)
}

fn violation(r: Result<Option<Buf>, VerbsError>) -> ProtocolViolation {
    match r {
        Err(VerbsError::Protocol(v)) => v,
        Err(other) => panic!("expected a protocol violation, got {other}"),
        Ok(_) => panic!("expected a protocol violation, the message was accepted"),
    }
}

// ---- One test per rule ------------------------------------------------------------------

#[test]
fn hello_is_sent_first_and_announces_our_limits() {
    let now = Instant::now();
    let mut e = engine_with(cfg(), now);
    let Some(Work::Control(th)) = e.poll_work() else {
        panic!("HELLO first")
    };
    assert_eq!(th.kind, Kind::Hello);
    assert_eq!(th.id, DEPTH);
    assert_eq!(th.len, BUF as u64);
    assert_eq!(th.addr & u64::from(u32::MAX), VERSION);
    assert_eq!(
        th.addr >> 32,
        4,
        "the READs this side serves: cfg().read_depth"
    );
    assert_eq!((th.rkey, th.aux), (4, 64));
    assert_eq!(th.credits as u32, DEPTH - 1);
    // Nothing else before the peer's HELLO, even with a message queued.
    e.send(OutMsg {
        header: HeaderBytes::EMPTY,
        len: 3,
        payload: Bytes::from_static(b"abc"),
    });
    assert!(e.poll_work().is_none());
}

#[test]
fn the_accepting_side_says_hello_only_after_the_peers() {
    let now = Instant::now();
    let passive = EngineConfig {
        speaks_first: false,
        ..cfg()
    };
    let mut e = engine_with(passive, now);
    assert!(
        drain(&mut e).is_empty(),
        "nothing goes out before the peer's HELLO"
    );
    e.on_recv(encode(hello(DEPTH as u16 - 1), &[], &[]))
        .expect("valid HELLO");
    let w = drain(&mut e);
    assert_eq!(w.iter().map(kind_of).collect::<Vec<_>>(), ["HELLO"]);
    // Without the peer's HELLO it still times out like the active side.
    let mut silent = engine_with(
        EngineConfig {
            speaks_first: false,
            ..cfg()
        },
        now,
    );
    assert!(silent
        .handle_timeout(now + Duration::from_secs(11))
        .is_err());
}

/// The kinds of work a step at `now` asks for (deadlines first, as the glue does).
fn step_at(e: &mut E, now: Instant) -> Vec<&'static str> {
    e.handle_timeout(now).expect("within the handshake timeout");
    drain(e).iter().map(kind_of).collect()
}

#[test]
fn on_iwarp_a_late_hello_is_probed_at_doubling_gaps_until_it_comes() {
    let now = Instant::now();
    let iwarp = EngineConfig {
        probe_hello: true,
        ..cfg()
    };
    let mut e = engine_with(iwarp, now);
    assert_eq!(step_at(&mut e, now), ["HELLO"]);
    let first = now + HELLO_PROBE_FIRST;
    assert_eq!(e.poll_timeout(), Some(first), "the first probe's time");
    assert!(step_at(&mut e, first - Duration::from_millis(1)).is_empty());
    assert_eq!(step_at(&mut e, first), ["PROBE"]);
    // The next one after twice the gap, then four times.
    let second = first + 2 * HELLO_PROBE_FIRST;
    assert_eq!(e.poll_timeout(), Some(second));
    assert!(step_at(&mut e, second - Duration::from_millis(1)).is_empty());
    assert_eq!(step_at(&mut e, second), ["PROBE"]);
    assert_eq!(e.poll_timeout(), Some(second + 4 * HELLO_PROBE_FIRST));
    // The HELLO ends the probing: no deadline is left.
    e.on_recv(encode(hello(DEPTH as u16 - 1), &[], &[]))
        .expect("valid HELLO");
    assert_eq!(e.poll_timeout(), None);
    assert!(step_at(&mut e, second + Duration::from_secs(5)).is_empty());
}

#[test]
fn no_probe_off_iwarp_or_from_the_accepting_side() {
    let now = Instant::now();
    let later = now + Duration::from_secs(5);
    let mut off_iwarp = engine_with(cfg(), now);
    assert_eq!(step_at(&mut off_iwarp, now), ["HELLO"]);
    assert_eq!(
        off_iwarp.poll_timeout(),
        Some(now + Duration::from_secs(10))
    );
    assert!(step_at(&mut off_iwarp, later).is_empty());
    let accepting = EngineConfig {
        probe_hello: true,
        speaks_first: false,
        ..cfg()
    };
    let mut e = engine_with(accepting, now);
    assert_eq!(e.poll_timeout(), Some(now + Duration::from_secs(10)));
    assert!(step_at(&mut e, later).is_empty());
}

#[test]
fn a_malformed_message_is_a_violation() {
    let (mut e, _) = connected();
    assert_eq!(
        violation(e.on_recv(Buf(vec![2; 10]))),
        ProtocolViolation::ShortMessage { len: 10 }
    );
    let (mut e, _) = connected();
    let mut b = eager(b"xyz");
    b.0[0] = 42;
    assert_eq!(violation(e.on_recv(b)), ProtocolViolation::UnknownKind(42));
    let (mut e, _) = connected();
    let mut b = eager(b"xyz");
    b.0[8] = 9; // announces 9 bytes, carries 3
    assert_eq!(
        violation(e.on_recv(b)),
        ProtocolViolation::EagerLength {
            announced: 9,
            carried: 3
        }
    );
}

#[test]
fn a_message_before_hello_is_a_violation() {
    let now = Instant::now();
    let mut e = engine_with(cfg(), now);
    assert_eq!(
        violation(e.on_recv(eager(b"early"))),
        ProtocolViolation::BeforeHello { kind: "EAGER" }
    );
}

#[test]
fn a_second_hello_is_a_violation() {
    let (mut e, _) = connected();
    assert_eq!(
        violation(e.on_recv(encode(hello(0), &[], &[]))),
        ProtocolViolation::DuplicateHello
    );
}

#[test]
fn hello_fields_are_checked() {
    let check = |edit: &dyn Fn(&mut Th), want: &dyn Fn(&ProtocolViolation) -> bool| {
        let now = Instant::now();
        let mut e = engine_with(cfg(), now);
        let mut th = hello(1);
        edit(&mut th);
        let v = violation(e.on_recv(encode(th, &[], &[])));
        assert!(want(&v), "{v:?}");
    };
    check(&|t| t.addr = 1, &|v| {
        matches!(
            v,
            ProtocolViolation::Version {
                got: 1,
                want: VERSION
            }
        )
    });
    // A version-2 peer (no READ depth announced) is refused by its version.
    check(&|t| t.addr = 2 | (4 << 32), &|v| {
        matches!(v, ProtocolViolation::Version { got: 2, .. })
    });
    // A peer that serves no READ, or more than a queue pair can.
    check(&|t| t.addr = VERSION, &|v| {
        matches!(v, ProtocolViolation::PeerReadDepth { reads: 0, .. })
    });
    check(&|t| t.addr = VERSION | (256 << 32), &|v| {
        matches!(v, ProtocolViolation::PeerReadDepth { reads: 256, .. })
    });
    // A tiny receive buffer would force every message into rendezvous.
    check(&|t| t.len = 64, &|v| {
        matches!(v, ProtocolViolation::PeerBufferSize { size: 64, .. })
    });
    check(&|t| t.len = u64::MAX, &|v| {
        matches!(v, ProtocolViolation::PeerBufferSize { .. })
    });
    check(&|t| t.id = 2, &|v| {
        matches!(v, ProtocolViolation::PeerDepth { depth: 2, .. })
    });
    check(&|t| t.id = u32::MAX, &|v| {
        matches!(v, ProtocolViolation::PeerDepth { .. })
    });
    check(&|t| t.rkey = 0, &|v| {
        matches!(v, ProtocolViolation::PeerRendezvousLimits { count: 0, .. })
    });
    check(&|t| t.aux = 0, &|v| {
        matches!(v, ProtocolViolation::PeerRendezvousLimits { kib: 0, .. })
    });
    // HELLO granting more than the peer's own depth.
    check(&|t| t.credits = DEPTH as u16 + 1, &|v| {
        matches!(v, ProtocolViolation::CreditOverflow { .. })
    });
}

#[test]
fn credits_beyond_the_peers_queue_are_a_violation_not_a_wrap() {
    let (mut e, _) = connected();
    // We hold DEPTH - 1 (or DEPTH) credits; one more grant of u16::MAX cannot fit.
    let mut th = Th::new(Kind::Credit);
    th.credits = u16::MAX;
    let v = violation(e.on_recv(encode(th, &[], &[])));
    assert!(
        matches!(
            v,
            ProtocolViolation::CreditOverflow {
                granted: u16::MAX,
                depth: DEPTH,
                ..
            }
        ),
        "{v:?}"
    );
    // Nothing was applied: the engine is failed and posts nothing more.
    assert!(e.poll_work().is_none());
}

#[test]
fn a_message_without_a_credit_is_a_violation() {
    let (mut e, _) = connected();
    // The peer holds DEPTH - 1 credits (our HELLO's grant); nothing we send returns more
    // here, because nothing is polled in between.
    for i in 0..DEPTH - 1 {
        e.on_recv(eager(&[i as u8; 8]))
            .unwrap_or_else(|v| panic!("message {i} had a credit: {v}"));
    }
    assert_eq!(
        violation(e.on_recv(eager(b"one too many"))),
        ProtocolViolation::NoCredit
    );
}

#[test]
fn credits_come_back_and_the_accounting_balances() {
    let (mut e, _) = connected();
    for i in 0..DEPTH - 1 {
        e.on_recv(eager(&[i as u8; 8])).expect("had a credit");
    }
    // Owed credits go back on their own (a CREDIT), and then the peer may send again.
    let w = drain(&mut e);
    assert_eq!(w.iter().map(kind_of).collect::<Vec<_>>(), ["CREDIT"]);
    let (_, peer, owed, withheld) = e.credit_state();
    assert_eq!(
        peer + owed + withheld,
        DEPTH,
        "every buffer is accounted for"
    );
    e.on_recv(eager(b"again")).expect("credit returned");
}

#[test]
fn a_wrapping_rendezvous_address_is_a_violation() {
    let (mut e, _) = connected();
    assert_eq!(
        violation(e.on_recv(rts(1, 8192, u64::MAX - 100))),
        ProtocolViolation::AddressWraps {
            addr: u64::MAX - 100,
            len: 8192
        }
    );
    assert!(drain(&mut e).is_empty(), "no READ was queued");
}

#[test]
fn a_huge_or_wrapping_rendezvous_length_is_refused_without_reading() {
    for len in [u64::MAX, u64::MAX - 1, (1 << 20) + 1, 1 << 44] {
        let (mut e, _) = connected();
        e.on_recv(rts(5, len, 0x1000)).expect("refused, not fatal");
        match e.poll_delivery() {
            Some(Delivery::TooLarge { len: l, max, .. }) => {
                assert_eq!(max, 1 << 20);
                assert!(l > max, "{l}");
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
        let w = drain(&mut e);
        let kinds: Vec<_> = w.iter().map(kind_of).collect();
        assert_eq!(kinds, ["FIN"], "len {len}: FIN without READ");
        assert_eq!(e.held_bytes(), 0, "nothing allocated for it");
    }
}

#[test]
fn an_empty_rendezvous_is_a_violation() {
    let (mut e, _) = connected();
    assert_eq!(
        violation(e.on_recv(rts(1, 0, 0x1000))),
        ProtocolViolation::EmptyRendezvous
    );
}

#[test]
fn a_duplicate_rendezvous_id_is_a_violation() {
    let (mut e, _) = connected();
    e.on_recv(rts(9, 8192, 0x1000)).expect("first");
    assert_eq!(
        violation(e.on_recv(rts(9, 8192, 0x9000))),
        ProtocolViolation::DuplicateRendezvous(9)
    );
}

#[test]
fn rendezvous_beyond_the_announced_count_is_a_violation() {
    let (mut e, _) = connected();
    for id in 0..4 {
        e.on_recv(rts(id, 4096, 0x10000 * (id as u64 + 1)))
            .expect("within 4");
    }
    let v = violation(e.on_recv(rts(4, 4096, 0x90000)));
    assert!(
        matches!(
            v,
            ProtocolViolation::RendezvousLimit {
                outstanding: 4,
                max_count: 4,
                ..
            }
        ),
        "{v:?}"
    );
}

#[test]
fn rendezvous_beyond_the_announced_bytes_is_a_violation_but_one_large_is_allowed() {
    let (mut e, _) = connected();
    // Nearly 1 MiB alone: allowed although above the 64 KiB budget.
    e.on_recv(rts(0, (1 << 20) - 16, 0x10_0000))
        .expect("one alone");
    let v = violation(e.on_recv(rts(1, 4096, 0x90_0000)));
    assert!(
        matches!(v, ProtocolViolation::RendezvousLimit { outstanding: 1, .. }),
        "{v:?}"
    );
    let (mut e, _) = connected();
    e.on_recv(rts(0, 40 << 10, 0x10_0000)).expect("40 KiB");
    let v = violation(e.on_recv(rts(1, 30 << 10, 0x90_0000)));
    assert!(
        matches!(v, ProtocolViolation::RendezvousLimit { max_bytes, .. } if max_bytes == 64 << 10),
        "{v:?}"
    );
}

#[test]
fn a_fin_for_nothing_outstanding_is_a_violation() {
    let (mut e, _) = connected();
    let mut th = Th::new(Kind::Fin);
    th.id = 3;
    assert_eq!(
        violation(e.on_recv(encode(th, &[], &[]))),
        ProtocolViolation::UnknownFin(3)
    );
}

#[test]
fn data_after_close_is_a_violation() {
    let (mut e, _) = connected();
    e.on_recv(encode(Th::new(Kind::Close), &[], &[]))
        .expect("close");
    assert!(matches!(e.poll_delivery(), Some(Delivery::End)));
    assert_eq!(
        violation(e.on_recv(eager(b"late"))),
        ProtocolViolation::AfterClose { kind: "EAGER" }
    );
}

#[test]
fn a_peer_that_never_says_hello_times_out() {
    let now = Instant::now();
    let mut e = engine_with(cfg(), now);
    assert_eq!(e.poll_timeout(), Some(now + Duration::from_secs(10)));
    e.handle_timeout(now + Duration::from_secs(9))
        .expect("not yet");
    match e.handle_timeout(now + Duration::from_secs(10)) {
        Err(VerbsError::Timeout { what, after }) => {
            assert!(what.contains("HELLO"), "{what}");
            assert_eq!(after, Duration::from_secs(10));
        }
        other => panic!("expected a handshake timeout, got {other:?}"),
    }
    // After the HELLO the handshake deadline is gone.
    let (e, _) = connected();
    assert_eq!(e.poll_timeout(), None);
}

/// Our application is behind and the peer spends its credits on data until it holds `left`:
/// returns what it held before.
fn behind_with_peer_at(e: &mut E, left: u32) -> u32 {
    e.set_backlog(cfg().backlog_max, 0);
    let (_, had, _, _) = e.credit_state();
    for i in 0..had - left {
        e.on_recv(eager(&[i as u8; 10])).expect("eager");
    }
    had
}

fn send_rendezvous(e: &mut E, len: usize) -> u32 {
    e.send(OutMsg {
        header: HeaderBytes::EMPTY,
        len,
        payload: Bytes::from(vec![1u8; len]),
    });
    let w = drain(e);
    match w.as_slice() {
        [Work::Rts { th, .. }] => th.id,
        other => panic!(
            "expected one RTS, got {:?}",
            other.iter().map(kind_of).collect::<Vec<_>>()
        ),
    }
}

#[test]
fn a_peer_that_never_sends_fin_times_out_and_pins_nothing_more() {
    let (mut e, now) = connected();
    let first = send_rendezvous(&mut e, 8192);
    // Armed by the RTS; the time is read once, after the step.
    assert!(e.needs_clock());
    assert_eq!(e.poll_timeout(), None, "not before the clock is read");
    e.clock(now);
    assert!(!e.needs_clock());
    assert_eq!(e.poll_timeout(), Some(now + Duration::from_secs(30)));
    // The sender side caps exposed payloads at the peer's announced count (4).
    for _ in 1..4 {
        send_rendezvous(&mut e, 8192);
    }
    e.send(OutMsg {
        header: HeaderBytes::EMPTY,
        len: 8192,
        payload: Bytes::from(vec![2u8; 8192]),
    });
    assert!(drain(&mut e).is_empty(), "the fifth waits");
    assert_eq!(e.rendezvous_counts().1, 4);
    // A FIN releases one (invalidation first) and lets the fifth go.
    let mut fin = Th::new(Kind::Fin);
    fin.id = first;
    let later = now + Duration::from_secs(20);
    e.on_recv(encode(fin, &[], &[])).expect("fin");
    let kinds: Vec<_> = drain(&mut e).iter().map(kind_of).collect();
    assert_eq!(kinds, ["UNEXPOSE", "RTS"]);
    // The deadline restarts at each FIN; without another, the connection fails.
    e.clock(later);
    assert_eq!(e.poll_timeout(), Some(later + Duration::from_secs(30)));
    match e.handle_timeout(later + Duration::from_secs(30)) {
        Err(VerbsError::Timeout { what, .. }) => assert!(what.contains("FIN"), "{what}"),
        other => panic!("expected a rendezvous timeout, got {other:?}"),
    }
}

#[test]
fn eager_traffic_never_needs_the_clock() {
    let (mut e, _) = connected();
    for i in 0..DEPTH - 1 {
        e.on_recv(eager(&[i as u8; 100])).expect("eager");
        e.send(OutMsg {
            header: HeaderBytes::EMPTY,
            len: 100,
            payload: Bytes::from(vec![i as u8; 100]),
        });
        drain(&mut e);
        assert!(!e.needs_clock(), "no deadline armed by eager messages");
    }
    assert_eq!(e.poll_timeout(), None);
}

#[test]
fn no_more_reads_in_flight_than_the_peer_serves() {
    // The window allows two READs; the peer's queue pair serves one at a time.
    let now = Instant::now();
    let mut e = engine_with(cfg(), now);
    drain(&mut e);
    let th = Th {
        credits: DEPTH as u16 - 1,
        ..Th::hello(DEPTH, BUF as u64, 4, 64, 1)
    };
    e.on_recv(encode(th, &[], &[])).expect("valid HELLO");
    for id in 0..2 {
        e.on_recv(rts(id, 8192, 0x10_0000 * (id as u64 + 1)))
            .expect("within limits");
    }
    let mut done = 0;
    while done < 4 {
        let reads = reads_of(&mut e);
        assert_eq!(reads.len(), 1, "one READ at a time (after {done} done)");
        e.on_read_done(reads[0].tag, reads[0].len);
        done += 1;
    }
    assert!(reads_of(&mut e).is_empty(), "four chunks of 4 KiB read");
}

#[test]
fn held_reads_wait_and_the_rest_of_the_work_goes_out() {
    let (mut e, _) = connected();
    e.on_recv(rts(0, 8192, 0x10_0000)).expect("within limits");
    e.set_reads_held(true);
    assert!(e.read_ready(), "a READ is there to post");
    e.send(OutMsg {
        header: HeaderBytes::EMPTY,
        len: 5,
        payload: Bytes::from_static(b"reply"),
    });
    let kinds: Vec<_> = drain(&mut e).iter().map(kind_of).collect();
    assert_eq!(kinds, ["EAGER"], "the message goes out, the READ waits");
    assert_eq!(e.held_bytes(), 0, "no target allocated for a held READ");
    assert!(e.read_ready(), "still there to post");
    e.set_reads_held(false);
    let reads = reads_of(&mut e);
    assert_eq!(reads.len(), 2, "window of two READs once let go");
    assert!(!e.read_ready(), "the window is full");
}

#[test]
fn a_rendezvous_target_is_allocated_only_when_its_read_is_posted() {
    let (mut e, _) = connected();
    // Four transfers of 8 KiB: READ window 2, chunk 4 KiB.
    for id in 0..4 {
        e.on_recv(rts(id, 8192, 0x10_0000 * (id as u64 + 1)))
            .expect("within limits");
    }
    assert_eq!(e.held_bytes(), 0, "nothing allocated on arrival");
    let reads = reads_of(&mut e);
    assert_eq!(reads.len(), 2, "window of two READs");
    assert_eq!(reads[0].alloc, Some(8192));
    assert_eq!(reads[1].alloc, None, "second chunk of the same transfer");
    assert_eq!(e.held_bytes(), 8192, "one target so far");
    assert_eq!(
        (reads[0].remote_addr, reads[1].remote_addr),
        (0x10_0000, 0x10_0000 + 4096)
    );
    e.on_read_done(reads[0].tag, 4096);
    e.on_read_done(reads[1].tag, 4096);
    let w = drain(&mut e);
    let kinds: Vec<_> = w.iter().map(kind_of).collect();
    assert_eq!(kinds, ["READ", "READ", "FIN"], "next transfer, then FIN");
    assert!(matches!(
        e.poll_delivery(),
        Some(Delivery::Rendezvous { len: 8192, .. })
    ));
}

#[test]
fn a_gone_receiver_reads_nothing_more_and_releases_every_target() {
    let (mut e, _) = connected();
    e.on_recv(rts(0, 8192, 0x10_0000)).expect("rts 0");
    e.on_recv(rts(1, 8192, 0x20_0000)).expect("rts 1");
    e.on_recv(eager(b"before")).expect("eager");
    // The first transfer starts (window of two READs), the second has not.
    let reads = reads_of(&mut e);
    assert_eq!(reads.len(), 2);
    assert!(reads.iter().all(|r| r.tag == reads[0].tag));
    e.receiver_gone();
    // The unstarted transfer is acknowledged without a READ.
    let kinds: Vec<_> = drain(&mut e).iter().map(kind_of).collect();
    assert_eq!(kinds, ["FIN"]);
    assert!(e.poll_delivery().is_none(), "nothing queued for nobody");
    // The started one finishes; its target comes back (for the glue to drop) and FIN goes.
    e.on_read_done(reads[0].tag, 4096);
    e.on_read_done(reads[1].tag, 4096);
    match e.poll_delivery() {
        Some(Delivery::Rendezvous { tag, len: 8192, .. }) => assert_eq!(tag, reads[0].tag),
        other => panic!("expected the finished target back, got {other:?}"),
    }
    let kinds: Vec<_> = drain(&mut e).iter().map(kind_of).collect();
    assert_eq!(kinds, ["FIN"]);
    assert_eq!(e.held_bytes(), 0);
    assert_eq!(e.rendezvous_counts(), (0, 0));
}

#[test]
fn an_application_that_does_not_read_stops_credits_and_reads() {
    let (mut e, _) = connected();
    // The application holds 256 KiB (the budget) untaken.
    e.set_backlog(1, 256 << 10);
    e.on_recv(rts(0, 8192, 0x10_0000)).expect("rts");
    for i in 0..4 {
        e.on_recv(eager(&[i; 16])).expect("eager");
    }
    let w = drain(&mut e);
    assert!(
        w.is_empty(),
        "no READ, no CREDIT: {:?}",
        w.iter().map(kind_of).collect::<Vec<_>>()
    );
    let (_, _, owed, withheld) = e.credit_state();
    // One owed from the HELLO's buffer (below the CREDIT threshold), five withheld.
    assert_eq!((owed, withheld), (1, 5), "credits withheld");
    assert!(e.waiting_for_app());
    // The application catches up: READ and credits resume.
    e.set_backlog(0, 0);
    let kinds: Vec<_> = drain(&mut e).iter().map(kind_of).collect();
    assert_eq!(kinds, ["READ", "READ", "CREDIT"]);
}

#[test]
fn a_large_eager_payload_is_handed_over_and_a_small_one_copied() {
    let (mut e, _) = connected();
    let big = vec![7u8; 2000];
    assert!(e.on_recv(eager(&big)).expect("ok").is_none(), "kept");
    assert!(
        e.on_recv(eager(b"tiny")).expect("ok").is_some(),
        "re-posted"
    );
    match (e.poll_delivery(), e.poll_delivery()) {
        (Some(Delivery::Msg(a)), Some(Delivery::Msg(b))) => {
            assert_eq!(&a.payload[..], &big[..]);
            assert_eq!(&b.payload[..], b"tiny");
            assert_eq!(a.header.as_slice(), b"h");
        }
        other => panic!("{other:?}"),
    }
}

// ---- Property tests ---------------------------------------------------------------------

use proptest::prelude::*;

/// One side of the simulated connection: an engine, the memory it exposed, its READ targets.
struct Side {
    e: E,
    /// Messages the peer sent that are on the wire to this side, in order.
    inbox: VecDeque<Vec<u8>>,
    /// Receive buffers posted.
    posted: u32,
    /// Exposed payloads by rkey: (id, address, bytes).
    exposed: HashMap<u32, (u32, u64, Bytes)>,
    next_addr: u64,
    next_rkey: u32,
    /// READ targets by tag.
    targets: HashMap<u64, Vec<u8>>,
    /// READs posted and not yet completed, in order: (tag, len).
    reads: VecDeque<(u64, usize)>,
    /// Delivered and not yet taken by the application.
    app: VecDeque<(HeaderBytes, Bytes)>,
    app_bytes: u64,
    /// Everything taken, in order.
    taken: Vec<(HeaderBytes, Bytes)>,
    /// Sent by this side's application, in order.
    sent: Vec<(HeaderBytes, Bytes)>,
}

impl Side {
    fn new(now: Instant, c: EngineConfig) -> Side {
        Side {
            posted: c.recv_depth,
            e: engine_with(c, now),
            inbox: VecDeque::new(),
            exposed: HashMap::new(),
            next_addr: 0x1000_0000,
            next_rkey: 1,
            targets: HashMap::new(),
            reads: VecDeque::new(),
            app: VecDeque::new(),
            app_bytes: 0,
            taken: Vec::new(),
            sent: Vec::new(),
        }
    }
}

/// Posts everything `from` wants to post; SENDs go to `to.inbox`, READs read `to.exposed`.
fn pump(from: &mut Side, to: &mut Side) -> bool {
    let mut any = false;
    while let Some(w) = from.e.poll_work() {
        any = true;
        match w {
            Work::Control(th) => to.inbox.push_back(encode(th, &[], &[]).0),
            Work::Eager {
                th,
                header,
                payload,
            } => to
                .inbox
                .push_back(encode(th, header.as_slice(), &payload).0),
            Work::Rts {
                mut th,
                header,
                payload,
            } => {
                let rkey = from.next_rkey;
                from.next_rkey += 1;
                th.addr = from.next_addr;
                th.rkey = rkey;
                from.next_addr += payload.len() as u64 + 0x1000;
                from.exposed.insert(rkey, (th.id, th.addr, payload));
                to.inbox.push_back(encode(th, header.as_slice(), &[]).0);
            }
            // A zero-length READ: nothing moves.
            Work::Probe => {}
            Work::Unexpose { id } => {
                let before = from.exposed.len();
                from.exposed.retain(|_, (i, _, _)| *i != id);
                assert_eq!(from.exposed.len() + 1, before, "unexposed what was exposed");
            }
            Work::Read(r) => {
                if let Some(n) = r.alloc {
                    assert!(from.targets.insert(r.tag, vec![0; n]).is_none());
                }
                // An honest peer only ever reads what is exposed, inside its bounds.
                let (_, addr, bytes) = to.exposed.get(&r.rkey).expect("READ of an exposed payload");
                let off = (r.remote_addr - addr) as usize;
                let t = from.targets.get_mut(&r.tag).expect("target allocated");
                t[r.offset..r.offset + r.len].copy_from_slice(&bytes[off..off + r.len]);
                from.reads.push_back((r.tag, r.len));
            }
        }
    }
    any
}

/// Delivers the next message on the wire to `s`.
fn arrive(s: &mut Side) -> bool {
    let Some(m) = s.inbox.pop_front() else {
        return false;
    };
    assert!(
        s.posted > 0,
        "receiver not ready: a SEND without a posted buffer"
    );
    s.posted -= 1;
    s.e.on_recv(Buf(m)).expect("an honest peer breaks no rule");
    s.posted += 1; // re-posted, or a fresh one in its place
    collect(s);
    true
}

fn collect(s: &mut Side) {
    while let Some(d) = s.e.poll_delivery() {
        let (h, p) = match d {
            Delivery::Msg(m) => (m.header, m.payload),
            Delivery::Rendezvous { tag, header, len } => {
                let mut t = s
                    .targets
                    .remove(&tag)
                    .expect("target of a delivered transfer");
                t.truncate(len);
                (header, Bytes::from(t))
            }
            other => panic!("unexpected delivery {other:?}"),
        };
        s.app_bytes += p.len() as u64;
        s.app.push_back((h, p));
    }
    s.e.set_backlog(s.app.len(), s.app_bytes);
}

fn complete_read(s: &mut Side) -> bool {
    let Some((tag, len)) = s.reads.pop_front() else {
        return false;
    };
    s.e.on_read_done(tag, len);
    collect(s);
    true
}

fn take(s: &mut Side, n: usize) -> bool {
    let mut any = false;
    for _ in 0..n {
        let Some((h, p)) = s.app.pop_front() else {
            break;
        };
        s.app_bytes -= p.len() as u64;
        s.taken.push((h, p));
        any = true;
    }
    s.e.set_backlog(s.app.len(), s.app_bytes);
    any
}

#[derive(Debug, Clone)]
enum Step {
    Send { a: bool, len: usize, seed: u8 },
    Pump { a: bool },
    Arrive { a: bool },
    ReadDone { a: bool },
    Take { a: bool, n: usize },
}

fn step() -> impl Strategy<Value = Step> {
    let len = prop_oneof![
        4 => 0usize..200,
        3 => 200usize..5000,
        2 => 5000usize..70_000,
        1 => 70_000usize..300_000,
    ];
    prop_oneof![
        2 => (any::<bool>(), len, any::<u8>()).prop_map(|(a, len, seed)| Step::Send { a, len, seed }),
        3 => any::<bool>().prop_map(|a| Step::Pump { a }),
        4 => any::<bool>().prop_map(|a| Step::Arrive { a }),
        2 => any::<bool>().prop_map(|a| Step::ReadDone { a }),
        2 => (any::<bool>(), 0usize..8).prop_map(|(a, n)| Step::Take { a, n }),
    ]
}

fn payload(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect::<Vec<u8>>()
        .into()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Two honest engines over a simulated wire, in any interleaving of sends, posts,
    /// arrivals, READ completions and application reads: no violation, no receive without a
    /// posted buffer, no READ of unexposed memory, and in the end every message delivered
    /// byte-exact and in order, nothing left exposed, every credit accounted for.
    #[test]
    fn honest_peers_deliver_everything_in_order(steps in proptest::collection::vec(step(), 1..300)) {
        let now = Instant::now();
        let mut a = Side::new(now, cfg());
        let mut b = Side::new(now, cfg());
        for s in steps {
            let (x, y) = match &s {
                Step::Send { a: true, .. } | Step::Pump { a: true } | Step::Arrive { a: true }
                | Step::ReadDone { a: true } | Step::Take { a: true, .. } => (&mut a, &mut b),
                _ => (&mut b, &mut a),
            };
            match s {
                Step::Send { len, seed, .. } => {
                    let header = HeaderBytes::new(&[seed; 3]).expect("3 bytes");
                    let p = payload(len, seed);
                    x.sent.push((header, p.clone()));
                    x.e.send(OutMsg { header, len, payload: p });
                }
                Step::Pump { .. } => { pump(x, y); }
                Step::Arrive { .. } => { arrive(x); }
                Step::ReadDone { .. } => { complete_read(x); }
                Step::Take { n, .. } => { take(x, n); }
            }
            prop_assert!(a.e.held_bytes() <= bound(&cfg()));
            prop_assert!(b.e.held_bytes() <= bound(&cfg()));
        }
        quiesce(&mut a, &mut b);
        prop_assert_eq!(a.taken.len(), b.sent.len(), "everything B sent reached A");
        prop_assert_eq!(b.taken.len(), a.sent.len(), "everything A sent reached B");
        for (got, want) in a.taken.iter().zip(&b.sent) {
            prop_assert!(got == want, "byte-exact and in order");
        }
        for (got, want) in b.taken.iter().zip(&a.sent) {
            prop_assert!(got == want, "byte-exact and in order");
        }
        for s in [&a, &b] {
            prop_assert!(s.exposed.is_empty(), "every exposure revoked");
            prop_assert!(s.targets.is_empty(), "every target delivered");
            prop_assert_eq!(s.e.rendezvous_counts(), (0, 0));
            let (_, peer, owed, withheld) = s.e.credit_state();
            prop_assert_eq!(peer + owed + withheld, DEPTH, "every buffer accounted for");
            prop_assert_eq!(s.e.held_bytes(), 0);
        }
    }
}

/// Runs both sides until nothing moves, the applications reading everything.
fn quiesce(a: &mut Side, b: &mut Side) {
    let mut rounds = 0;
    loop {
        let mut any = false;
        any |= pump(a, b);
        any |= pump(b, a);
        while arrive(a) {
            any = true;
        }
        while arrive(b) {
            any = true;
        }
        while complete_read(a) {
            any = true;
        }
        while complete_read(b) {
            any = true;
        }
        any |= take(a, usize::MAX);
        any |= take(b, usize::MAX);
        if !any {
            break;
        }
        rounds += 1;
        assert!(rounds < 10_000, "no quiescence");
    }
}

#[test]
fn both_sides_sending_bursts_at_once_deliver_everything() {
    // Each side sends three queues' worth before anything arrives: both run out of credits
    // with credits owed, and must still get everything through.
    let now = Instant::now();
    let mut a = Side::new(now, cfg());
    let mut b = Side::new(now, cfg());
    quiesce(&mut a, &mut b); // HELLOs
    for (x, seed) in [(&mut a, 1u8), (&mut b, 2u8)] {
        for i in 0..3 * DEPTH as usize {
            let header = HeaderBytes::new(&[seed, i as u8]).expect("2 bytes");
            let p = payload(100 + i, seed);
            x.sent.push((header, p.clone()));
            x.e.send(OutMsg {
                header,
                len: p.len(),
                payload: p,
            });
        }
    }
    pump(&mut a, &mut b);
    pump(&mut b, &mut a);
    quiesce(&mut a, &mut b);
    assert_eq!(a.taken, b.sent, "everything B sent reached A, in order");
    assert_eq!(b.taken, a.sent, "everything A sent reached B, in order");
}

/// A message a hostile peer may send: any kind (or an unknown one), any numbers, biased toward
/// values near the limits so that the checks themselves are exercised.
fn hostile_msg() -> impl Strategy<Value = HostileMsg> {
    let num = prop_oneof![
        Just(0u64),
        Just(1u64),
        1u64..70_000,
        Just(64u64 << 10),
        Just(1u64 << 20),
        Just((1u64 << 20) + 1),
        Just(u64::MAX),
        Just(u64::MAX - 4096),
        any::<u64>(),
    ];
    let small = prop_oneof![
        Just(0u32),
        Just(1u32),
        1u32..16,
        Just(u32::MAX),
        any::<u32>()
    ];
    (
        0u8..8,
        prop_oneof![Just(0u16), 1u16..9, any::<u16>()],
        small.clone(),
        num.clone(),
        num,
        small.clone(),
        small,
        0u8..70,
        0u16..5000,
        any::<bool>(),
    )
        .prop_map(
            |(kind, credits, id, len, addr, rkey, aux, hlen, plen, honest_len)| HostileMsg {
                kind,
                credits,
                id,
                len,
                addr,
                rkey,
                aux,
                hlen,
                plen,
                honest_len,
            },
        )
}

fn hostile_step() -> impl Strategy<Value = Hostile> {
    prop_oneof![
        6 => hostile_msg().prop_map(Hostile::Msg),
        1 => proptest::collection::vec(any::<u8>(), 0..80).prop_map(Hostile::Raw),
        1 => Just(Hostile::Hello),
        3 => Just(Hostile::Pump),
        3 => Just(Hostile::ReadDone),
        1 => (0u8..10).prop_map(Hostile::Take),
        1 => (0u8..40).prop_map(Hostile::Wait),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Arbitrary peer messages, READ completions, application reads and time: the engine
    /// never panics or overflows (debug arithmetic checks), never holds more than the bound,
    /// never emits a READ outside an announced range, and once it reports an error it stays
    /// failed and posts nothing more (the driver in `hostile.rs`, shared with the fuzz target).
    #[test]
    fn a_hostile_peer_cannot_break_the_engine(steps in proptest::collection::vec(hostile_step(), 1..200)) {
        let r = super::hostile::run(&steps);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

#[test]
fn data_leaves_a_credit_for_a_fin_when_the_peer_withholds_the_rest() {
    // The peer grants DEPTH - 1 = 7 credits and withholds what our data takes.
    let (mut e, _) = connected();
    for i in 0..10u8 {
        e.send(OutMsg {
            header: HeaderBytes::EMPTY,
            len: 10,
            payload: Bytes::from(vec![i; 10]),
        });
    }
    let kinds: Vec<_> = drain(&mut e).iter().map(kind_of).collect();
    assert_eq!(kinds, ["EAGER"; 5], "data stops with two credits left");
    assert_eq!(e.credit_state().0, 2);
    // A rendezvous of the peer arrives and is read: its FIN still goes out.
    e.on_recv(rts(9, 4096, 0x10_0000)).expect("within limits");
    let reads = reads_of(&mut e);
    assert_eq!(reads.len(), 1);
    e.on_read_done(reads[0].tag, reads[0].len);
    let kinds: Vec<_> = drain(&mut e).iter().map(kind_of).collect();
    assert_eq!(kinds, ["FIN"], "the FIN takes the credit kept for it");
    assert_eq!(
        e.credit_state().0,
        1,
        "the last is kept for a CREDIT or CLOSE"
    );
}

#[test]
fn a_fins_buffer_is_granted_back_at_once_while_data_credits_are_withheld() {
    let (mut e, _) = connected();
    // Two of our payloads are out by rendezvous; our application is behind.
    let first = send_rendezvous(&mut e, 8192);
    let second = send_rendezvous(&mut e, 8192);
    // The peer spends its credits on data down to one: withheld, except what it is lent for
    // the FINs we wait for (up to three: `lend_for_fins`).
    let peer_had = behind_with_peer_at(&mut e, 1);
    let work = drain(&mut e);
    assert_eq!(work.iter().map(kind_of).collect::<Vec<_>>(), ["CREDIT"]);
    match &work[0] {
        Work::Control(th) => assert_eq!(th.credits, 2, "lent up to three"),
        _ => unreachable!(),
    }
    let (_, peer_holds, owed, withheld) = e.credit_state();
    assert_eq!((peer_holds, owed, withheld), (3, 0, peer_had - 3));
    // Its first FIN leaves it two: the FIN's buffer is owed, nothing more is sent.
    let mut fin = Th::new(Kind::Fin);
    fin.id = first;
    e.on_recv(encode(fin, &[], &[])).expect("fin");
    assert_eq!(
        drain(&mut e).iter().map(kind_of).collect::<Vec<_>>(),
        ["UNEXPOSE"]
    );
    // Its second leaves it one: both FINs' buffers come back at once, by a CREDIT of ours.
    let mut fin = Th::new(Kind::Fin);
    fin.id = second;
    e.on_recv(encode(fin, &[], &[])).expect("second fin");
    let work = drain(&mut e);
    let kinds: Vec<_> = work.iter().map(kind_of).collect();
    assert_eq!(kinds, ["UNEXPOSE", "CREDIT"]);
    match &work[1] {
        Work::Control(th) => assert_eq!(th.credits, 2, "the two FINs' buffers"),
        _ => unreachable!(),
    }
    assert_eq!(
        e.credit_state().3,
        peer_had - 3,
        "data credits still withheld"
    );
    // A CREDIT from the peer is granted back too, but not by a CREDIT of ours (no ping-pong).
    e.on_recv(encode(Th::new(Kind::Credit), &[], &[]))
        .expect("credit");
    assert!(drain(&mut e).is_empty(), "a CREDIT is not answered");
    assert_eq!(
        e.credit_state().2,
        1,
        "its buffer is owed, to go with the next message"
    );
}

#[test]
fn a_peer_short_of_credits_for_a_fin_we_wait_for_is_lent_them() {
    // Found by `an_echo_server_answering_as_it_has_room_never_deadlocks`: the peer spent its
    // second-to-last credit on a CREDIT, and must send a FIN (two credits) for our
    // rendezvous; we withhold its data credits because our application is behind, and our
    // application waits for rendezvous room, that is for that FIN.
    let (mut e, _) = connected();
    send_rendezvous(&mut e, 8192);
    let peer_had = behind_with_peer_at(&mut e, 2);
    assert!(
        drain(&mut e).is_empty(),
        "holding two, it can send its FIN: nothing lent"
    );
    assert_eq!(e.credit_state().3, peer_had - 2, "data credits withheld");
    e.on_recv(encode(Th::new(Kind::Credit), &[], &[]))
        .expect("credit");
    let work = drain(&mut e);
    assert_eq!(work.iter().map(kind_of).collect::<Vec<_>>(), ["CREDIT"]);
    match &work[0] {
        Work::Control(th) => assert_eq!(th.credits, 2, "its CREDIT's buffer and one lent"),
        _ => unreachable!(),
    }
    let (_, peer_holds, owed, withheld) = e.credit_state();
    assert_eq!((peer_holds, owed, withheld), (3, 0, peer_had - 3));
    // A peer that spends what it is lent on data instead gets no more than LEND_MAX past the
    // backlog limit before its next FIN.
    let mut sent = 0;
    for round in 0..10u8 {
        while e.credit_state().1 > 0 {
            e.on_recv(eager(&[round; 10])).expect("eager");
            sent += 1;
        }
        drain(&mut e);
    }
    assert_eq!(e.credit_state().1, 0, "left without credits");
    assert_eq!(
        sent,
        3 + (LEND_MAX - 1),
        "what it held, and the rest of the lending"
    );
    assert_eq!(e.lent, LEND_MAX);
    // Without a rendezvous of ours out, nothing is lent: the peer waits for our application.
    let (mut idle, _) = connected();
    let had = behind_with_peer_at(&mut idle, 2);
    idle.on_recv(encode(Th::new(Kind::Credit), &[], &[]))
        .expect("credit");
    drain(&mut idle);
    assert_eq!(
        idle.credit_state().3,
        had - 2,
        "no FIN awaited: nothing lent (what it is owed goes by the usual threshold)"
    );
}

/// The fast path takes a small message only when `poll_work` would hand it out at once and
/// as it would: nothing queued ahead, the handshake done, three credits; the header it gives
/// carries the owed credits and spends one, as an EAGER from the queue does.
#[test]
fn send_now_takes_a_message_only_when_the_queue_would_send_it_at_once() {
    let msg = |n: usize| OutMsg {
        header: HeaderBytes::EMPTY,
        len: n,
        payload: Bytes::from(vec![7u8; n]),
    };
    let mut fresh = engine_with(cfg(), Instant::now());
    assert!(fresh.send_now(0, 1).is_none(), "before the peer's HELLO");

    let (mut e, _) = connected();
    e.on_recv(eager(b"x")).expect("had a credit");
    let (credits, peer, owed, _) = e.credit_state();
    assert!(owed >= 1, "the received buffer's credit is owed");
    let th = e.send_now(0, 1).expect("clear to send");
    assert_eq!((th.kind, th.len, th.credits), (Kind::Eager, 1, owed as u16));
    assert_eq!(e.credit_state(), (credits - 1, peer + owed, 0, 0));

    assert!(
        e.send_now(0, BUF).is_none(),
        "a message beyond the peer's buffer goes by rendezvous, through the queue"
    );
    e.send(msg(1));
    assert!(e.send_now(0, 1).is_none(), "a queued message goes first");
    drain(&mut e);
    while e.credit_state().0 >= 3 {
        e.send_now(0, 1).expect("credits left");
    }
    assert!(
        e.send_now(0, 1).is_none(),
        "the last two credits are kept for a FIN and a CREDIT or CLOSE"
    );
}

/// Small payloads are copied into shared chunks: each copy holds its bytes, copies follow each
/// other in one chunk (no allocation each), a full chunk is replaced, and larger payloads or
/// empty ones take no chunk space.
#[test]
fn small_payloads_share_chunks_and_keep_their_bytes() {
    let mut s = SmallCopies::default();
    let a = s.copy(b"one");
    let b = s.copy(b"two!");
    assert_eq!((&a[..], &b[..]), (&b"one"[..], &b"two!"[..]));
    assert_eq!(
        b.as_ptr() as usize - a.as_ptr() as usize,
        3,
        "carved from one chunk"
    );
    assert!(s.copy(b"").is_empty());
    let big = vec![9u8; SMALL_COPY_MAX + 1];
    assert_eq!(&s.copy(&big)[..], &big[..]);
    let mut kept = Vec::new();
    for i in 0..2 * SMALL_CHUNK / 100 {
        kept.push(s.copy(&[i as u8; 100]));
    }
    for (i, k) in kept.iter().enumerate() {
        assert_eq!(&k[..], &[i as u8; 100][..], "copy {i} kept its bytes");
    }
    drop(a);
    assert_eq!(&b[..], b"two!", "a copy outlives its neighbours");
}

/// The receiving half's fast path leaves the engine as `on_recv` followed by the delivery
/// would: the same credits held and granted, the same owed, the same bytes counted, the same
/// message, and the same work afterwards (a CREDIT once enough are owed).
#[test]
fn recv_small_applies_what_on_recv_would() {
    let (mut fast, _) = connected();
    let (mut slow, _) = connected();
    for i in 0..DEPTH as usize - 2 {
        let mut th = Th::new(Kind::Eager);
        let payload = vec![i as u8; i % 7];
        th.len = payload.len() as u64;
        th.credits = (i % 2) as u16;
        let m = encode(th, b"hh", &payload);
        let got = fast.recv_small(&m.0).expect("a plain small message");
        slow.on_recv(m).expect("valid");
        let Some(Delivery::Msg(want)) = slow.poll_delivery() else {
            panic!("on_recv delivers it")
        };
        assert_eq!(
            (got.header, &got.payload[..]),
            (want.header, &want.payload[..])
        );
        assert_eq!(fast.credit_state(), slow.credit_state(), "message {i}");
        let had_work = fast.has_work();
        let (a, b) = (drain(&mut fast), drain(&mut slow));
        assert_eq!(
            had_work,
            !a.is_empty(),
            "has_work says whether a step posts, message {i}"
        );
        assert_eq!(
            a.iter().map(kind_of).collect::<Vec<_>>(),
            b.iter().map(kind_of).collect::<Vec<_>>()
        );
    }
    let (f, s) = (fast.metrics.snapshot(), slow.metrics.snapshot());
    assert_eq!(f.bytes_received, s.bytes_received);
    assert_eq!(f.payload_bytes_copied, s.payload_bytes_copied);
}

/// The fast path declines, changing nothing, whatever it does not handle: before the
/// handshake, other kinds, large payloads, a message behind a rendezvous being read, an
/// application that is behind, and every violation (which `on_recv` then reports).
#[test]
fn recv_small_declines_and_changes_nothing_it_does_not_handle() {
    let mut fresh = engine_with(cfg(), Instant::now());
    assert!(
        fresh.recv_small(&eager(b"x").0).is_none(),
        "before the HELLO"
    );

    let (mut e, _) = connected();
    let before = e.credit_state();
    let mut credit = Th::new(Kind::Credit);
    credit.credits = 1;
    let big = vec![1u8; cfg().zero_copy_recv_min];
    let mut overflow = Th::new(Kind::Eager);
    overflow.credits = u16::MAX;
    overflow.len = 1;
    let mut lying = eager(b"abc");
    lying.0[8] = 9; // announces 9 bytes, carries 3
    for (what, m) in [
        ("a CREDIT", encode(credit, &[], &[])),
        ("an RTS", rts(1, 4096, 0x1000)),
        ("a payload for zero copy", eager(&big)),
        ("credits beyond the depth", encode(overflow, &[], b"x")),
        ("a wrong length", lying),
        ("garbage", Buf(vec![0xff; 3])),
    ] {
        assert!(e.recv_small(&m.0).is_none(), "{what}");
        assert_eq!(e.credit_state(), before, "{what} changed nothing");
    }
    assert!(
        matches!(
            violation(e.on_recv(encode(overflow, &[], b"x"))),
            ProtocolViolation::CreditOverflow { .. }
        ),
        "on_recv reports what the fast path declined"
    );

    let (mut e, _) = connected();
    e.on_recv(rts(1, 4096, 0x1000)).expect("valid RTS");
    assert!(
        e.recv_small(&eager(b"x").0).is_none(),
        "a message behind a transfer being read keeps its place"
    );

    let (mut e, _) = connected();
    e.set_backlog(cfg().backlog_max - 1, 0);
    assert!(
        e.recv_small(&eager(b"x").0).is_none(),
        "the application is behind"
    );
    e.set_backlog(0, 0);
    assert!(e.recv_small(&eager(b"x").0).is_some(), "and no longer");
}

/// An echo server's application (`s`): takes a message only while its engine has room for
/// the answer (`room` queued at most, as the glue's sender waits for room), and sends it back.
fn echo(s: &mut Side, room: usize) -> bool {
    let mut any = false;
    while s.e.queued() < room {
        let Some((h, p)) = s.app.pop_front() else {
            break;
        };
        s.app_bytes -= p.len() as u64;
        s.taken.push((h, p.clone()));
        s.sent.push((h, p.clone()));
        s.e.send(OutMsg {
            header: h,
            len: p.len(),
            payload: p,
        });
        any = true;
    }
    s.e.set_backlog(s.app.len(), s.app_bytes);
    any
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// A client sends a burst of eager and rendezvous messages to an echo server whose
    /// application answers only while its queue has room (the conformance echo's shape): in
    /// any interleaving the two never wait on each other for good (credits withheld by a side
    /// that is behind, FINs that need credits, rendezvous room that needs FINs), and every
    /// message comes back byte-exact and in order.
    #[test]
    fn an_echo_server_answering_as_it_has_room_never_deadlocks(
        sizes in proptest::collection::vec(prop_oneof![3 => 0usize..200, 2 => 200usize..4000, 3 => 4100usize..40_000], 1..120),
        room in 1usize..6,
        steps in proptest::collection::vec((0u8..7, 0usize..5), 0..400),
    ) {
        let now = Instant::now();
        let mut a = Side::new(now, cfg());
        let mut b = Side::new(now, cfg());
        for (i, len) in sizes.iter().enumerate() {
            let header = HeaderBytes::new(&(i as u32).to_le_bytes()).expect("4 bytes");
            let p = payload(*len, i as u8);
            a.sent.push((header, p.clone()));
            a.e.send(OutMsg { header, len: *len, payload: p });
        }
        for (what, n) in steps {
            match what {
                0 => { pump(&mut a, &mut b); }
                1 => { pump(&mut b, &mut a); }
                2 => { arrive(&mut a); }
                3 => { arrive(&mut b); }
                4 => { complete_read(&mut a); complete_read(&mut b); }
                5 => { take(&mut a, n); }
                _ => { echo(&mut b, room); }
            }
        }
        let mut rounds = 0;
        loop {
            let mut any = pump(&mut a, &mut b);
            any |= pump(&mut b, &mut a);
            while arrive(&mut a) { any = true; }
            while arrive(&mut b) { any = true; }
            while complete_read(&mut a) { any = true; }
            while complete_read(&mut b) { any = true; }
            any |= take(&mut a, usize::MAX);
            any |= echo(&mut b, room);
            if !any { break; }
            rounds += 1;
            prop_assert!(rounds < 100_000, "no quiescence");
        }
        prop_assert_eq!(
            a.taken.len(), a.sent.len(),
            "stuck: a credits/peer/owed/withheld {:?} rendezvous {:?} queued {}; b {:?} {:?} queued {} app {}",
            a.e.credit_state(), a.e.rendezvous_counts(), a.e.queued(),
            b.e.credit_state(), b.e.rendezvous_counts(), b.e.queued(), b.app.len()
        );
        prop_assert!(a.taken == a.sent, "byte-exact and in order");
    }
}
