//! Builds the guest's initramfs (an uncompressed newc cpio written here, no host `cpio` needed)
//! and reuses it while its inputs are unchanged (`initramfs.stamp`: the fetched packages, the
//! `/init` text, the file and module lists and this builder's format version).
//!
//! Layout: usr-merged (`/bin`, `/sbin`, `/lib`, `/lib64` are links into `/usr`), busybox-static,
//! iproute2's `ip` and `rdma` in `/usr/sbin`, rdma-core tools, perftest, the rxe and siw
//! providers and their driver files, every library those binaries (and a Rust test binary)
//! load, and the kernel modules in load order as `/usr/lib/modules/testbed/NN-name.ko`, `siw`
//! (built by [`super::siw`]) among them.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use super::fetch::{self, Fetched};
use super::modules::{modinfo, module_index, norm};
use super::script;
use super::siw::Siw;

/// Bump when the layout or contents change in a way the other inputs do not show.
const FORMAT: &str = "testbed-initramfs v2";

/// Guest tools copied from the unpacked packages into `/usr/bin`.
const TOOLS: &[&str] = &[
    "ibv_devices",
    "ibv_devinfo",
    "ibv_rc_pingpong",
    "ib_send_bw",
    "ib_write_bw",
    "ib_read_bw",
    "ib_send_lat",
    "ib_write_lat",
    "ib_read_lat",
    "rping",
];

/// Modules in load order (from the bed's established facts); the dependencies each module
/// declares (`depends=` in its .modinfo) are loaded before it automatically.
const MODULES: &[&str] = &[
    "crc32_generic",
    "crc32-pclmul",
    "configfs",
    "udp_tunnel",
    "ip6_udp_tunnel",
    "ib_core",
    "ib_uverbs",
    "rdma_rxe",
    "ib_umad",
    "ib_cm",
    "iw_cm",
    "rdma_cm",
    "rdma_ucm",
    // soft-iWARP, after rxe. siw computes its CRCs through the crypto API's "crc32c"
    // (libcrc32c's `softdep=pre: crc32c`, which no `depends=` shows): its provider first.
    "crc32c_generic",
    "libcrc32c",
    "siw",
    "virtio_ring",
    "virtio",
    "virtio_pci_legacy_dev",
    "virtio_pci_modern_dev",
    "virtio_pci",
    "virtio_net",
    "9pnet",
    "9pnet_virtio",
    "netfs",
    "fscache",
    "9p",
    "dummy",
    "veth",
];

const LIB_DIR: &str = "usr/lib/x86_64-linux-gnu";

/// The rdma-core providers of the guest's devices (`lib<name>-rdmav*.so` and
/// `/etc/libibverbs.d/<name>.driver`): soft-RoCE and soft-iWARP.
const PROVIDERS: &[&str] = &["rxe", "siw"];

/// A built initramfs.
#[derive(Debug)]
pub struct Initramfs {
    /// The cpio archive.
    pub path: PathBuf,
    /// Sonames present in the image (a test binary needing others gets them through the share).
    pub libs: BTreeSet<String>,
}

/// Returns the initramfs, building it only when an input changed.
pub fn ensure(f: &Fetched, siw: &Siw, cache: &Path) -> Result<Initramfs, String> {
    let path = cache.join("initramfs.cpio");
    let stamp_path = cache.join("initramfs.stamp");
    let libs_path = cache.join("initramfs.libs");
    let init = script::init_script();
    let stamp = format!(
        "{FORMAT}\n{}\nsiw:\n{}tools={TOOLS:?}\nmodules={MODULES:?}\nproviders={PROVIDERS:?}\ninit:\n{init}",
        f.stamp, siw.stamp
    );
    if path.is_file() && fs::read_to_string(&stamp_path).is_ok_and(|s| s == stamp) {
        if let Ok(list) = fs::read_to_string(&libs_path) {
            return Ok(Initramfs {
                path,
                libs: list.lines().map(str::to_owned).collect(),
            });
        }
    }
    let started = std::time::Instant::now();
    let _ = fs::remove_file(&stamp_path);
    let mut image = Image::default();
    for d in [
        "usr/bin",
        "usr/sbin",
        "usr/lib64",
        LIB_DIR,
        "etc",
        "proc",
        "sys",
        "dev",
        "tmp",
    ] {
        image.dir(d);
    }
    for d in ["run", "var", "root", "mnt/host", "usr/lib/modules/testbed"] {
        image.dir(d);
    }
    for (link, target) in [
        ("bin", "usr/bin"),
        ("sbin", "usr/sbin"),
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
    ] {
        image.symlink(link, target);
    }
    image.char_dev("dev/console", 5, 1);
    image.data("init", init.into_bytes(), 0o755);
    image.data(
        "etc/passwd",
        b"root:x:0:0:root:/root:/bin/sh\n".to_vec(),
        0o644,
    );
    image.data("etc/group", b"root:x:0:\n".to_vec(), 0o644);
    image.data("etc/hosts", b"127.0.0.1 localhost\n".to_vec(), 0o644);

    let root = &f.root;
    let busybox = root.join("bin/busybox");
    image.file("usr/bin/busybox", &busybox, 0o755)?;
    image.symlink("usr/bin/sh", "busybox");

    let mut elves: Vec<PathBuf> = Vec::new();
    for tool in TOOLS {
        let src = root.join("usr/bin").join(tool);
        image.file(&format!("usr/bin/{tool}"), &src, 0o755)?;
        elves.push(src);
    }
    for tool in ["ip", "rdma"] {
        let src = ["usr/sbin", "sbin", "usr/bin", "bin"]
            .iter()
            .map(|d| root.join(d).join(tool))
            .find(|p| p.is_file() && !p.is_symlink())
            .ok_or_else(|| format!("iproute2's `{tool}` not found in {}", root.display()))?;
        image.file(&format!("usr/sbin/{tool}"), &src, 0o755)?;
        elves.push(src);
    }
    for provider in PROVIDERS {
        elves.push(add_provider(&mut image, root, provider)?);
    }
    // The Rust runtime's libraries (libgcc_s, libc, libm...) as a Rust test binary loads them.
    if let Ok(me) = std::env::current_exe() {
        elves.push(me);
    }
    // Loaded with dlopen by sideway / rdma-core, so ldd of the tools may not name them all.
    for lib in ["libibverbs.so.1", "librdmacm.so.1"] {
        let src = root.join(LIB_DIR).join(lib);
        image.file(&format!("{LIB_DIR}/{lib}"), &src, 0o644)?;
        elves.push(src);
    }

    let mut libs = BTreeSet::new();
    for elf in &elves {
        for (soname, src) in shared_libs(f, elf)? {
            if soname.starts_with("ld-linux") {
                image.file(&format!("usr/lib64/{soname}"), &src, 0o755)?;
            } else {
                image.file(&format!("{LIB_DIR}/{soname}"), &src, 0o644)?;
            }
            libs.insert(soname);
        }
    }

    let modules = module_order(f, siw)?;
    for (i, (name, src)) in modules.iter().enumerate() {
        image.file(
            &format!("usr/lib/modules/testbed/{i:02}-{name}.ko"),
            src,
            0o644,
        )?;
    }

    let tmp = path.with_extension("tmp");
    let size = image.write(&tmp)?;
    fs::rename(&tmp, &path).map_err(|e| format!("{}: {e}", path.display()))?;
    let list: String = libs.iter().map(|l| format!("{l}\n")).collect();
    fs::write(&libs_path, list).map_err(|e| format!("{}: {e}", libs_path.display()))?;
    fs::write(&stamp_path, stamp).map_err(|e| format!("{}: {e}", stamp_path.display()))?;
    eprintln!(
        "testbed: built {} ({:.1} MiB, {} modules, {} libraries) in {:.1}s",
        path.display(),
        size as f64 / (1024.0 * 1024.0),
        modules.len(),
        libs.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(Initramfs { path, libs })
}

/// Adds rdma-core's provider `name` (`lib<name>-rdmav*.so` and its driver file); returns the
/// library, whose own libraries the caller adds.
fn add_provider(image: &mut Image, root: &Path, name: &str) -> Result<PathBuf, String> {
    let providers = root.join(LIB_DIR).join("libibverbs");
    let prefix = format!("lib{name}-");
    let lib = fs::read_dir(&providers)
        .map_err(|e| format!("{}: {e}", providers.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
        })
        .ok_or_else(|| format!("lib{name} (ibverbs-providers) not unpacked"))?;
    let file = lib
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    image.file(&format!("{LIB_DIR}/libibverbs/{file}"), &lib, 0o644)?;
    image.file(
        &format!("etc/libibverbs.d/{name}.driver"),
        &root.join(format!("etc/libibverbs.d/{name}.driver")),
        0o644,
    )?;
    Ok(lib)
}

/// (soname, resolved file) of every shared library `elf` loads, including the dynamic loader;
/// empty for a static binary. Fails when one cannot be found.
pub fn shared_libs(f: &Fetched, elf: &Path) -> Result<Vec<(String, PathBuf)>, String> {
    let out = Command::new("ldd")
        .arg(elf)
        .env("LD_LIBRARY_PATH", f.lib_path())
        .output()
        .map_err(|e| format!("ldd: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // "not a dynamic executable"
        return Ok(Vec::new());
    }
    let mut libs = Vec::new();
    let mut missing = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if let Some((name, rest)) = line.split_once(" => ") {
            let path = rest.split(" (").next().unwrap_or("").trim();
            if path == "not found" || path.is_empty() {
                missing.push(name.to_owned());
            } else {
                libs.push((name.to_owned(), PathBuf::from(path)));
            }
        } else if line.starts_with('/') {
            // the loader: "/lib64/ld-linux-x86-64.so.2 (0x...)"
            let path = line.split(" (").next().unwrap_or("");
            let name = Path::new(path)
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            libs.push((name, PathBuf::from(path)));
        }
    }
    if missing.is_empty() {
        Ok(libs)
    } else {
        Err(format!(
            "{}: libraries not found: {}",
            elf.display(),
            missing.join(", ")
        ))
    }
}

/// [`MODULES`] with their declared dependencies first, as (name, file); built-in ones skipped.
/// `siw` is the module built on the host.
fn module_order(f: &Fetched, siw: &Siw) -> Result<Vec<(String, PathBuf)>, String> {
    let dir = fetch::modules_dir(&f.root, &f.kver).ok_or("no modules directory")?;
    let mut index = module_index(f)?;
    index.insert("siw".into(), siw.ko.clone());
    let builtin: BTreeSet<String> = fs::read_to_string(dir.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.rsplit('/').next())
        .filter_map(|n| n.strip_suffix(".ko"))
        .map(norm)
        .collect();

    fn visit(
        name: &str,
        index: &BTreeMap<String, PathBuf>,
        builtin: &BTreeSet<String>,
        seen: &mut BTreeSet<String>,
        out: &mut Vec<(String, PathBuf)>,
    ) -> Result<(), String> {
        let key = norm(name);
        if !seen.insert(key.clone()) {
            return Ok(());
        }
        let Some(path) = index.get(&key) else {
            if builtin.contains(&key) {
                return Ok(());
            }
            return Err(format!(
                "kernel module `{name}` is neither a module nor built in"
            ));
        };
        for dep in depends(path)? {
            visit(&dep, index, builtin, seen, out)?;
        }
        out.push((key, path.clone()));
        Ok(())
    }

    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for m in MODULES {
        visit(m, &index, &builtin, &mut seen, &mut out)?;
    }
    Ok(out)
}

/// The `depends=` list of a module's .modinfo.
fn depends(ko: &Path) -> Result<Vec<String>, String> {
    Ok(modinfo(ko, "depends")?
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect())
}

enum Content {
    Dir,
    Data(Vec<u8>),
    File(PathBuf),
    Symlink(String),
    CharDev(u32, u32),
}

/// The archive's entries by path (later additions of the same path are ignored).
#[derive(Default)]
struct Image {
    entries: BTreeMap<String, (Content, u32)>,
}

impl Image {
    fn add(&mut self, path: &str, content: Content, mode: u32) {
        self.entries
            .entry(path.trim_start_matches('/').to_owned())
            .or_insert((content, mode));
    }
    fn dir(&mut self, path: &str) {
        let mut acc = String::new();
        for part in path.split('/') {
            if !acc.is_empty() {
                acc.push('/');
            }
            acc.push_str(part);
            self.add(&acc, Content::Dir, 0o040755);
        }
    }
    fn parents(&mut self, path: &str) {
        if let Some(parent) = Path::new(path).parent().and_then(|p| p.to_str()) {
            if !parent.is_empty() {
                self.dir(parent);
            }
        }
    }
    fn data(&mut self, path: &str, data: Vec<u8>, perm: u32) {
        self.parents(path);
        self.add(path, Content::Data(data), 0o100000 | perm);
    }
    fn file(&mut self, path: &str, src: &Path, perm: u32) -> Result<(), String> {
        if !src.is_file() {
            return Err(format!("missing {}", src.display()));
        }
        self.parents(path);
        self.add(path, Content::File(src.to_path_buf()), 0o100000 | perm);
        Ok(())
    }
    fn symlink(&mut self, path: &str, target: &str) {
        self.add(path, Content::Symlink(target.to_owned()), 0o120777);
    }
    fn char_dev(&mut self, path: &str, major: u32, minor: u32) {
        self.add(path, Content::CharDev(major, minor), 0o020600);
    }

    /// Writes a newc cpio; parents sort before their children (BTreeMap order: "a" < "a/b").
    fn write(&self, out: &Path) -> Result<u64, String> {
        let file = fs::File::create(out).map_err(|e| format!("{}: {e}", out.display()))?;
        let mut w = CpioWriter {
            out: BufWriter::new(file),
            ino: 1,
            written: 0,
        };
        for (path, (content, mode)) in &self.entries {
            let (data, rdev) = match content {
                Content::Dir => (Vec::new(), (0, 0)),
                Content::Data(d) => (d.clone(), (0, 0)),
                Content::File(src) => (
                    fs::read(src).map_err(|e| format!("{}: {e}", src.display()))?,
                    (0, 0),
                ),
                Content::Symlink(t) => (t.as_bytes().to_vec(), (0, 0)),
                Content::CharDev(ma, mi) => (Vec::new(), (*ma, *mi)),
            };
            w.entry(path, *mode, &data, rdev)
                .map_err(|e| format!("{}: {e}", out.display()))?;
        }
        w.entry("TRAILER!!!", 0, &[], (0, 0))
            .and_then(|()| w.out.flush())
            .map_err(|e| format!("{}: {e}", out.display()))?;
        Ok(w.written)
    }
}

struct CpioWriter {
    out: BufWriter<fs::File>,
    ino: u32,
    written: u64,
}

impl CpioWriter {
    fn entry(
        &mut self,
        name: &str,
        mode: u32,
        data: &[u8],
        rdev: (u32, u32),
    ) -> std::io::Result<()> {
        let nlink = if mode & 0o170000 == 0o040000 { 2 } else { 1 };
        let namesize = name.len() + 1;
        let header = format!(
            "070701{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}",
            self.ino,
            mode,
            0,
            0,
            nlink,
            0,
            data.len(),
            0,
            0,
            rdev.0,
            rdev.1,
            namesize,
            0
        );
        self.ino += 1;
        self.put(header.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }
    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.written += b.len() as u64;
        self.out.write_all(b)
    }
    fn pad(&mut self) -> std::io::Result<()> {
        let n = (4 - (self.written % 4) as usize) % 4;
        self.put(&[0; 3][..n])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpio_entries_are_aligned_and_terminated() {
        let dir = std::env::temp_dir().join(format!("tb-cpio-{}", std::process::id()));
        let _ = fs::create_dir_all(&dir);
        let out = dir.join("t.cpio");
        let mut img = Image::default();
        img.data("a/b", b"hello".to_vec(), 0o644);
        img.dir("a");
        img.symlink("c", "a/b");
        let n = img.write(&out).unwrap();
        let bytes = fs::read(&out).unwrap();
        assert_eq!(n as usize, bytes.len());
        assert_eq!(bytes.len() % 4, 0);
        assert!(bytes.starts_with(b"070701"));
        let text = String::from_utf8_lossy(&bytes);
        // the directory comes before its child, the trailer last
        assert!(text.find("a\0").unwrap() < text.find("a/b\0").unwrap());
        assert!(text.contains("TRAILER!!!"));
        let _ = fs::remove_dir_all(&dir);
    }
}
