//! The source tree's rooms import one another in one direction only: from
//! the server down through the listener, the request path, the upstream side
//! and the retry loop to the pure policies. A newcomer finds what talks to
//! callers, what talks to upstreams, what decides and what observes from the
//! tree alone, and a change that points an arrow up fails here.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The rooms of `src/`, top first: each may import only rooms after it.
const ROOMS: &[&str] = &[
    "demo", "app", "listen", "proxy", "upstream", "retry", "wire", "observe", "config", "policy",
    "units",
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The room a file of `src/` belongs to (`None` for lib.rs, main.rs and the
/// binary's own modules).
fn room_of(src: &Path, file: &Path) -> Option<&'static str> {
    let first = file.strip_prefix(src).ok()?.components().next()?;
    let name = first.as_os_str().to_str()?.trim_end_matches(".rs");
    ROOMS.iter().copied().find(|r| *r == name)
}

/// The rooms a file's code (its unit tests left out) names as `crate::ROOM`.
fn imports(text: &str) -> BTreeSet<&'static str> {
    let code = text.split("#[cfg(test)]").next().unwrap_or(text);
    let mut found = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if let Some(room) = ROOMS.iter().copied().find(|r| *r == name) {
            found.insert(room);
        }
    }
    found
}

#[test]
fn rooms_import_only_the_rooms_below_them() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let rank = |room: &str| ROOMS.iter().position(|r| *r == room).unwrap();
    let mut upward = Vec::new();
    for file in &files {
        let Some(room) = room_of(&src, file) else {
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        for target in imports(&text) {
            if rank(target) < rank(room) {
                upward.push(format!(
                    "{} ({room}) imports crate::{target}",
                    file.strip_prefix(&src).unwrap().display()
                ));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports against the layout:\n{}",
        upward.join("\n")
    );
    // Every directory and top-level file of src/ is a room, or the crate's
    // and binary's roots.
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        let known = ["lib.rs", "main.rs", "malloc.rs"].contains(&name.as_str())
            || room_of(&src, &path).is_some();
        assert!(
            known,
            "src/{name} belongs to no room (add it to ROOMS, in its place)"
        );
    }
}

#[test]
fn policies_decide_without_io() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/policy");
    let mut files = Vec::new();
    sources(&src, &mut files);
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap_or(&text);
        for io in [
            "tokio::net",
            "tokio::fs",
            "std::fs",
            "std::net::Tcp",
            "hyper::",
            "tokio::spawn",
        ] {
            assert!(!code.contains(io), "{} uses {io}", file.display());
        }
    }
}

#[test]
fn an_import_is_found_wherever_it_is_written() {
    let text = "use crate::policy::x;\nfn f() { crate::wire::g(); }\n#[cfg(test)]\nmod tests { use crate::app; }";
    assert_eq!(imports(text), BTreeSet::from(["policy", "wire"]));
}
