//! A socket's send queue, read with `ioctl(SIOCOUTQ)`: neither rustix nor
//! socket2 offers it. Part of the binary, not of the library, which has no
//! `unsafe`; installed with `listen::stall::send_queue_with`.

use std::os::fd::{AsRawFd as _, BorrowedFd};

/// The bytes written to a TCP socket and not yet acknowledged by its peer
/// (`SIOCOUTQ`, Linux's `TIOCOUTQ`), or `None` if the kernel would not say.
pub fn send_queue(socket: BorrowedFd<'_>) -> Option<usize> {
    let mut queued: libc::c_int = 0;
    // SAFETY: `socket` is an open descriptor for the borrow's length, and
    // `TIOCOUTQ` writes one `int` to the pointer, which points at one.
    let done = unsafe { libc::ioctl(socket.as_raw_fd(), libc::TIOCOUTQ, &mut queued) };
    (done == 0).then(|| usize::try_from(queued).ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read as _, Write as _};
    use std::os::fd::AsFd as _;

    #[test]
    fn a_queue_unread_by_the_peer_is_counted_and_an_empty_one_is_zero() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut ours = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut theirs, _) = listener.accept().unwrap();
        assert_eq!(send_queue(ours.as_fd()), Some(0));
        ours.write_all(&[7; 1000]).unwrap();
        let mut got = [0; 1000];
        theirs.read_exact(&mut got).unwrap();
        // Read by the peer, hence acknowledged (on loopback, at once or
        // within the next few polls).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while send_queue(ours.as_fd()) != Some(0) {
            assert!(std::time::Instant::now() < deadline, "never acknowledged");
            std::thread::yield_now();
        }
        // Not a socket: no answer.
        let file = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(send_queue(file.as_fd()), None);
    }
}
