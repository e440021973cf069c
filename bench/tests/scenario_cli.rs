//! `bench scenario` as a user runs it: argument errors, JSON shape, the SVG plot, verbs reported
//! as unavailable (with its reason) on a machine without RDMA. No timing is asserted.

mod common;

use common::{bench, stderr};
use std::process::Output;

fn json(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "bench failed: {}", stderr(o));
    serde_json::from_slice(&o.stdout).expect("stdout is JSON")
}

#[test]
fn bad_arguments_are_named() {
    let o = bench(&["scenario", "nope"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains(
            "possible values: typed, structured, clients, slow-clients, orb, framework, c-abi, all"
        ),
        "{}",
        stderr(&o)
    );
    let o = bench(&["scenario", "clients", "--clients", "0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--clients"), "{}", stderr(&o));
    let o = bench(&["scenario", "typed", "--seconds", "0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("not a duration"), "{}", stderr(&o));
    let o = bench(&["scenario", "typed", "--sizes", "12x"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("`12x` is not a size"), "{}", stderr(&o));
}

#[test]
fn clients_scenario_json_has_one_row_per_client_count_and_transport() {
    let v = json(&bench(&[
        "scenario",
        "clients",
        "--transports",
        "uds,tcp",
        "--clients",
        "2,3",
        "--seconds",
        "0.1",
        "--json",
    ]));
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "{v}");
    for (row, (t, c)) in rows
        .iter()
        .zip([("uds", 2), ("uds", 3), ("tcp", 2), ("tcp", 3)])
    {
        assert_eq!(row["scenario"], "clients");
        assert_eq!(row["transport"], t);
        assert_eq!(row["load"]["clients"], c);
        assert_eq!(row["load"]["connections"], c);
        assert!(row["stats"]["completed"].as_u64().unwrap() > 0, "{row}");
    }
}

#[test]
fn typed_and_structured_cover_every_mode_and_payload() {
    let v = json(&bench(&[
        "scenario",
        "typed",
        "--transports",
        "uds",
        "--sizes",
        "1K",
        "--seconds",
        "0.05",
        "--json",
    ]));
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3 * 4, "{v}");
    for what in ["string", "string+f64", "i64+i64+f64"] {
        for mode in ["send", "oneway", "recv", "echo"] {
            let row = rows
                .iter()
                .find(|r| r["what"] == what && r["mode"] == mode)
                .unwrap_or_else(|| panic!("no {what} {mode} row"));
            assert!(row["stats"]["mbit_s"].as_f64().unwrap() > 0.0, "{row}");
            let bytes = row["payload_bytes"].as_u64().unwrap();
            assert!((900..=1200).contains(&bytes), "{row}");
        }
    }
    let v = json(&bench(&[
        "scenario",
        "structured",
        "--transports",
        "tcp",
        "--seconds",
        "0.05",
        "--json",
    ]));
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    assert!(rows.iter().all(|r| r["what"] == "structured"));
}

#[test]
fn orb_rows_show_both_shapes_and_tables_print() {
    let o = bench(&[
        "scenario",
        "orb",
        "--transports",
        "uds",
        "--threads",
        "8",
        "--payload",
        "4K",
        "--seconds",
        "0.1",
        "--no-progress",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("5 conn x 1 call, ping"), "{out}");
    assert!(out.contains("5 conn x 1 call, send 4 KiB"), "{out}");
    assert!(out.contains("pipelined: 1 conn, send 4 KiB"), "{out}");
    assert!(out.contains("8 caller threads"), "{out}");
}

#[test]
fn plot_is_svg_and_verbs_absence_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("clients.svg");
    let v = json(&bench(&[
        "scenario",
        "slow-clients",
        "--transports",
        "uds,verbs",
        "--clients",
        "2,4",
        "--handler-ms",
        "20",
        "--seconds",
        "0.1",
        "--json",
        "--plot",
        svg.to_str().unwrap(),
    ]));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"), "{}", &text[..text.len().min(80)]);
    assert!(text.trim_end().ends_with("</svg>"));
    assert!(text.contains("uds slow-clients"));
    let measured_verbs = v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["transport"] == "verbs");
    let unavailable = v["unavailable"].as_array().unwrap();
    // Either verbs ran (a machine with RDMA) or it is listed with the reason.
    assert!(
        measured_verbs
            || unavailable.iter().any(
                |u| u["transport"] == "verbs" && u["reason"].as_str().unwrap().contains("RDMA")
            ),
        "{v}"
    );
}

#[test]
fn framework_scenario_compares_grpc_and_tarpc_with_native_rpc() {
    let v = json(&bench(&[
        "scenario",
        "framework",
        "--transports",
        "uds",
        "--small-calls",
        "50",
        "--large-calls",
        "3",
        "--json",
    ]));
    let f = v["framework"].as_array().unwrap();
    assert_eq!(f.len(), 1, "{v}");
    assert_eq!(f[0]["transport"], "uds");
    for k in [
        "small_calls_per_s",
        "large_mb_per_s",
        "ratio",
        "tarpc",
        "tarpc_ratio",
    ] {
        let pair = f[0][k].as_array().unwrap();
        assert!(pair.iter().all(|x| x.as_f64().unwrap() > 0.0), "{k}: {v}");
    }
    assert!(
        f[0]["tarpc_serde_tcp"].is_null(),
        "measured on tcp only: {v}"
    );
}

#[test]
fn c_abi_scenario_runs_the_c_client_beside_the_rust_one_on_each_transport() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("c.svg");
    let o = bench(&[
        "scenario",
        "c-abi",
        "--transports",
        "uds,tcp",
        "--small-calls",
        "30",
        "--large-calls",
        "2",
        "--rounds",
        "2",
        "--plot",
        svg.to_str().unwrap(),
        "--json",
    ]);
    let v = json(&o);
    let rows = v["c_abi"].as_array().unwrap();
    let names: Vec<&str> = rows
        .iter()
        .map(|r| r["transport"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["uds", "tcp"], "{v}");
    for r in rows {
        assert_eq!(r["rounds"], 2, "{v}");
        assert_eq!(r["large_bytes"], 1 << 20, "{v}");
        for k in ["small_us", "large_mb_per_s", "c_over_rust"] {
            let pair = r[k].as_array().unwrap();
            assert!(pair.iter().all(|x| x.as_f64().unwrap() > 0.0), "{k}: {v}");
        }
    }
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(
        plot.contains("c-abi: 0 B calls"),
        "the c-abi panels are drawn"
    );
    let o = bench(&["scenario", "c-abi", "--rounds", "0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--rounds"), "{}", stderr(&o));
}
