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

/// `src/`, and every Rust file under it.
fn src_files() -> (PathBuf, Vec<PathBuf>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    (src, files)
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
    let (src, files) = src_files();
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
        let known = ["lib.rs", "main.rs", "malloc.rs", "sockets.rs"].contains(&name.as_str())
            || room_of(&src, &path).is_some();
        assert!(
            known,
            "src/{name} belongs to no room (add it to ROOMS, in its place)"
        );
    }
}

#[test]
fn policies_decide_without_io() {
    let (src, files) = src_files();
    let files = files
        .into_iter()
        .filter(|f| room_of(&src, f) == Some("policy"));
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

/// `(lines, name)` of every function in `text` (a rustfmt-formatted file),
/// its `#[cfg(test)]` modules left out.
fn function_lengths(text: &str) -> Vec<(usize, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    // The line at `from` and below that closes the block opened at `ind`.
    let close = |from: usize, ind: usize| {
        (from..lines.len())
            .find(|&j| indent(lines[j]) == ind && lines[j].trim_start().starts_with('}'))
            .unwrap_or(lines.len())
    };
    let mut found = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim_start();
        if line == "#[cfg(test)]"
            && lines
                .get(i + 1)
                .is_some_and(|l| l.trim_start().starts_with("mod "))
        {
            i = close(i + 2, indent(lines[i + 1])) + 1;
            continue;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        let fn_at = words
            .iter()
            .take_while(|w| w.starts_with("pub") || ["async", "const", "unsafe"].contains(w))
            .count();
        if words.get(fn_at) == Some(&"fn") {
            let name = words
                .get(fn_at + 1)
                .map(|n| n.split(['(', '<']).next().unwrap_or(n).to_owned())
                .unwrap_or_default();
            if line.trim_end().ends_with('}') {
                found.push((1, name));
                i += 1;
                continue;
            }
            // The signature may run over several lines: the body opens on
            // the first line ending with `{` (a declaration ends with `;`).
            let opens = (i..lines.len()).find(|&j| {
                let t = lines[j].trim_end();
                t.ends_with('{') || t.ends_with(';')
            });
            if let Some(j) = opens.filter(|&j| lines[j].trim_end().ends_with('{')) {
                let end = close(j + 1, indent(lines[i]));
                found.push((end - i + 1, name));
            }
        }
        i += 1;
    }
    found
}

/// One function, one job: none in `src/` runs past about two screens
/// (linkerd's retry loop is about 60 lines).
#[test]
fn no_function_runs_past_120_lines() {
    let (src, files) = src_files();
    let mut long = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (lines, name) in function_lengths(&text) {
            if lines > 120 {
                long.push(format!(
                    "{}: {name} ({lines} lines)",
                    file.strip_prefix(&src).unwrap().display()
                ));
            }
        }
    }
    assert!(long.is_empty(), "functions to split:\n{}", long.join("\n"));
}

#[test]
fn function_lengths_are_counted_from_signature_to_closing_brace() {
    let text = "pub(crate) async fn a(\n    x: u8,\n) -> u8 {\n    x\n}\n\nfn decl();\n\nimpl S {\n    fn b(&self) {}\n    fn c(&self) {\n    }\n}\n#[cfg(test)]\nmod tests {\n    fn long() {\n    }\n}\n";
    assert_eq!(
        function_lengths(text),
        vec![
            (5, "a".to_owned()),
            (1, "b".to_owned()),
            (2, "c".to_owned())
        ]
    );
}
