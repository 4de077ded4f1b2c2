//! Connections closed with their answer still queued in the kernel.
//!
//! A connection closed while its caller has not read all of its answer
//! leaves the rest in the kernel's send queue, outside the process: an
//! answer of 150 KiB to a caller that reads none of it holds about that
//! much for as long as the caller's window stays shut. Callers that arrive
//! steadily, ask, read nothing and keep their ends open would hold rate ×
//! `write_timeout` × answer size between them, unseen by
//! `listen.max_memory`.
//!
//! Each such socket is kept here (a second descriptor of it) and looked at
//! every [`LOOK`], by the rule an open connection's writes are judged by
//! (`listen::stall`): its queue read, it is closed once the caller has read
//! it all, and reset once the caller has read nothing of it for
//! `write_timeout` (under memory pressure, for two seconds:
//! [`cut_stalled`]). What the queues hold together counts toward
//! `listen.max_memory` ([`held`]). The kernel's own bound stays behind it
//! (`TCP_USER_TIMEOUT`, [`CallerSocket::bound_close`]).
//!
//! [`CallerSocket::bound_close`]: super::stall::CallerSocket::bound_close

use std::os::fd::{AsFd as _, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// How often the kept sockets' queues are read.
pub const LOOK: Duration = Duration::from_millis(250);

/// At most this many sockets are kept (a descriptor each); one closed
/// past it is left to the kernel's bound alone, as before there was this
/// list. It binds only where answers are small: 4,096 of 150 KiB would
/// be 600 MiB counted, far past any `max_memory` that refuses callers
/// first.
const MOST: usize = 4096;

struct Kept {
    fd: OwnedFd,
    /// Its queue at the last look.
    queued: usize,
    /// When its queue last shrank (or it was kept).
    since: Instant,
    /// `write_timeout`: how long its caller may read nothing.
    within: Duration,
}

static KEPT: Mutex<Vec<Kept>> = Mutex::new(Vec::new());
/// Bytes queued behind the kept sockets at the last look (and since added).
static HELD: AtomicUsize = AtomicUsize::new(0);
/// A task looks at the kept sockets.
static LOOKING: AtomicBool = AtomicBool::new(false);

fn kept() -> MutexGuard<'static, Vec<Kept>> {
    KEPT.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Bytes the kernel holds for connections already closed, as last looked.
pub fn held() -> usize {
    HELD.load(Ordering::Relaxed)
}

/// Keeps `fd`, a second descriptor of a caller's socket about to be
/// closed with `queued` bytes still in its send queue. Its end of the
/// connection is shut now (the close's `FIN`, sent after the queue), so
/// the caller sees the answer end as it would have. Whether it was kept
/// (not when [`MOST`] are).
pub(crate) fn keep(fd: OwnedFd, queued: usize, within: Duration) -> bool {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return false;
    };
    {
        let mut kept = kept();
        if kept.len() >= MOST {
            return false;
        }
        let _ = socket2::SockRef::from(&fd).shutdown(std::net::Shutdown::Write);
        kept.push(Kept {
            fd,
            queued,
            since: Instant::now(),
            within,
        });
        HELD.fetch_add(queued, Ordering::Relaxed);
    }
    if !LOOKING.swap(true, Ordering::AcqRel) {
        runtime.spawn(looking());
    }
    true
}

/// Under memory pressure: resets every kept socket whose queue has not
/// shrunk for `stalled`, as an open connection whose caller reads nothing
/// is cut then, rather than waiting out its `write_timeout`. Gives back
/// how many.
pub(crate) fn cut_stalled(stalled: Duration) -> usize {
    let now = Instant::now();
    let mut kept = kept();
    let before = kept.len();
    let mut held = 0usize;
    kept.retain(|k| {
        if now.saturating_duration_since(k.since) < stalled {
            held = held.saturating_add(k.queued);
            return true;
        }
        let _ = socket2::SockRef::from(&k.fd).set_linger(Some(Duration::ZERO));
        false
    });
    HELD.store(held, Ordering::Relaxed);
    before - kept.len()
}

/// Looks every [`LOOK`] while any socket is kept.
async fn looking() {
    let mut ticks = tokio::time::interval(LOOK);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        if look(Instant::now()) > 0 {
            continue;
        }
        LOOKING.store(false, Ordering::Release);
        // One kept after the look and before the flag went down found it
        // up, and started no task of its own.
        if kept().is_empty() || LOOKING.swap(true, Ordering::AcqRel) {
            return;
        }
    }
}

/// One look at every kept socket: closed once its queue is empty, reset
/// once its queue has not shrunk for its `write_timeout`. Gives back how
/// many are still kept.
fn look(now: Instant) -> usize {
    let mut kept = kept();
    let mut held = 0usize;
    kept.retain_mut(|k| {
        // Reset by the caller, or dropped by the kernel: its queue is
        // gone, though the count it gives stays.
        if !matches!(socket2::SockRef::from(&k.fd).take_error(), Ok(None)) {
            return false;
        }
        let Some(queued @ 1..) = super::stall::queue_of(k.fd.as_fd()) else {
            return false;
        };
        if queued < k.queued {
            k.since = now;
        } else if now.saturating_duration_since(k.since) >= k.within {
            let _ = socket2::SockRef::from(&k.fd).set_linger(Some(Duration::ZERO));
            return false;
        }
        k.queued = queued;
        held = held.saturating_add(queued);
        true
    });
    HELD.store(held, Ordering::Relaxed);
    kept.len()
}
