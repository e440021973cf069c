//! `cargo xtask docs`: the documentation's own checks, run by `cargo xtask test` (and so CI):
//!
//! - every relative link and image in README.md and docs/**/*.md resolves: the file exists and
//!   a `#fragment` names a heading of the target (GitHub's slug rule) or an HTML `id`/`name`;
//! - README.md stays a front page (at most [`README_MAX`] bytes) with no commit ids outside
//!   its generated results block, and each reference page (docs/**/*.md outside docs/notes/)
//!   at most [`PAGE_MAX`] bytes.
//!
//! That the README's block matches docs/results/ is `bench results check`, run as a bench test.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

/// Most bytes of README.md.
pub const README_MAX: usize = 12 * 1024;
/// Most bytes of a reference page.
pub const PAGE_MAX: usize = 20 * 1024;

/// `cargo xtask docs`.
pub fn run() -> Result<(), String> {
    let problems = check(&crate::testbed::repo_root());
    if problems.is_empty() {
        eprintln!("xtask: docs: links resolve, sizes within limits");
        Ok(())
    } else {
        Err(format!(
            "docs: {} problem(s):\n  {}",
            problems.len(),
            problems.join("\n  ")
        ))
    }
}

/// Every problem found in the repository at `root`, one line each.
pub fn check(root: &Path) -> Vec<String> {
    let mut files = vec![root.join("README.md")];
    collect_md(&root.join("docs"), &mut files);
    files.sort();
    let mut anchors: HashMap<PathBuf, Vec<String>> = HashMap::new();
    let mut problems = Vec::new();
    for file in &files {
        let Ok(text) = std::fs::read_to_string(file) else {
            problems.push(format!("{}: cannot be read", rel(root, file)));
            continue;
        };
        let name = rel(root, file);
        if name == "README.md" {
            if text.len() > README_MAX {
                problems.push(format!(
                    "README.md is {} bytes, more than {README_MAX}: move detail to docs/",
                    text.len()
                ));
            }
            for id in commit_ids(&outside_block(&text)) {
                problems.push(format!(
                    "README.md names `{id}`, a commit id, outside the generated results block"
                ));
            }
        } else if !name.starts_with("docs/notes/") && text.len() > PAGE_MAX {
            problems.push(format!(
                "{name} is {} bytes, more than {PAGE_MAX}: split it or move dated material to docs/notes/",
                text.len()
            ));
        }
        for (line, target) in links(&text) {
            if let Some(p) = broken(root, file, &target, &mut anchors) {
                problems.push(format!("{name}:{line}: link `{target}`: {p}"));
            }
        }
    }
    problems
}

fn rel(root: &Path, file: &Path) -> String {
    file.strip_prefix(root)
        .unwrap_or(file)
        .to_string_lossy()
        .into_owned()
}

fn collect_md(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect_md(&p, out);
        } else if p.extension().is_some_and(|x| x == "md") {
            out.push(p);
        }
    }
}

/// The text without the README's generated block (which may name the commit it measured).
fn outside_block(text: &str) -> String {
    match (
        text.find("<!-- BEGIN results -->"),
        text.find("<!-- END results -->"),
    ) {
        (Some(a), Some(b)) if a < b => format!("{}{}", &text[..a], &text[b..]),
        _ => text.to_string(),
    }
}

/// Words of 7 to 40 lowercase hex digits with at least one digit and one letter: what a
/// commit id looks like (outside code blocks, where hashes of other kinds may appear).
fn commit_ids(text: &str) -> Vec<String> {
    prose_lines(text)
        .flat_map(|(_, l)| {
            l.split(|c: char| !c.is_ascii_alphanumeric())
                .filter(|w| {
                    (7..=40).contains(&w.len())
                        && w.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f'))
                        && w.chars().any(|c| c.is_ascii_digit())
                        && w.chars().any(|c| c.is_ascii_alphabetic())
                })
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `(line number, line)` of the lines outside fenced code blocks.
fn prose_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let mut fenced = false;
    text.lines().enumerate().filter_map(move |(i, l)| {
        if l.trim_start().starts_with("```") {
            fenced = !fenced;
            return None;
        }
        (!fenced).then_some((i + 1, l))
    })
}

/// A line without its inline code spans.
fn without_code(line: &str) -> String {
    let mut out = String::new();
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            out.push(c);
        }
    }
    out
}

/// `(line, target)` of every inline link or image and every reference definition.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, raw) in prose_lines(text) {
        let line = without_code(raw);
        let t = line.trim_start();
        if t.starts_with('[') {
            if let Some((_, rest)) = t.split_once("]: ") {
                out.push((n, rest.split_whitespace().next().unwrap_or("").to_string()));
                continue;
            }
        }
        let b = line.as_bytes();
        let mut i = 0;
        while let Some(off) = line[i..].find("](") {
            let start = i + off + 2;
            let mut depth = 0usize;
            let mut end = start;
            while end < b.len() {
                match b[end] {
                    b'(' => depth += 1,
                    b')' if depth == 0 => break,
                    b')' => depth -= 1,
                    _ => {}
                }
                end += 1;
            }
            let inner = line[start..end].trim();
            let target = inner
                .strip_prefix('<')
                .and_then(|s| s.split_once('>').map(|(t, _)| t))
                .unwrap_or_else(|| inner.split_whitespace().next().unwrap_or(""));
            out.push((n, target.to_string()));
            i = end.min(line.len());
            if i == start {
                i += 1;
            }
        }
    }
    out
}

/// Why `target`, linked from `from`, does not resolve; `None` when it does.
fn broken(
    root: &Path,
    from: &Path,
    target: &str,
    anchors: &mut HashMap<PathBuf, Vec<String>>,
) -> Option<String> {
    if target.is_empty() {
        return Some("empty target".into());
    }
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (path, fragment) = match target.split_once('#') {
        Some((p, f)) => (p, Some(f)),
        None => (target, None),
    };
    let file = if path.is_empty() {
        from.to_path_buf()
    } else if let Some(abs) = path.strip_prefix('/') {
        root.join(abs)
    } else {
        normalize(&from.parent().unwrap_or(root).join(path))
    };
    if !file.starts_with(root) {
        return Some("points outside the repository".into());
    }
    if !file.exists() {
        return Some(format!("{} does not exist", rel(root, &file)));
    }
    let fragment = fragment?;
    if file.is_dir() || file.extension().is_none_or(|x| x != "md") {
        return None;
    }
    let ids = anchors.entry(file.clone()).or_insert_with(|| {
        std::fs::read_to_string(&file)
            .map(|t| anchor_ids(&t))
            .unwrap_or_default()
    });
    if ids.iter().any(|a| a == fragment) {
        None
    } else {
        Some(format!(
            "no heading or anchor `#{fragment}` in {}",
            rel(root, &file)
        ))
    }
}

fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// The anchors of a Markdown file: its headings' GitHub slugs (a repeated slug gets `-1`,
/// `-2`, ...) and the `id`/`name` attributes of its HTML.
fn anchor_ids(text: &str) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = Vec::new();
    for (_, line) in prose_lines(text) {
        let t = line.trim_start();
        let hashes = t.chars().take_while(|&c| c == '#').count();
        if (1..=6).contains(&hashes) && t[hashes..].starts_with(' ') {
            let base = slug(&t[hashes..]);
            let n = seen.entry(base.clone()).or_insert(0);
            out.push(if *n == 0 {
                base.clone()
            } else {
                format!("{base}-{n}")
            });
            *n += 1;
        }
        for attr in ["id=\"", "name=\""] {
            let mut rest = line;
            while let Some(i) = rest.find(attr) {
                rest = &rest[i + attr.len()..];
                if let Some(end) = rest.find('"') {
                    out.push(rest[..end].to_string());
                }
            }
        }
    }
    out
}

/// GitHub's heading slug: the heading's text (a link's text, not its target), lowercased,
/// keeping letters, digits, spaces, hyphens and underscores, spaces made hyphens.
pub fn slug(heading: &str) -> String {
    // [text](target) -> text
    let mut text = String::new();
    let mut rest = heading.trim();
    while let Some(open) = rest.find('[') {
        match rest[open..].find("](") {
            Some(mid) => {
                let close = rest[open + mid..].find(')').map(|c| open + mid + c);
                text.push_str(&rest[..open]);
                text.push_str(&rest[open + 1..open + mid]);
                rest = close.map_or("", |c| &rest[c + 1..]);
            }
            None => break,
        }
    }
    text.push_str(rest);
    text.trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The repository's own docs pass: links resolve and the pages stay within their sizes.
    #[test]
    fn the_repository_docs_pass_their_checks() {
        let problems = check(&crate::testbed::repo_root());
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn slugs_follow_github() {
        assert_eq!(
            slug("The comparison: `cargo xtask bench`"),
            "the-comparison-cargo-xtask-bench"
        );
        assert_eq!(slug("One CPU: blocking RPC"), "one-cpu-blocking-rpc");
        assert_eq!(
            slug("`poll_spin` and [the link](x.md)"),
            "poll_spin-and-the-link"
        );
        assert_eq!(
            slug("A 10 ms spin budget: 2.5x (2026-12-04)"),
            "a-10-ms-spin-budget-25x-2026-12-04"
        );
    }

    #[test]
    fn broken_links_anchors_sizes_and_commit_ids_are_found() {
        let dir = tempfile_dir();
        let root = dir.as_path();
        std::fs::create_dir_all(root.join("docs/notes")).unwrap();
        std::fs::write(
            root.join("README.md"),
            "# T\n\nsee [a](docs/a.md#how-it-works), [b](docs/a.md#nowhere), [c](docs/missing.md), \
             `[not](a link)`, [self](#t), fixed in 3a25005e.\n\n```\n[code](ignored.md) 3a25005\n```\n\
             <!-- BEGIN results -->\nat 0c51b3b\n<!-- END results -->\n",
        )
        .unwrap();
        std::fs::write(
            root.join("docs/a.md"),
            format!(
                "# A\n\n## How it works\n\n[up](../README.md#t)\n\n{}",
                "x".repeat(PAGE_MAX)
            ),
        )
        .unwrap();
        std::fs::write(
            root.join("docs/notes/2026-01-01-n.md"),
            "x".repeat(PAGE_MAX + 1),
        )
        .unwrap();
        let p = check(root);
        let has = |s: &str| p.iter().any(|l| l.contains(s));
        assert!(
            has("`docs/a.md#nowhere`: no heading or anchor `#nowhere`"),
            "{p:?}"
        );
        assert!(
            has("`docs/missing.md`: docs/missing.md does not exist"),
            "{p:?}"
        );
        assert!(has("names `3a25005e`"), "{p:?}");
        assert!(
            !has("0c51b3b"),
            "the generated block may name commits: {p:?}"
        );
        assert!(
            !has("ignored.md") && !has("a link"),
            "code is not checked: {p:?}"
        );
        assert!(has("docs/a.md is"), "{p:?}");
        assert!(!has("docs/notes/2026"), "notes have no size limit: {p:?}");
        assert_eq!(p.len(), 4, "{p:?}");
        std::fs::remove_dir_all(root).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("xtask-docs-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
