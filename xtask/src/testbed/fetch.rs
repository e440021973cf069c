//! `fetch`: downloads the guest kernel, QEMU and rdma-core as Debian packages into the cache,
//! unpacks them (never installs them: qemu-system-x86 conflicts with a backported qemu-utils) and
//! extracts the uncompressed kernel (`vmlinux`, booted PVH) from `vmlinuz`.
//!
//! A complete cache (`fetch.stamp` present and every file it names there) makes this a no-op.

use std::collections::BTreeSet;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::deps;

/// Packages the bed needs besides the kernel; their library dependencies that the host lacks
/// are added (see [`closure`]).
const PACKAGES: &[&str] = &[
    // QEMU (TCG): the emulator, its accelerator modules, firmware.
    "qemu-system-x86",
    "qemu-system-common",
    "qemu-system-data",
    "seabios",
    "ipxe-qemu",
    // The guest userland.
    "busybox-static",
    "iproute2",
    "libibverbs1",
    "librdmacm1",
    "ibverbs-providers",
    "ibverbs-utils",
    "rdmacm-utils",
    "perftest",
];

/// What a complete cache holds.
#[derive(Debug, Clone)]
pub struct Fetched {
    /// Every package unpacked into one tree.
    pub root: PathBuf,
    /// The kernel image QEMU boots (vmlinux, or vmlinuz if extraction was impossible).
    pub kernel: PathBuf,
    /// Kernel release, e.g. `6.1.0-57-amd64` (the modules directory name).
    pub kver: String,
    /// Contents of `fetch.stamp` (package files): an input of the initramfs stamp.
    pub stamp: String,
}

impl Fetched {
    /// The QEMU binary inside the unpacked tree.
    pub fn qemu(&self) -> PathBuf {
        self.root.join("usr/bin/qemu-system-x86_64")
    }

    /// `LD_LIBRARY_PATH` that makes the unpacked libraries visible (QEMU, ldd of guest binaries).
    pub fn lib_path(&self) -> String {
        let dirs = [
            "usr/lib/x86_64-linux-gnu",
            "lib/x86_64-linux-gnu",
            "usr/lib/x86_64-linux-gnu/libibverbs",
        ];
        dirs.iter()
            .map(|d| self.root.join(d).display().to_string())
            .collect::<Vec<_>>()
            .join(":")
    }
}

/// Makes the cache complete (downloading only when it is not) and describes it.
pub fn ensure(cache: &Path) -> Result<Fetched, String> {
    if let Some(done) = complete(cache) {
        return Ok(done);
    }
    fs::create_dir_all(cache).map_err(|e| format!("cannot create {}: {e}", cache.display()))?;
    host_tools()?;
    if crate::util::is_root() {
        // apt-cache look-ups on a fresh machine need it; cheap when the lists are current.
        crate::util::run("apt-get", &["update", "-qq"])?;
    }
    let kernel_pkg = newest_kernel()?;
    let kver = kernel_pkg
        .strip_prefix("linux-image-")
        .unwrap_or(&kernel_pkg)
        .to_owned();
    let mut roots: Vec<String> = PACKAGES.iter().map(|s| s.to_string()).collect();
    roots.push(kernel_pkg.clone());
    let all = closure(&roots)?;
    eprintln!(
        "testbed: fetching {} packages (kernel {kernel_pkg}) into {}",
        all.len(),
        cache.display()
    );

    let debs_tmp = cache.join("debs.tmp");
    let _ = fs::remove_dir_all(&debs_tmp);
    fs::create_dir_all(&debs_tmp).map_err(|e| format!("{}: {e}", debs_tmp.display()))?;
    let mut cmd = Command::new("apt-get");
    cmd.arg("download")
        .arg("-q")
        .args(&all)
        .current_dir(&debs_tmp);
    let status = cmd
        .status()
        .map_err(|e| format!("cannot run apt-get: {e}"))?;
    if !status.success() {
        return Err(format!("`apt-get download` failed ({status})"));
    }
    let debs_dir = cache.join("debs");
    let root = cache.join("root");
    let _ = fs::remove_file(cache.join("fetch.stamp"));
    let _ = fs::remove_dir_all(&debs_dir);
    let _ = fs::remove_dir_all(&root);
    fs::rename(&debs_tmp, &debs_dir).map_err(|e| format!("{}: {e}", debs_dir.display()))?;

    let mut debs: Vec<String> = fs::read_dir(&debs_dir)
        .map_err(|e| format!("{}: {e}", debs_dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".deb"))
        .collect();
    debs.sort();
    if debs.len() < all.len() {
        return Err(format!(
            "apt-get downloaded {} of {} packages",
            debs.len(),
            all.len()
        ));
    }
    fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
    for deb in &debs {
        let status = Command::new("dpkg-deb")
            .arg("-x")
            .arg(debs_dir.join(deb))
            .arg(&root)
            .status()
            .map_err(|e| format!("cannot run dpkg-deb: {e}"))?;
        if !status.success() {
            return Err(format!("`dpkg-deb -x {deb}` failed ({status})"));
        }
    }

    let vmlinuz = root.join(format!("boot/vmlinuz-{kver}"));
    let kernel = match extract_vmlinux(&vmlinuz, &cache.join("vmlinux")) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("testbed: warning: {e}; booting the compressed vmlinuz (slower)");
            vmlinuz.clone()
        }
    };
    if modules_dir(&root, &kver).is_none() {
        return Err(format!(
            "the kernel package has no modules for {kver} under {}",
            root.display()
        ));
    }

    let kernel_rel = kernel
        .strip_prefix(cache)
        .unwrap_or(&kernel)
        .display()
        .to_string();
    let mut stamp = format!("kver={kver}\nkernel={kernel_rel}\n");
    for d in &debs {
        stamp.push_str(&format!("deb={d}\n"));
    }
    let fetched = Fetched {
        root,
        kernel,
        kver,
        stamp: stamp.clone(),
    };
    check_qemu_libs(&fetched)?;
    fs::write(cache.join("fetch.stamp"), stamp).map_err(|e| format!("fetch.stamp: {e}"))?;
    Ok(fetched)
}

/// The cache as described by `fetch.stamp`, if it is complete.
fn complete(cache: &Path) -> Option<Fetched> {
    let stamp = fs::read_to_string(cache.join("fetch.stamp")).ok()?;
    let mut kver = None;
    let mut kernel = None;
    for line in stamp.lines() {
        if let Some(v) = line.strip_prefix("kver=") {
            kver = Some(v.to_owned());
        } else if let Some(v) = line.strip_prefix("kernel=") {
            kernel = Some(cache.join(v));
        } else if let Some(d) = line.strip_prefix("deb=") {
            if !cache.join("debs").join(d).is_file() {
                return None;
            }
        }
    }
    let fetched = Fetched {
        root: cache.join("root"),
        kernel: kernel?,
        kver: kver?,
        stamp,
    };
    let ok = fetched.kernel.is_file()
        && fetched.qemu().is_file()
        && fetched.root.join("bin/busybox").is_file()
        && modules_dir(&fetched.root, &fetched.kver).is_some();
    ok.then_some(fetched)
}

/// Where the kernel package put its modules.
pub fn modules_dir(root: &Path, kver: &str) -> Option<PathBuf> {
    ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|d| root.join(d).join(kver))
        .find(|p| p.join("kernel").is_dir())
}

/// Tools the fetch itself runs on the host.
fn host_tools() -> Result<(), String> {
    for tool in ["apt-get", "apt-cache", "dpkg-deb", "dpkg-query", "ldd"] {
        if !on_path(tool) {
            return Err(format!(
                "`{tool}` not found: the test bed needs a Debian/Ubuntu host"
            ));
        }
    }
    if !on_path("xz") {
        deps::ensure_packages(&["xz-utils"])?;
    }
    Ok(())
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

fn capture(cmd: &mut Command) -> Result<String, String> {
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?} failed ({})", out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The newest `linux-image-6.1.0-N-amd64` apt knows (the Debian 12 kernel ABI `N`).
fn newest_kernel() -> Result<String, String> {
    let out = capture(Command::new("apt-cache").args([
        "search",
        "--names-only",
        r"^linux-image-6\.1\.0-[0-9]+-amd64$",
    ]))?;
    out.lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|name| {
            let abi = name
                .strip_prefix("linux-image-6.1.0-")?
                .strip_suffix("-amd64")?;
            Some((abi.parse::<u32>().ok()?, name.to_owned()))
        })
        .max()
        .map(|(_, name)| name)
        .ok_or_else(|| {
            "apt knows no linux-image-6.1.0-*-amd64 package (is this Debian 12 with its \
             package lists? run `apt-get update`)"
                .to_owned()
        })
}

/// `roots` plus every `lib*` package they (transitively) depend on that the host lacks.
/// Only the first alternative of an `a | b` dependency is followed; non-library dependencies
/// (maintainer-script tools such as initramfs-tools) are not needed to run the binaries.
fn closure(roots: &[String]) -> Result<Vec<String>, String> {
    let installed = installed_packages()?;
    let mut want: BTreeSet<String> = roots.iter().cloned().collect();
    let mut frontier: Vec<String> = roots.to_vec();
    while !frontier.is_empty() {
        let out = capture(
            Command::new("apt-cache")
                .args([
                    "depends",
                    "--no-recommends",
                    "--no-suggests",
                    "--no-conflicts",
                    "--no-breaks",
                    "--no-replaces",
                    "--no-enhances",
                ])
                .args(&frontier),
        )?;
        frontier.clear();
        let mut previous_was_or = false;
        for line in out.lines() {
            let trimmed = line.trim_start();
            let is_alt = previous_was_or;
            previous_was_or = trimmed.starts_with('|');
            let Some((kind, dep)) = trimmed.trim_start_matches('|').split_once(": ") else {
                continue;
            };
            if !matches!(kind, "Depends" | "PreDepends") || is_alt || dep.starts_with('<') {
                continue;
            }
            let dep = dep.split(':').next().unwrap_or(dep).trim().to_owned();
            if dep.starts_with("lib") && !installed.contains(&dep) && want.insert(dep.clone()) {
                frontier.push(dep);
            }
        }
    }
    Ok(want.into_iter().collect())
}

fn installed_packages() -> Result<BTreeSet<String>, String> {
    let out =
        capture(Command::new("dpkg-query").args(["-W", "-f=${Package} ${db:Status-Status}\n"]))?;
    Ok(out
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(_, s)| *s == "installed")
        .map(|(p, _)| p.to_owned())
        .collect())
}

/// Finds the xz payload in a bzImage and decompresses it to an ELF vmlinux (PVH boot).
fn extract_vmlinux(vmlinuz: &Path, out: &Path) -> Result<PathBuf, String> {
    let data = fs::read(vmlinuz).map_err(|e| format!("{}: {e}", vmlinuz.display()))?;
    const XZ_MAGIC: &[u8] = &[0xfd, b'7', b'z', b'X', b'Z', 0];
    let start = data
        .windows(XZ_MAGIC.len())
        .position(|w| w == XZ_MAGIC)
        .ok_or("no xz payload in vmlinuz")?;
    let tmp = out.with_extension("tmp");
    let file = fs::File::create(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    let mut child = Command::new("xz")
        .args(["-dc", "--single-stream"])
        .stdin(Stdio::piped())
        .stdout(file)
        .spawn()
        .map_err(|e| format!("cannot run xz: {e}"))?;
    let mut stdin = child.stdin.take().ok_or("xz stdin")?;
    let payload = data[start..].to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&payload));
    let status = child.wait().map_err(|e| format!("xz: {e}"))?;
    // xz stops reading after the first stream; a broken pipe on the trailing bytes is expected.
    let _ = writer.join();
    if !status.success() {
        return Err(format!("xz failed to decompress the kernel ({status})"));
    }
    let head = fs::read(&tmp)
        .map(|d| d.get(..4).map(<[u8]>::to_vec))
        .map_err(|e| e.to_string())?;
    if head.as_deref() != Some(b"\x7fELF".as_slice()) {
        return Err("the decompressed kernel is not an ELF vmlinux".into());
    }
    fs::rename(&tmp, out).map_err(|e| format!("{}: {e}", out.display()))?;
    Ok(out.to_path_buf())
}

/// QEMU must start from the unpacked tree: every library resolved.
fn check_qemu_libs(f: &Fetched) -> Result<(), String> {
    let missing = missing_libs(f, &f.qemu())?;
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "qemu-system-x86_64 lacks libraries after unpacking: {}",
            missing.join(", ")
        ))
    }
}

/// Sonames `ldd` reports as "not found" for `bin` with the unpacked libraries visible.
pub fn missing_libs(f: &Fetched, bin: &Path) -> Result<Vec<String>, String> {
    let out = Command::new("ldd")
        .arg(bin)
        .env("LD_LIBRARY_PATH", f.lib_path())
        .output()
        .map_err(|e| format!("ldd: {e}"))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("not found"))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect())
}
