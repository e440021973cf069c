use super::*;

/// A wait that spins until its budget runs out, as on one CPU where the peer cannot run.
fn miss(spin: &mut Spin) -> bool {
    let mut w = spin.begin();
    let spun = w.budget > Duration::ZERO;
    w.from = Some(Instant::now() - w.budget);
    w.spun = spun;
    assert_eq!(w.next(true), Next::Sleep, "the budget ran out");
    spin.end(&mut w, false);
    spun
}

#[test]
fn a_half_whose_spins_run_out_yields_its_thread_then_sleeps_at_once_but_probes() {
    let mut spin = Spin::new(Duration::from_micros(50));
    for i in 0..MISSES_BEFORE_SLEEPING {
        assert_eq!(spin.mode, Mode::Turns, "wait {i}");
        assert!(miss(&mut spin));
    }
    // Looking between turns did not pay: the thread yields too.
    for i in 0..MISSES_BEFORE_SLEEPING {
        assert_eq!(spin.mode, Mode::Yields, "wait {i}");
        assert!(miss(&mut spin));
    }
    assert_eq!(spin.mode, Mode::Sleeps);
    let spun: Vec<bool> = (0..2 * PROBE_EVERY).map(|_| miss(&mut spin)).collect();
    let probes = spun.iter().filter(|s| **s).count();
    assert_eq!(probes, 2, "one probe per {PROBE_EVERY} waits");
    // A probe that finds the peer answering brings the spinning back.
    while spin.waits % PROBE_EVERY != PROBE_EVERY - 1 {
        miss(&mut spin);
    }
    let mut w = spin.begin();
    assert_eq!(w.next(true), Next::Look, "the probe spins, looking at once");
    spin.end(&mut w, true);
    assert_eq!(spin.mode, Mode::Turns);
    assert!(
        spin.begin().budget > Duration::ZERO,
        "spinning again after a hit"
    );
}

#[test]
fn a_hit_while_yielding_keeps_yielding_until_a_probe_of_turns_hits() {
    let mut spin = Spin::new(Duration::from_micros(50));
    for _ in 0..MISSES_BEFORE_SLEEPING {
        miss(&mut spin);
    }
    let hit = |spin: &mut Spin| {
        let mut w = spin.begin();
        assert_ne!(w.next(true), Next::Sleep);
        spin.end(&mut w, true);
        w.mode
    };
    // Hits while yielding keep it yielding, up to the probe.
    while spin.waits % PROBE_EVERY != PROBE_EVERY - 1 {
        assert_eq!(hit(&mut spin), Mode::Yields);
        assert_eq!(spin.mode, Mode::Yields);
    }
    // A probe of turns that misses changes nothing; one that hits goes back to turns.
    let mut w = spin.begin();
    assert_eq!(w.mode, Mode::Turns);
    w.from = Some(Instant::now() - w.budget);
    w.spun = true;
    spin.end(&mut w, false);
    assert_eq!((spin.mode, spin.misses), (Mode::Yields, 0));
    while spin.waits % PROBE_EVERY != PROBE_EVERY - 1 {
        hit(&mut spin);
    }
    assert_eq!(hit(&mut spin), Mode::Turns);
    assert_eq!(spin.mode, Mode::Turns);
}

#[test]
fn a_zero_budget_never_spins_and_learns_nothing() {
    let mut spin = Spin::new(Duration::ZERO);
    for _ in 0..10 {
        let mut w = spin.begin();
        assert_eq!(w.next(true), Next::Sleep);
        spin.end(&mut w, false);
    }
    assert_eq!(spin.misses, 0);
}

#[test]
fn in_a_lockstep_a_half_looks_again_at_once_for_a_burst_before_each_turn() {
    // Budgets and bursts long enough that no step below runs out by itself.
    let long = Duration::from_secs(1);
    let mut spin = Spin::new(long);
    let mut w = spin.begin();
    assert_eq!((w.mode, w.burst), (Mode::Turns, BURST));
    w.burst = long;
    assert_eq!(
        w.next(true),
        Next::Look,
        "the first look after a miss is at once"
    );
    assert!(w.spun);
    assert_eq!(w.next(true), Next::Look, "within the burst");
    // The burst is over: a turn of the runtime at the next reading of the clock (one in
    // LOOKS_PER_CLOCK looks), after which a new burst begins.
    w.burst_from = Some(Instant::now() - long);
    let mut looks = 0;
    while w.next(true) == Next::Look {
        looks += 1;
        assert!(looks < LOOKS_PER_CLOCK, "the clock is read");
    }
    assert_eq!(
        looks,
        LOOKS_PER_CLOCK - 1,
        "one look of the burst read the clock"
    );
    assert_eq!(w.unclocked, 0);
    assert_eq!(w.burst_from, None);
    assert_eq!(w.next(true), Next::Look, "a new burst after the turn");
    assert_eq!(w.next(true), Next::Look);
    assert_eq!(w.unclocked, 1, "a look without the clock");
    // Out of a lockstep a half takes a turn after every look, within a burst too.
    assert_eq!(w.next(false), Next::Turn);
    assert_eq!(w.next(false), Next::Turn);
    assert_eq!(w.next(true), Next::Look, "a burst again in a lockstep");
    // The budget is over: sleep at the next reading of the clock, even within a burst.
    w.from = Some(Instant::now() - long);
    w.unclocked = LOOKS_PER_CLOCK;
    assert_eq!(w.next(true), Next::Sleep);
    spin.end(&mut w, false);
    assert_eq!(spin.misses, 1);
}

#[test]
fn a_burst_is_no_longer_than_the_budget_and_a_sleeping_half_does_not_burst() {
    let short = BURST / 2;
    assert_eq!(Spin::new(short).begin().burst, short);
    // A half that learnt to yield its thread (the peer shares its CPU, and answers while
    // this one yields) bursts in a lockstep too, and takes a turn after every look out of
    // one.
    let long = Duration::from_secs(1);
    let mut spin = Spin::new(long);
    for _ in 0..MISSES_BEFORE_SLEEPING {
        miss(&mut spin);
    }
    assert_eq!(spin.mode, Mode::Yields);
    let mut w = spin.begin();
    assert_eq!(w.burst, BURST);
    w.burst = long;
    assert_eq!(w.next(true), Next::Look, "a yielding burst in a lockstep");
    assert_eq!(w.next(true), Next::Look);
    assert_eq!(
        w.next(false),
        Next::Turn,
        "out of a lockstep: a turn per look"
    );
    w.burst_from = Some(Instant::now() - long);
    assert_eq!(w.next(true), Next::Turn, "the burst is over");
    for _ in 0..MISSES_BEFORE_SLEEPING {
        miss(&mut spin);
    }
    // A half that sleeps probes looking between turns, in bursts.
    assert_eq!(spin.mode, Mode::Sleeps);
    while spin.waits % PROBE_EVERY != PROBE_EVERY - 1 {
        let mut w = spin.begin();
        assert_eq!(w.burst, Duration::ZERO);
        assert_eq!(w.next(true), Next::Sleep);
    }
    let probe = spin.begin();
    assert!(probe.probe);
    assert_eq!(probe.burst, BURST);
}

#[test]
fn a_lockstep_is_a_message_sent_since_the_last_came_and_one_more_unanswered_than_ever() {
    let m = Metrics::default();
    let mut l = Lockstep::default();
    // A first message that is never answered (a mode), then one call at a time.
    m.messages_sent.incr();
    assert!(l.check(&m));
    m.messages_sent.incr();
    assert!(l.check(&m), "a request out: one more unanswered than ever");
    m.messages_received.incr();
    l.came(&m);
    assert!(!l.check(&m), "answered, nothing sent since");
    m.messages_sent.incr();
    assert!(l.check(&m), "the next request");
    // Two calls out: pipelined.
    m.messages_sent.incr();
    assert!(!l.check(&m));
    m.messages_received.add(2);
    l.came(&m);
    m.messages_sent.incr();
    assert!(l.check(&m), "one at a time again");
    // A server: requests come, then it answers.
    let (m, mut l) = (Metrics::default(), Lockstep::default());
    assert!(!l.check(&m), "nothing sent");
    m.messages_received.incr();
    l.came(&m);
    assert!(!l.check(&m), "a request came: nothing answered yet");
    m.messages_sent.incr();
    assert!(l.check(&m), "answered: the next request is due");
}
