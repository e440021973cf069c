//! Generates the tonic client and server of `proto/echo.proto` with the protoc binary vendored
//! by `protoc-bin-vendored`, so no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // prost-build finds protoc through PROTOC; build scripts are single-threaded.
    std::env::set_var("PROTOC", protoc);
    println!("cargo:rerun-if-changed=proto/echo.proto");
    tonic_prost_build::configure()
        .bytes(".")
        .compile_protos(&["proto/echo.proto"], &["proto"])?;
    Ok(())
}
