//! System packages the build needs, installed with apt-get when running as root.

use crate::util;
use std::process::Command;

/// Debian packages needed to build the workspace (not the test bed; see `testbed`).
///
/// `transport-verbs` binds rdma-core through `sideway`, whose -sys layer runs bindgen
/// (libclang) and cmake at build time. rdma-core itself is loaded at run time only.
pub const BUILD_PACKAGES: &[&str] = &["cmake", "libclang-dev", "pkg-config"];

/// Debian packages the tests need beyond the build: valgrind, whose memcheck runs the C
/// examples of `transport-ffi` (`TRANSPORT_FFI_MEMCHECK=1`).
pub const TEST_PACKAGES: &[&str] = &["valgrind"];

/// Makes sure [`BUILD_PACKAGES`] are present.
pub fn ensure_build_deps() -> Result<(), String> {
    ensure_packages(BUILD_PACKAGES)
}

/// Installs the missing ones of `pkgs` (as root) or names them and fails (otherwise).
pub fn ensure_packages(pkgs: &[&str]) -> Result<(), String> {
    let missing: Vec<&str> = pkgs.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !util::is_root() {
        return Err(format!(
            "missing system packages: {0}\n  install them with: sudo apt-get install -y {0}",
            missing.join(" ")
        ));
    }
    eprintln!("xtask: installing {}", missing.join(" "));
    util::run("apt-get", &["update", "-qq"])?;
    let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
    args.extend(missing.iter().copied());
    util::run("apt-get", &args)
}

fn installed(pkg: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}
