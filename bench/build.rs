//! Compiles the C client of `bench scenario c-abi` (csrc/c_ping.c, which includes the loop of
//! transport-ffi's C ping example) against transport-ffi's generated header. Its `tp_*`
//! symbols come from the transport-ffi rlib the bench links.

fn main() {
    let ffi = std::path::Path::new("../transport-ffi");
    for f in [
        "csrc/c_ping.c",
        "../transport-ffi/examples/c/ping_loop.h",
        "../transport-ffi/include/transport_ffi.h",
    ] {
        println!("cargo:rerun-if-changed={f}");
    }
    cc::Build::new()
        .file("csrc/c_ping.c")
        .include(ffi.join("include"))
        .include(ffi.join("examples/c"))
        .opt_level(2)
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .compile("bench_c_ping");
}
