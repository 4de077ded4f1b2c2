//! Files the config names, read bounded: a "file" that is a FIFO, a device
//! or huge (`/dev/zero`, a log named by mistake) is refused before it blocks
//! a reload forever or fills memory.

use std::io::{self, Read as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

/// The whole of a regular file of at most `limit` bytes.
pub fn read_bounded(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    // Opened without waiting: opening a FIFO for reading waits for a writer.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::other(
            "is not a regular file (a FIFO, a device or a directory)",
        ));
    }
    let too_large = || match limit % (1 << 20) {
        0 => io::Error::other(format!("is larger than {} MiB", limit >> 20)),
        _ => io::Error::other(format!("is larger than {limit} bytes")),
    };
    if meta.len() > limit {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_regular_file_within_the_limit_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("small");
        std::fs::write(&file, b"12345").unwrap();
        assert_eq!(read_bounded(&file, 5).unwrap(), b"12345");
        assert!(read_bounded(&file, 4)
            .unwrap_err()
            .to_string()
            .contains("larger than"));
        assert!(read_bounded(dir.path(), 5)
            .unwrap_err()
            .to_string()
            .contains("regular file"));
        assert!(read_bounded(Path::new("/dev/zero"), 5)
            .unwrap_err()
            .to_string()
            .contains("regular file"));
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
        // Returns at once: no writer is waited for.
        assert!(read_bounded(&fifo, 5)
            .unwrap_err()
            .to_string()
            .contains("regular file"));
    }
}
