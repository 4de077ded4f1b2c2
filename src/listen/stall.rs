//! A caller connection whose writes make no progress for `write_timeout`
//! fails, so that what it holds (a response body, the upstream slot and
//! connection behind it) is let go.
//!
//! Why: a caller that stops reading a large response keeps its response
//! body, its upstream connection and its in-flight slot for ever; enough of
//! them shed every other caller as `overloaded`. Only a write that stays
//! pending for the whole `write_timeout`, with the socket's send queue no
//! shorter at its end than at its start, is cut: the kernel wakes a waiting
//! write only once about a third of the send buffer is free, so a caller
//! reading slowly leaves it waiting for long, and what it did read shows in
//! the queue alone. The queue is read through the binary's hook
//! ([`send_queue_with`]); without it, a write pending `write_timeout` is cut.
//!
//! A connection let go while a write waits, for this or any other reason,
//! is reset (`WriteStall`'s drop, see [`CallerSocket`]): what the kernel still held
//! for it is dropped, not sent on for as long as the caller keeps its end
//! open. One closed with its writes done but some of them still queued is
//! kept past the close and judged by the same rule ([`super::closing`]),
//! with the kernel's coarser bound behind it ([`CallerSocket::bound_close`]).

use std::io;
use std::os::fd::{AsFd as _, BorrowedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::observe::metrics::Traffic;
use crate::wire::stamp::Stamp;

/// What the connection's owner can read of its writes.
#[derive(Debug, Default)]
pub struct Writes {
    /// When bytes last went out: a connection asked to close that sends
    /// nothing is not waited for (see `drain::Watched`).
    last: Stamp,
    /// The latest write or flush is waiting for the caller to read.
    blocked: AtomicBool,
    /// Bytes came in since the owner last cleared this: on an HTTP/1.1
    /// connection, the start of a request still under way.
    heard: AtomicBool,
    /// What a read left waiting is, for [`WriteStall`]'s head timer: one of
    /// `NO_HEAD`, `HEAD` (timed once bytes of it came) and `HEAD_NOW` (timed
    /// whatever came).
    head_due: std::sync::atomic::AtomicU8,
    /// The listener's counts of bytes in and out.
    pub traffic: Arc<Traffic>,
    /// Bytes in and out not yet added to `traffic`: the listener's counts
    /// are shared by every connection, and an add to them on each read and
    /// write bounced their cache line between the workers. Written by the
    /// connection's task alone; added every [`FLUSH_AT`] bytes and when the
    /// connection ends.
    unflushed: [AtomicU64; 2],
    /// Bytes written in all; written by the connection's task alone.
    sent: AtomicU64,
    /// `sent` at the memory bound's last look, and the looks in a row that
    /// found less progress than it asks (see `listen::pressure`): written
    /// by the looks alone.
    mark: AtomicU64,
    slow_looks: std::sync::atomic::AtomicU32,
    /// Cut under memory pressure (see `listen::pressure`): its writes fail.
    cut: AtomicBool,
    /// The connection's task, as the latest write or read left pending
    /// registered it: woken when cut, and when a read's wait becomes timed
    /// ([`Writes::await_rest`]). Reads and writes are polled by the one
    /// task that drives the connection.
    waker: atomic_waker::AtomicWaker,
}

impl Writes {
    pub fn new(traffic: Arc<Traffic>) -> Self {
        Self {
            last: Stamp::default(),
            blocked: AtomicBool::new(false),
            heard: AtomicBool::new(false),
            head_due: std::sync::atomic::AtomicU8::new(NO_HEAD),
            traffic,
            unflushed: Default::default(),
            sent: AtomicU64::new(0),
            mark: AtomicU64::new(0),
            slow_looks: Default::default(),
            cut: AtomicBool::new(false),
            waker: Default::default(),
        }
    }

    pub fn last(&self) -> Instant {
        self.last.last()
    }

    /// Whether the latest write or flush is pending: bytes are still on
    /// their way out.
    pub fn blocked(&self) -> bool {
        self.blocked.load(Ordering::Relaxed)
    }

    /// Whether bytes came in since [`Writes::unhear`].
    pub fn heard(&self) -> bool {
        self.heard.load(Ordering::Acquire)
    }

    pub fn unhear(&self) {
        self.heard.store(false, Ordering::Release);
    }

    /// Whether what the caller sends next is a request's head (`true`
    /// between exchanges, `false` once a head is whole): a read left
    /// waiting inside one counts toward `header_read_timeout`.
    pub fn await_head(&self, due: bool) {
        let due = if due { HEAD } else { NO_HEAD };
        self.head_due.store(due, Ordering::SeqCst);
    }

    /// What the caller sends next is the rest of a body no one reads, and
    /// then a head: timed as a head is, from the first read left waiting,
    /// whether bytes came or not.
    pub fn await_rest(&self) {
        self.head_due.store(HEAD_NOW, Ordering::SeqCst);
        // The read may be waiting already, untimed.
        self.waker.wake();
    }

    fn head_under_way(&self) -> bool {
        match self.head_due.load(Ordering::SeqCst) {
            HEAD => self.heard(),
            HEAD_NOW => true,
            _ => false,
        }
    }

    /// Counts `n` bytes read (`SENT`: written) in the listener's traffic,
    /// at the latest when the connection ends.
    fn count(&self, which: usize, n: usize) {
        if which == SENT {
            let sent = self.sent.load(Ordering::Relaxed);
            self.sent
                .store(sent.wrapping_add(n as u64), Ordering::Relaxed);
        }
        let held = &self.unflushed[which];
        let total = held.load(Ordering::Relaxed).saturating_add(n as u64);
        if total < FLUSH_AT {
            held.store(total, Ordering::Relaxed);
            return;
        }
        held.store(0, Ordering::Relaxed);
        self.traffic.add(which == SENT, total);
    }

    /// One look at the progress of writes since the last: the looks in a
    /// row, this one included, that found fewer than `least` bytes written
    /// (0 when this one found more).
    pub fn slow_looks(&self, least: u64) -> u32 {
        let sent = self.sent.load(Ordering::Relaxed);
        let before = self.mark.swap(sent, Ordering::Relaxed);
        match sent.wrapping_sub(before) < least {
            true => self
                .slow_looks
                .fetch_add(1, Ordering::Relaxed)
                .saturating_add(1),
            false => {
                self.slow_looks.store(0, Ordering::Relaxed);
                0
            }
        }
    }

    /// Makes the connection's pending and later writes fail, and wakes the
    /// task waiting on one.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// Whether [`cut`](Self::cut) was called.
    pub fn is_cut(&self) -> bool {
        self.cut.load(Ordering::Acquire)
    }
}

impl Drop for Writes {
    fn drop(&mut self) {
        for (which, held) in self.unflushed.iter().enumerate() {
            let n = held.load(Ordering::Relaxed);
            if n > 0 {
                self.traffic.add(which == SENT, n);
            }
        }
    }
}

/// [`Writes::head_due`]'s states.
const NO_HEAD: u8 = 0;
const HEAD: u8 = 1;
const HEAD_NOW: u8 = 2;

/// Which of [`Writes`]' unflushed counts.
const RECEIVED: usize = 0;
const SENT: usize = 1;

/// Bytes a connection counts before it adds them to its listener's.
const FLUSH_AT: u64 = 64 * 1024;

/// How the bytes in a socket's send queue are read (the binary:
/// `SIOCOUTQ`); until it is installed, nothing reads them.
static SEND_QUEUE: OnceLock<fn(BorrowedFd<'_>) -> Option<usize>> = OnceLock::new();

/// Installs how a socket's send queue is read: the bytes written to it
/// and not yet acknowledged by the caller.
pub fn send_queue_with(read: fn(BorrowedFd<'_>) -> Option<usize>) {
    let _ = SEND_QUEUE.set(read);
}

/// The bytes in `fd`'s send queue, if the binary installed how they are
/// read.
pub(crate) fn queue_of(fd: BorrowedFd<'_>) -> Option<usize> {
    SEND_QUEUE.get().and_then(|read| read(fd))
}

/// A caller's transport: its close can drop what the caller has not
/// read, and its kernel send queue can be read.
pub trait CallerSocket {
    /// Makes the coming close abortive (`SO_LINGER` 0: a reset): a
    /// connection cut for reading nothing would otherwise keep its whole
    /// send queue in the kernel, closing, for as long as its caller keeps
    /// its end open (250 KiB a connection, outside any count).
    fn abort_on_close(&self);

    /// The bytes in the socket's send queue, if they can be read.
    fn send_queue(&self) -> Option<usize>;

    /// Gives what the coming close leaves queued `within` to go out: the
    /// kernel drops the connection once its caller's window has stayed
    /// shut (or what was sent gone unacknowledged) that long
    /// (`TCP_USER_TIMEOUT`). Without it, an answer closed to a caller that
    /// reads none of it stays queued, outside any count, for as long as the
    /// caller acks the kernel's window probes. Set at the close only: on an open
    /// connection the kernel's count restarts only when the window opens by
    /// a whole segment (64 KiB on loopback), so it would cut callers that
    /// read slowly but steadily.
    fn bound_close(&self, within: Duration);

    /// A second descriptor of the socket, to keep it past the close while
    /// its queue goes out ([`super::closing`]).
    fn second(&self) -> Option<std::os::fd::OwnedFd>;
}

impl CallerSocket for tokio::net::TcpStream {
    fn abort_on_close(&self) {
        let _ = socket2::SockRef::from(self).set_linger(Some(Duration::ZERO));
    }

    fn bound_close(&self, within: Duration) {
        let ms = u32::try_from(within.as_millis()).unwrap_or(u32::MAX).max(1);
        let _ = rustix::net::sockopt::set_tcp_user_timeout(self, ms);
    }

    fn send_queue(&self) -> Option<usize> {
        queue_of(self.as_fd())
    }

    fn second(&self) -> Option<std::os::fd::OwnedFd> {
        self.as_fd().try_clone_to_owned().ok()
    }
}

impl<S: CallerSocket> CallerSocket for tokio_rustls::server::TlsStream<S> {
    fn abort_on_close(&self) {
        self.get_ref().0.abort_on_close();
    }

    fn send_queue(&self) -> Option<usize> {
        self.get_ref().0.send_queue()
    }

    fn bound_close(&self, within: Duration) {
        self.get_ref().0.bound_close(within);
    }

    fn second(&self) -> Option<std::os::fd::OwnedFd> {
        self.get_ref().0.second()
    }
}

pin_project! {
    /// Also times a request's head on an HTTP/1.1 connection (see
    /// [`WriteStall::timing_heads`]): hyper's own header timer is made anew
    /// (a boxed timer in the runtime's wheel) for every request, read
    /// whole in one go or not; this one is armed only for a head that did
    /// not come whole, and is made once for a connection.
    pub struct WriteStall<T: CallerSocket> {
        #[pin]
        inner: T,
        writes: Arc<Writes>,
        timeout: Duration,
        stall: Stall,
        // Armed while a read waits in the middle of a head; made on the
        // first such wait only.
        head_timer: Option<Pin<Box<Sleep>>>,
        head_armed: bool,
        // `header_read_timeout` in milliseconds (0: heads not timed): small,
        // as what every idle connection keeps is.
        head_timeout_ms: u32,
    }

    /// A connection let go while its latest write waits for the caller to
    /// read (cut for it, closed outright after lingering, given up at the
    /// end of a drain) is reset: what it queued is dropped, not sent on
    /// for as long as the caller keeps its end open. One closed with its
    /// writes done but some of them still queued is kept while they go out,
    /// for as long as its caller reads ([`super::closing`]).
    impl<T: CallerSocket> PinnedDrop for WriteStall<T> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            let transport = this.inner.as_ref().get_ref();
            if this.writes.blocked.load(Ordering::Relaxed) {
                transport.abort_on_close();
                return;
            }
            let queued = transport.send_queue();
            if queued == Some(0) {
                return;
            }
            // Kept, and counted, while the caller reads what is queued, and
            // judged as an open connection's writes are; the kernel's
            // coarser bound behind it, as on an open one.
            let kept = match (queued, transport.second()) {
                (Some(queued), Some(second)) => super::closing::keep(second, queued, *this.timeout),
                _ => false,
            };
            transport.bound_close(match kept {
                true => this.timeout.saturating_mul(2),
                false => *this.timeout,
            });
        }
    }
}

impl<T: CallerSocket> WriteStall<T> {
    pub fn new(inner: T, timeout: Duration, writes: Arc<Writes>) -> Self {
        Self {
            inner,
            writes,
            timeout,
            stall: Stall::default(),
            head_timer: None,
            head_armed: false,
            head_timeout_ms: 0,
        }
    }

    /// Fails a read once it has waited `header_read_timeout` inside one
    /// request's head ([`Writes::await_head`] tells where heads are): the
    /// clock starts at the first read of a head that waits, so a caller
    /// sending a head a byte at a time, or part of one and then nothing,
    /// is cut then; a head read whole arms nothing.
    pub fn timing_heads(mut self, header_read_timeout: Duration) -> Self {
        let ms = header_read_timeout
            .as_millis()
            .clamp(1, u128::from(u32::MAX));
        self.head_timeout_ms = u32::try_from(ms).unwrap_or(u32::MAX);
        self
    }

    /// Stops timing heads: the connection switched protocols.
    pub fn untimed_heads(&mut self) {
        self.head_timeout_ms = 0;
        self.head_armed = false;
    }

    pub fn get_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

/// A pending write's timer. Small: every connection keeps one.
#[derive(Default)]
struct Stall {
    /// Armed while a write is pending; made on the first stall only.
    timer: Option<Pin<Box<Sleep>>>,
    stalled: bool,
    /// The socket's send queue at the last look (`UNREAD`: not read).
    queued: u32,
    /// Looks in a row that found it no shorter.
    quiet: u8,
}

/// [`Stall::queued`] when the queue could not be read.
const UNREAD: u32 = u32::MAX;

/// How many looks at the send queue a `write_timeout` takes: the caller's
/// kernel takes what fits its receive buffer in the first moments of a
/// wait, and a single look at the end would count that as the caller
/// reading (a caller reading nothing was cut at twice `write_timeout`).
const LOOKS: u8 = 4;

/// Turns a pending write into an error once the caller has taken nothing
/// of the socket's send queue for `timeout` (`LOOKS` looks in a row; if
/// the queue cannot be read, once the write has been pending `timeout`).
fn watch<R, T: CallerSocket>(
    polled: Poll<io::Result<R>>,
    timeout: Duration,
    stall: &mut Stall,
    writes: &Writes,
    cx: &mut Context<'_>,
    transport: &T,
) -> Poll<io::Result<R>> {
    if polled.is_ready() {
        if stall.stalled {
            stall.stalled = false;
            writes.blocked.store(false, Ordering::Relaxed);
        }
        return polled;
    }
    // Registered before the flag is read: a cut made in between wakes it.
    writes.waker.register(cx.waker());
    if writes.is_cut() {
        transport.abort_on_close();
        return Poll::Ready(Err(io::Error::other(
            "cut: the caller read nothing while memory ran short",
        )));
    }
    let look = timeout / u32::from(LOOKS);
    let now = Instant::now();
    let timer = stall
        .timer
        .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(now + timeout)));
    if !stall.stalled {
        stall.stalled = true;
        writes.blocked.store(true, Ordering::Relaxed);
        stall.queued = read_queue(transport);
        stall.quiet = 0;
        let first = if stall.queued == UNREAD {
            timeout
        } else {
            look
        };
        timer.as_mut().reset(now + first);
    }
    loop {
        if timer.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        let queued = read_queue(transport);
        // The caller took some of what was queued: it reads.
        match queued < stall.queued {
            true => stall.quiet = 0,
            false => stall.quiet = stall.quiet.saturating_add(1),
        }
        stall.queued = queued;
        if queued == UNREAD || stall.quiet >= LOOKS {
            // The write is still pending (`blocked`): the drop resets it.
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the caller read nothing for write_timeout",
            )));
        }
        timer.as_mut().reset(Instant::now() + look);
    }
}

/// The socket's send queue, or [`UNREAD`].
fn read_queue(transport: &impl CallerSocket) -> u32 {
    transport
        .send_queue()
        .and_then(|queued| u32::try_from(queued).ok())
        .map_or(UNREAD, |queued| queued.min(UNREAD - 1))
}

use std::future::Future as _;

impl<T: AsyncRead + CallerSocket> AsyncRead for WriteStall<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        let polled = this.inner.poll_read(cx, buf);
        let read = buf.filled().len().saturating_sub(before);
        if read > 0 {
            this.writes.heard.store(true, Ordering::Release);
            this.writes.count(RECEIVED, read);
        }
        match (polled, *this.head_timeout_ms) {
            (Poll::Pending, 1..) => {
                let timeout = Duration::from_millis(u64::from(*this.head_timeout_ms));
                head_wait(this.head_timer, this.head_armed, timeout, this.writes, cx)
            }
            (polled, _) => polled,
        }
    }
}

/// A read left pending: an error if it is inside a head that has waited
/// `timeout` since its first pending read.
fn head_wait(
    timer: &mut Option<Pin<Box<Sleep>>>,
    armed: &mut bool,
    timeout: Duration,
    writes: &Writes,
    cx: &mut Context<'_>,
) -> Poll<io::Result<()>> {
    // Registered before the state is read: a change made in between wakes it.
    writes.waker.register(cx.waker());
    if !writes.head_under_way() {
        *armed = false;
        return Poll::Pending;
    }
    if !*armed {
        *armed = true;
        let deadline = Instant::now() + timeout;
        match timer {
            Some(timer) => timer.as_mut().reset(deadline),
            None => *timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
        }
    }
    match timer.as_mut().map(|timer| timer.as_mut().poll(cx)) {
        Some(Poll::Ready(())) => Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the request's head did not come whole within header_read_timeout",
        ))),
        _ => Poll::Pending,
    }
}

impl<T: AsyncWrite + CallerSocket> AsyncWrite for WriteStall<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut this = self.project();
        let polled = this.inner.as_mut().poll_write(cx, buf);
        if let Poll::Ready(Ok(n @ 1..)) = polled {
            this.writes.last.touch();
            this.writes.count(SENT, n);
        }
        watch(
            polled,
            *this.timeout,
            this.stall,
            this.writes,
            cx,
            this.inner.as_ref().get_ref(),
        )
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut this = self.project();
        let polled = crate::wire::gathered(bufs, |flat| this.inner.as_mut().poll_write(cx, flat))
            .unwrap_or_else(|| this.inner.as_mut().poll_write_vectored(cx, bufs));
        if let Poll::Ready(Ok(n @ 1..)) = polled {
            this.writes.last.touch();
            this.writes.count(SENT, n);
        }
        watch(
            polled,
            *this.timeout,
            this.stall,
            this.writes,
            cx,
            this.inner.as_ref().get_ref(),
        )
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut this = self.project();
        let polled = this.inner.as_mut().poll_flush(cx);
        watch(
            polled,
            *this.timeout,
            this.stall,
            this.writes,
            cx,
            this.inner.as_ref().get_ref(),
        )
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().inner.poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    impl super::CallerSocket for tokio::io::DuplexStream {
        fn abort_on_close(&self) {}

        fn send_queue(&self) -> Option<usize> {
            None
        }

        fn bound_close(&self, _: Duration) {}

        fn second(&self) -> Option<std::os::fd::OwnedFd> {
            None
        }
    }

    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test(start_paused = true)]
    async fn a_write_pending_for_the_whole_timeout_fails_and_a_slow_one_does_not() {
        // A pipe with room for 64 bytes that nobody reads.
        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut w = WriteStall::new(ours, Duration::from_secs(1), Arc::default());
        w.write_all(&[0u8; 64]).await.unwrap();
        let started = Instant::now();
        let err = w.write_all(&[0u8; 64]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(1));

        // A reader that takes 64 bytes every 600 ms: slow, never stalled.
        let (ours, mut theirs2) = tokio::io::duplex(64);
        drop(theirs.shutdown().await);
        let reader = tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut buf = [0u8; 64];
            let mut total = 0;
            while total < 640 {
                tokio::time::sleep(Duration::from_millis(600)).await;
                total += theirs2.read(&mut buf).await.unwrap();
            }
        });
        let mut w = WriteStall::new(ours, Duration::from_secs(1), Arc::default());
        w.write_all(&[0u8; 640]).await.unwrap();
        reader.await.unwrap();
    }

    #[tokio::test]
    async fn a_cut_fails_the_pending_write_at_once() {
        let (ours, _theirs) = tokio::io::duplex(64);
        let writes = Arc::new(Writes::default());
        let mut w = WriteStall::new(ours, Duration::from_secs(3600), writes.clone());
        w.write_all(&[0u8; 64]).await.unwrap();
        let pending = tokio::spawn(async move { w.write_all(&[0u8; 64]).await });
        // The write is pending once the connection says it is blocked.
        while !writes.blocked() {
            tokio::task::yield_now().await;
        }
        writes.cut();
        let err = pending.await.unwrap().unwrap_err();
        assert!(err.to_string().contains("cut"), "{err}");
    }
}
