//! Build script: the herdguard binary is linked with `src/hot-text.ld`,
//! which puts the functions a proxy runs next to each other at the start of
//! its code, ahead of what only a rare path or another command uses. The
//! kernel maps a binary's code in by the 64 KiB around each page that runs,
//! so code that ran spread over the whole binary kept most of it resident:
//! 6.2-6.6 MiB of a 10.1-10.8 MiB peak under load; packed, 4.2 of 8.1-8.6
//! (README, "Memory"). `benches/hot-text.sh` writes the script.
//!
//! Only when the linker is LLD: Rust's own on x86_64 Linux since 1.90, when
//! the toolchain ships it (rustup's do; a distribution's may not), or chosen
//! with `-fuse-ld=lld`. GNU ld also takes the script, but matched its
//! patterns for 12 minutes where LLD takes a second; mold does not take
//! such scripts. `HERDGUARD_HOT_TEXT=0` links without it (say so when the
//! linker is swapped behind rustc's back, as `mold -run` does), `=1` with it
//! whatever the linker.

use std::env;
use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=src/hot-text.ld");
    println!("cargo::rerun-if-env-changed=HERDGUARD_HOT_TEXT");
    let wanted = match env::var("HERDGUARD_HOT_TEXT").as_deref() {
        Ok("0") => false,
        Ok("1") => true,
        _ => linker_is_lld(),
    };
    if wanted {
        // Tells tests/memory.rs to look for the packed code in the binary.
        println!("cargo::rustc-env=HERDGUARD_HOT_TEXT_LINKED=1");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/hot-text.ld");
        // Two arguments, so that no character of the path is read as a separator.
        println!("cargo::rustc-link-arg-bin=herdguard=-T");
        println!("cargo::rustc-link-arg-bin=herdguard={}", script.display());
    }
}

/// Whether this build links with LLD: asked for in RUSTFLAGS, or Rust's
/// default for the target (x86_64 Linux from 1.90, with the `rust-lld` the
/// toolchain ships) and no other linker named.
fn linker_is_lld() -> bool {
    let flags = env::var("CARGO_ENCODED_RUSTFLAGS").unwrap_or_default();
    let flags: Vec<&str> = flags.split('\x1f').collect();
    if flags.iter().any(|f| f.ends_with("-fuse-ld=lld")) {
        return true;
    }
    let other_linker = env::var_os("RUSTC_LINKER").is_some()
        || flags
            .iter()
            .any(|f| f.contains("-fuse-ld=") || f.contains("linker=") || f.contains("linker-f"));
    let default_target = env::var("TARGET").is_ok_and(|t| t == "x86_64-unknown-linux-gnu");
    !other_linker
        && default_target
        && rustc_minor().is_some_and(|minor| minor >= 90)
        && ships_lld().unwrap_or(false)
}

/// The output of the rustc building this crate, run with `args`.
fn rustc(args: &[&str]) -> Option<String> {
    let rustc = env::var_os("RUSTC")?;
    let out = Command::new(rustc).args(args).output().ok()?;
    String::from_utf8(out.stdout).ok()
}

/// Whether the toolchain has the LLD that rustc links with by default
/// (`<sysroot>/lib/rustlib/<host>/bin/gcc-ld/ld.lld`).
fn ships_lld() -> Option<bool> {
    let sysroot = rustc(&["--print", "sysroot"])?;
    let host = env::var("HOST").ok()?;
    let lld = Path::new(sysroot.trim())
        .join("lib/rustlib")
        .join(host)
        .join("bin/gcc-ld/ld.lld");
    Some(lld.exists())
}

/// The minor version of the rustc building this crate (`1.95.0` -> 95).
fn rustc_minor() -> Option<u32> {
    let text = rustc(&["-vV"])?;
    let release = text.lines().find_map(|l| l.strip_prefix("release: "))?;
    let mut parts = release.split('.');
    match (parts.next(), parts.next()) {
        (Some("1"), Some(minor)) => minor.parse().ok(),
        _ => None,
    }
}
