//! The committed header is what cbindgen generates from the sources: a change to the C
//! surface that was not regenerated fails here. `TRANSPORT_FFI_WRITE_HEADER=1` rewrites it.

use std::path::Path;

#[test]
fn the_committed_header_matches_the_sources() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("UTF-8");
    let path = dir.join("include/transport_ffi.h");
    if std::env::var("TRANSPORT_FFI_WRITE_HEADER").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &generated).expect("write the header");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is stale: regenerate it with TRANSPORT_FFI_WRITE_HEADER=1 cargo test -p \
         transport-ffi --test header",
        path.display()
    );
    for f in [
        "tp_connect",
        "tp_rpc_serve",
        "tp_send_buffer",
        "TP_ERR_INTERNAL",
    ] {
        assert!(generated.contains(f), "{f} is not in the header");
    }
}
