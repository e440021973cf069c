//! Probes every RDMA device of this machine and prints what it can do and the path each
//! feature of the transport takes on it with the default settings:
//! `cargo run -p transport-verbs --example probe`.

use std::time::Instant;

fn main() {
    let cfg = transport_verbs::VerbsConfig::default();
    let started = Instant::now();
    match transport_verbs::probe_devices() {
        Ok(devices) => {
            for caps in &devices {
                println!("{caps}\n  paths: {}", caps.paths(&cfg));
            }
            println!(
                "probed {} device(s) in {:.1} ms",
                devices.len(),
                started.elapsed().as_secs_f64() * 1e3
            );
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
