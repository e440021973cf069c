//! `siw.ko` (soft-iWARP) for the guest's kernel, built on the host: Debian's bookworm kernel
//! images ship `rdma_rxe` but not `siw`.
//!
//! The kernel's own `linux-source`, `linux-headers` (arch and common) and `linux-kbuild`
//! packages, at exactly the version of the fetched `linux-image`, are downloaded with
//! `apt-get download` and unpacked with `dpkg-deb -x` (never installed) into a work directory.
//! Only `drivers/infiniband/sw/siw` is taken from the source tarball, and it is built out of
//! tree against the headers with the compiler the kernel was built with (`gcc-N`, which the
//! headers' `.kernelvariables` name as `CC`, and the kernel's `CONFIG_CC_VERSION_TEXT` too; the
//! headers' `linux-compiler-gcc-N-x86` dependency holds only documentation and depends on the
//! host package `gcc-N`, which is installed instead):
//!
//! ```text
//! make -C <work>/tree/lib/modules/<kver>/build M=<work>/src/.../siw CONFIG_RDMA_SIW=m modules
//! ```
//!
//! The module, without its debug sections, is kept as `<cache>/siw/siw.ko` with `siw.stamp`
//! (kernel release and package version, compiler, this recipe's version); the work directory
//! (about 380 MB at its peak: 153 MB of packages, the 138 MB source tarball, 85 MB of headers)
//! is removed. While the stamp matches, nothing is downloaded or
//! built.

use std::fs;
use std::path::{Component, Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::fetch::Fetched;
use super::modules;
use crate::{deps, util};

/// Bump when the recipe changes in a way the other inputs do not show.
const RECIPE: &str = "testbed-siw v1";

/// Bound of each download, unpacking and build command (the build itself takes seconds).
const STEP_LIMIT: Duration = Duration::from_secs(600);

/// The built module.
#[derive(Debug, Clone)]
pub struct Siw {
    /// `<cache>/siw/siw.ko`.
    pub ko: PathBuf,
    /// Contents of `siw.stamp`: an input of the initramfs stamp.
    pub stamp: String,
}

/// The kernel's packages a build needs, derived from its release `kver` (`6.1.0-57-amd64`).
#[derive(Debug, PartialEq, Eq)]
struct Packages {
    /// `linux-source-6.1`: the tarball `siw/` is taken from.
    source: String,
    /// `linux-headers-6.1.0-57-amd64`, `linux-headers-6.1.0-57-common`, `linux-kbuild-6.1`.
    headers: Vec<String>,
}

fn packages(kver: &str) -> Result<Packages, String> {
    let bad = || format!("unexpected kernel release `{kver}` (expected like 6.1.0-57-amd64)");
    // "6.1.0-57" and "amd64"
    let (abi, _flavour) = kver.rsplit_once('-').ok_or_else(bad)?;
    let mut parts = abi.split('.');
    let series = match (parts.next(), parts.next()) {
        (Some(major), Some(minor)) => format!("{major}.{minor}"),
        _ => return Err(bad()),
    };
    Ok(Packages {
        source: format!("linux-source-{series}"),
        headers: vec![
            format!("linux-headers-{kver}"),
            format!("linux-headers-{abi}-common"),
            format!("linux-kbuild-{series}"),
        ],
    })
}

/// Returns the module, building it only when it is missing or an input changed.
pub fn ensure(f: &Fetched, cache: &Path) -> Result<Siw, String> {
    let dir = cache.join("siw");
    let ko = dir.join("siw.ko");
    let stamp_path = dir.join("siw.stamp");
    let version = kernel_version(f, cache)?;
    let kernel_cc = kernel_compiler(f)?;
    let compiler = kernel_cc
        .split_whitespace()
        .next()
        .unwrap_or("gcc")
        .to_owned();
    let stamp = stamp_text(&f.kver, &version, &compiler_version(&compiler));
    if ko.is_file() && fs::read_to_string(&stamp_path).is_ok_and(|s| s == stamp) {
        return Ok(Siw { ko, stamp });
    }
    let started = Instant::now();
    let _ = fs::remove_file(&stamp_path);
    // The host builds with the kernel's compiler; kbuild's own tools need libelf and libssl.
    deps::ensure_packages(&[compiler.as_str(), "make", "binutils", "libelf1", "libssl3"])?;
    // The compiler may just have been installed: its version is the one the stamp names.
    let host_cc = compiler_version(&compiler);
    if host_cc != kernel_cc {
        eprintln!(
            "testbed: warning: building siw.ko with `{host_cc}`; the kernel was built with \
             `{kernel_cc}`"
        );
    }
    let stamp = stamp_text(&f.kver, &version, &host_cc);
    let work = dir.join("work");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    let built = build(f, &work, &version)?;
    let tmp = dir.join("siw.ko.tmp");
    run(
        "strip",
        &[
            "--strip-debug".into(),
            "-o".into(),
            path(&tmp),
            path(&built),
        ],
    )?;
    check_vermagic(f, &tmp)?;
    fs::rename(&tmp, &ko).map_err(|e| format!("{}: {e}", ko.display()))?;
    let _ = fs::remove_dir_all(&work);
    fs::write(&stamp_path, &stamp).map_err(|e| format!("{}: {e}", stamp_path.display()))?;
    let size = fs::metadata(&ko).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "testbed: built {} ({} KiB, kernel {} {version}) in {:.1}s",
        ko.display(),
        size / 1024,
        f.kver,
        started.elapsed().as_secs_f64()
    );
    Ok(Siw { ko, stamp })
}

/// `siw.stamp`: what the module was built from (kernel release, its package version) and with
/// (the host compiler's `--version`, this recipe).
fn stamp_text(kver: &str, version: &str, compiler: &str) -> String {
    format!("{RECIPE}\nkver={kver}\nversion={version}\ncompiler={compiler}\n")
}

/// Downloads and unpacks the packages into `work`, builds `siw.ko` there, returns its path.
fn build(f: &Fetched, work: &Path, version: &str) -> Result<PathBuf, String> {
    let pkgs = packages(&f.kver)?;
    let debs = work.join("debs");
    fs::create_dir_all(&debs).map_err(|e| format!("{}: {e}", debs.display()))?;
    if util::is_root() {
        // `apt-get download` of an exact version needs current lists; cheap when they are.
        util::run("apt-get", &["update", "-qq"])?;
    }
    let mut download: Vec<String> = vec!["download".into(), "-q".into()];
    for p in pkgs.headers.iter().chain([&pkgs.source]) {
        download.push(format!("{p}={version}"));
    }
    let args: Vec<&str> = download.iter().map(String::as_str).collect();
    util::run_with_timeout_in(Some(&debs), "apt-get", &args, STEP_LIMIT)?;

    // The headers and kbuild, unpacked together: their relative links join them.
    let tree = work.join("tree");
    for p in &pkgs.headers {
        unpack(&deb_of(&debs, p)?, &tree)?;
    }
    relink_absolute(&tree, &tree)?;
    let build_dir = tree.join("lib/modules").join(&f.kver).join("build");
    point_makefile_inside(&build_dir.join("Makefile"), &tree)?;

    // Only drivers/infiniband/sw/siw from the source tarball (about 140 MB compressed).
    let source = work.join("source");
    unpack(&deb_of(&debs, &pkgs.source)?, &source)?;
    let tarball = find_tarball(&source.join("usr/src"))?;
    let top = tarball
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".tar.xz"))
        .ok_or_else(|| format!("unexpected source tarball {}", tarball.display()))?
        .to_owned();
    let member = format!("{top}/drivers/infiniband/sw/siw");
    let src = work.join("src");
    fs::create_dir_all(&src).map_err(|e| format!("{}: {e}", src.display()))?;
    run(
        "tar",
        &[
            "-xJf".into(),
            path(&tarball),
            "-C".into(),
            path(&src),
            member.clone(),
        ],
    )?;
    let _ = fs::remove_dir_all(&source);
    let _ = fs::remove_dir_all(&debs);

    let siw = src.join(&member);
    let jobs = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The headers' .kernelvariables set CC to the kernel's compiler (gcc-N).
    run(
        "make",
        &[
            "-C".into(),
            path(&build_dir),
            format!("M={}", siw.display()),
            "CONFIG_RDMA_SIW=m".into(),
            format!("-j{jobs}"),
            "modules".into(),
        ],
    )?;
    let ko = siw.join("siw.ko");
    if ko.is_file() {
        Ok(ko)
    } else {
        Err(format!("make succeeded but left no {}", ko.display()))
    }
}

/// `prog args…` under [`STEP_LIMIT`].
fn run(prog: &str, args: &[String]) -> Result<(), String> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    util::run_with_timeout(prog, &args, STEP_LIMIT)
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

fn unpack(deb: &Path, into: &Path) -> Result<(), String> {
    fs::create_dir_all(into).map_err(|e| format!("{}: {e}", into.display()))?;
    run("dpkg-deb", &["-x".into(), path(deb), path(into)])
}

/// The downloaded `.deb` of package `name` in `dir`.
fn deb_of(dir: &Path, name: &str) -> Result<PathBuf, String> {
    file_named(dir, &format!("{name}_"), ".deb")?
        .ok_or_else(|| format!("apt-get did not download {name} into {}", dir.display()))
}

/// The first file in `dir` whose name starts with `prefix` and ends with `suffix`.
fn file_named(dir: &Path, prefix: &str, suffix: &str) -> Result<Option<PathBuf>, String> {
    Ok(fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix) && n.ends_with(suffix))
        }))
}

fn find_tarball(dir: &Path) -> Result<PathBuf, String> {
    file_named(dir, "linux-source-", ".tar.xz")?
        .ok_or_else(|| format!("no linux-source-*.tar.xz in {}", dir.display()))
}

/// The Debian version of the fetched kernel image (`6.1.192-3`): the headers and the source
/// must be exactly this one.
fn kernel_version(f: &Fetched, cache: &Path) -> Result<String, String> {
    let prefix = format!("deb=linux-image-{}_", f.kver);
    let deb = f
        .stamp
        .lines()
        .find_map(|l| l.starts_with(&prefix).then(|| &l["deb=".len()..]))
        .ok_or_else(|| format!("fetch.stamp names no linux-image-{} package", f.kver))?;
    let out = Command::new("dpkg-deb")
        .args(["-f"])
        .arg(cache.join("debs").join(deb))
        .arg("Version")
        .output()
        .map_err(|e| format!("cannot run dpkg-deb: {e}"))?;
    let version = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !out.status.success() || version.is_empty() {
        return Err(format!(
            "`dpkg-deb -f {deb} Version` failed ({})",
            out.status
        ));
    }
    Ok(version)
}

/// The compiler the kernel was built with, as its `--version` prints it (`gcc-12 (Debian
/// 12.2.0-14+deb12u1) 12.2.0`): the kernel configuration's `CONFIG_CC_VERSION_TEXT`.
fn kernel_compiler(f: &Fetched) -> Result<String, String> {
    let config = f.root.join("boot").join(format!("config-{}", f.kver));
    let text = fs::read_to_string(&config).map_err(|e| format!("{}: {e}", config.display()))?;
    text.lines()
        .find_map(|l| l.strip_prefix("CONFIG_CC_VERSION_TEXT="))
        .map(|v| v.trim_matches('"').to_owned())
        .ok_or_else(|| format!("{} has no CONFIG_CC_VERSION_TEXT", config.display()))
}

/// `gcc-12 --version`'s first line, or a note that it is missing (then the stamp differs
/// and the build installs it).
fn compiler_version(cc: &str) -> String {
    Command::new(cc)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_owned)
        })
        .unwrap_or_else(|| format!("{cc} not installed"))
}

/// Rewrites every symbolic link under `dir` whose target is absolute (`/usr/src/...`,
/// `/usr/lib/linux-kbuild-6.1/...`) into a relative one inside `root`.
fn relink_absolute(dir: &Path, root: &Path) -> Result<(), String> {
    for e in fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let p = e.map_err(|e| e.to_string())?.path();
        let meta = fs::symlink_metadata(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        if meta.file_type().is_symlink() {
            let target = fs::read_link(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            if target.is_absolute() {
                let rel = p
                    .parent()
                    .and_then(|parent| parent.strip_prefix(root).ok())
                    .ok_or_else(|| format!("{} is outside {}", p.display(), root.display()))?;
                let new = inside(rel, &target);
                fs::remove_file(&p).map_err(|e| format!("{}: {e}", p.display()))?;
                std::os::unix::fs::symlink(&new, &p)
                    .map_err(|e| format!("{} -> {}: {e}", p.display(), new.display()))?;
            }
        } else if meta.is_dir() {
            relink_absolute(&p, root)?;
        }
    }
    Ok(())
}

/// The relative path from directory `from` (relative to the extraction root) to the absolute
/// `target` taken inside that root.
fn inside(from: &Path, target: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in from.components() {
        if matches!(c, Component::Normal(_)) {
            out.push("..");
        }
    }
    out.join(target.strip_prefix("/").unwrap_or(target))
}

/// The arch headers' Makefile is one line, `include /usr/src/linux-headers-...-common/Makefile`:
/// made to include the unpacked copy.
fn point_makefile_inside(makefile: &Path, root: &Path) -> Result<(), String> {
    let text = fs::read_to_string(makefile).map_err(|e| format!("{}: {e}", makefile.display()))?;
    let fixed: String = text
        .lines()
        .map(|l| match l.strip_prefix("include /") {
            Some(abs) => format!("include {}/{abs}\n", root.display()),
            None => format!("{l}\n"),
        })
        .collect();
    fs::write(makefile, fixed).map_err(|e| format!("{}: {e}", makefile.display()))
}

/// The module must carry the fetched kernel's `vermagic` (the guest's `insmod` refuses it
/// otherwise): compared with `rdma_rxe.ko`'s.
fn check_vermagic(f: &Fetched, ko: &Path) -> Result<(), String> {
    let rxe = modules::module_path(f, "rdma_rxe")?;
    let want = modules::modinfo(&rxe, "vermagic")?;
    let got = modules::modinfo(ko, "vermagic")?;
    if want.is_some() && want == got {
        Ok(())
    } else {
        Err(format!(
            "the built siw.ko has vermagic {got:?}, the kernel's modules {want:?}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packages_follow_the_kernel_release() {
        assert_eq!(
            packages("6.1.0-57-amd64").unwrap(),
            Packages {
                source: "linux-source-6.1".into(),
                headers: vec![
                    "linux-headers-6.1.0-57-amd64".into(),
                    "linux-headers-6.1.0-57-common".into(),
                    "linux-kbuild-6.1".into(),
                ],
            }
        );
        assert!(packages("weird").is_err());
    }

    #[test]
    fn absolute_links_become_relative_inside_the_root() {
        assert_eq!(
            inside(
                Path::new("lib/modules/6.1.0-57-amd64"),
                Path::new("/usr/src/linux-headers-6.1.0-57-amd64")
            ),
            PathBuf::from("../../../usr/src/linux-headers-6.1.0-57-amd64")
        );
        assert_eq!(
            inside(Path::new(""), Path::new("/usr/lib/x")),
            PathBuf::from("usr/lib/x")
        );
    }
}
