//! The kernel package's modules: where each one's `.ko` is, and what its `.modinfo` says.
//! Read by the initramfs (which modules to load, in which order) and by the siw build
//! (whose module must match the kernel's `vermagic`).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use super::fetch::{self, Fetched};

/// A module's name as the index keys it (`-` and `_` are the same to the kernel).
pub fn norm(name: &str) -> String {
    name.replace('-', "_")
}

/// The kernel package's modules by (normalised) name.
pub fn module_index(f: &Fetched) -> Result<BTreeMap<String, PathBuf>, String> {
    let dir = fetch::modules_dir(&f.root, &f.kver).ok_or("no modules directory")?;
    let mut index: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut stack = vec![dir.join("kernel")];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).map_err(|e| format!("{}: {e}", d.display()))? {
            let p = e.map_err(|e| e.to_string())?.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Some(stem) = p.file_name().and_then(|n| n.to_str()) {
                if let Some(name) = stem.strip_suffix(".ko") {
                    index.insert(norm(name), p.clone());
                } else if stem.ends_with(".ko.xz") || stem.ends_with(".ko.zst") {
                    return Err(format!(
                        "compressed kernel modules ({stem}) are not supported by the bed yet"
                    ));
                }
            }
        }
    }
    Ok(index)
}

/// The file of the kernel package's module `name`.
pub fn module_path(f: &Fetched, name: &str) -> Result<PathBuf, String> {
    module_index(f)?
        .remove(&norm(name))
        .ok_or_else(|| format!("the kernel package has no module `{name}`"))
}

/// The value of `key` in a module's .modinfo (`key=value\0` strings), as `modinfo -F key`.
pub fn modinfo(ko: &Path, key: &str) -> Result<Option<String>, String> {
    let data = fs::read(ko).map_err(|e| format!("{}: {e}", ko.display()))?;
    let key = format!("\0{key}=");
    let key = key.as_bytes();
    let Some(pos) = data.windows(key.len()).position(|w| w == key) else {
        return Ok(None);
    };
    let rest = &data[pos + key.len()..];
    let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    Ok(Some(String::from_utf8_lossy(&rest[..end]).into_owned()))
}
