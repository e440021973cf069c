use super::*;

/// A payload has the size asked (at least its 8-byte id), starts with its call's id, and
/// differs from every other call's of the same size.
#[test]
fn named_payloads_carry_their_call_and_differ() {
    for size in [0, 7, 8, 9, 64, 1000] {
        let a = named_payload(1, size);
        assert_eq!(a.len(), size.max(8));
        assert_eq!(&a[..8], &1u64.to_le_bytes());
        assert_ne!(a, named_payload(2, size));
    }
    // Not a prefix of another call's: the pattern depends on the id.
    let (a, b) = (named_payload(5, 64), named_payload(6, 64));
    assert_ne!(&a[8..], &b[8..]);
}

/// By default every victim runs on uds and tcp, and link is skipped (not refused) on
/// verbs; asked for on verbs, link is refused before anything runs.
#[test]
fn link_runs_on_sockets_and_is_skipped_or_refused_on_verbs() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        soak: SoakArgs,
    }
    let parse = |args: &[&str]| {
        let argv = std::iter::once("soak").chain(args.iter().copied());
        Cli::try_parse_from(argv).expect("valid arguments").soak
    };
    let plan_of = |args: &[&str]| plan(&parse(args));
    let all = [Victim::Server, Victim::Client, Victim::Link];
    let sockets = plan_of(&[]).expect("the default plan");
    let expected: Vec<_> = [SoakTransport::Uds, SoakTransport::Tcp]
        .into_iter()
        .flat_map(|t| all.map(|v| (t, v, true)))
        .collect();
    assert_eq!(sockets, expected);
    let verbs = plan_of(&["--transports", "verbs"]).expect("verbs by default");
    assert_eq!(
        verbs,
        all.map(|v| (SoakTransport::Verbs, v, v != Victim::Link))
    );
    let refused = plan_of(&["--transports", "tcp,verbs", "--kill", "server,link"]);
    assert_eq!(refused, Err(NO_LINK_ON_VERBS.to_string()));
    let asked = plan_of(&["--transports", "verbs", "--kill", "client"]).expect("no link");
    assert_eq!(asked, vec![(SoakTransport::Verbs, Victim::Client, true)]);
}

/// The proxy's faults come in turn, each kind aimed at the server, then at the client.
#[test]
fn faults_take_their_kinds_and_directions_in_turn() {
    let turns: Vec<_> = (0..7).map(fault_in_turn).collect();
    assert_eq!(
        turns,
        [
            Fault::Rst,
            Fault::HalfClose(Toward::Server),
            Fault::Cut(Toward::Server),
            Fault::Rst,
            Fault::HalfClose(Toward::Client),
            Fault::Cut(Toward::Client),
            Fault::Rst,
        ]
    );
}

/// Leaks are what the process holds beyond its baseline, never negative.
#[test]
fn leaks_count_only_what_grew() {
    let base = Resources {
        fds: 10,
        tasks: 3,
        rss_kib: 0,
    };
    let more = Resources {
        fds: 12,
        tasks: 3,
        rss_kib: 0,
    };
    let fewer = Resources {
        fds: 9,
        tasks: 1,
        rss_kib: 0,
    };
    assert_eq!(more.leaked(&base), (2, 0));
    assert_eq!(fewer.leaked(&base), (0, 0));
}
