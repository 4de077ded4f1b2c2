//! One bound on the memory of the whole process (`listen.max_memory`), for
//! what the per-request bounds cannot see: answers that callers do not
//! read, each holding a response's buffers (up to about 150 KiB: what the
//! upstream sent that is not yet written, the caller connection's send
//! buffer or its HTTP/2 stream's), times as many requests as every
//! upstream's limits let in together.
//!
//! What Envoy's overload manager does for its heap, for this one resource:
//! the bytes allocated and not freed are read at every new connection and
//! request, and every [`TICK`], with what the kernel holds behind answers
//! (see [`Bound`]); past the bound, memory is under pressure until they are
//! back under nine tenths of it. Under pressure:
//! - new requests are answered 503 at once (`overloaded`, marked
//!   [`Crowded::Memory`](crate::wire::Crowded)) and count nothing upstream;
//! - new connections are refused at the door (`refuse_at_the_door`):
//!   what hyper builds for a connection costs more than the refusal, and
//!   thousands opened within one look would otherwise pass the bound;
//! - connections whose caller has read nothing for [`STALLED`] while an
//!   answer waits are closed outright: every one whose writes are blocked
//!   (its socket full; HTTP/1 ones once less than 4 KiB a look went out
//!   for two seconds, as callers that read in bursts leave their windows
//!   shut for over a second), and, oldest first, a share of the HTTP/2
//!   connections with streams open and nothing written (their windows
//!   shut), or less than 40 KiB a second a stream for a second (windows
//!   granted a trickle at a time). A request still waiting for its
//!   upstream is not cut: its connection has nothing queued;
//! - a quarter of the connections idle for [`STALLED`] or more, the
//!   longest idle first, are asked to close (HTTP/2: GOAWAY): thousands of
//!   pooled connections alone can hold memory past the bound, and refusing
//!   their requests would free none of it.
//!
//! The measure is the binary's ([`measure_with`]): the library alone (a
//! test's server) has no bound, as the process is not its own.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::futures::Notified;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use crate::listen::drain::{Conduct, Open};

/// How often memory is looked at.
pub const TICK: Duration = Duration::from_millis(100);

/// How long a caller may have read nothing, with an answer waiting, before
/// its connection is cut under pressure.
pub const STALLED: Duration = Duration::from_secs(1);

/// The share of stalled HTTP/2 connections with open windows cut per tick
/// (at least one): their streams may be waiting for a slow upstream rather
/// than for their caller, so they go a few at a time, oldest first, while
/// memory stays short.
const H2_SHARE: usize = 8;

/// Looks in [`STALLED`].
const STALLED_LOOKS: u32 = (STALLED.as_millis() / TICK.as_millis()) as u32;

/// Looks under pressure with nothing cut before the bound is said to be
/// too low for the config (ten seconds).
const STUCK_LOOKS: u32 = 100;

/// An HTTP/2 connection with answers streaming that writes less than this
/// per stream per look (40 KiB/s a stream), for [`SLOW_LOOKS`] looks in a
/// row, trickles: it is cut as one with its windows shut is.
const TRICKLE_PER_STREAM: u64 = 4 * 1024;
const SLOW_LOOKS: u32 = 10;

/// An HTTP/1 connection whose writes wait is cut once this many looks in a
/// row found less than [`TRICKLE_PER_STREAM`] written: two seconds. The
/// kernel wakes a waiting write only once a third of the send buffer is
/// free: a caller that reads less than that within two seconds is cut.
/// (Three seconds let through-answers fill past a 24 MiB bound by half.)
const H1_SLOW_LOOKS: u32 = 20;

/// The share of idle connections asked to close per tick (at least one).
const IDLE_SHARE: usize = 4;

static MEASURE: OnceLock<fn() -> usize> = OnceLock::new();

/// Memory is under pressure now: the one flag every request reads.
static UNDER_PRESSURE: AtomicBool = AtomicBool::new(false);

/// Memory is short for the answers already admitted: they take nothing
/// more from their upstreams ([`wait_for_memory`]). Pressure counts, on
/// top, what the kernel holds behind the answers that wait: it refuses
/// new work until they are through, but waking them is what frees it.
static SHORT: AtomicBool = AtomicBool::new(false);

/// Installs how the bytes the process has in use are read (the binary:
/// its allocator's count). Until then, nothing is bounded.
pub fn measure_with(measure: fn() -> usize) {
    let _ = MEASURE.set(measure);
}

/// The bytes the process has in use now, if they are measured.
pub fn in_use() -> Option<usize> {
    MEASURE.get().map(|measure| measure())
}

/// The bound in force (0: none), for the look every admission takes.
static BOUND: AtomicUsize = AtomicUsize::new(0);

/// What the kernel may hold for each answer on its way (see
/// [`Bound::per_answer`]), as the bound counts it.
static PER_ANSWER: AtomicUsize = AtomicUsize::new(0);

/// What the kernel may hold for each answer waiting for memory (see
/// [`Bound::per_waiting`]).
static PER_WAITING: AtomicUsize = AtomicUsize::new(0);

/// What the kernel may hold for each HTTP/1 request body not yet read (see
/// [`Bound::per_upload`]).
static PER_UPLOAD: AtomicUsize = AtomicUsize::new(0);

/// HTTP/1 requests whose bodies are not yet read to their end. (HTTP/2
/// callers send only what their windows allow.)
static UPLOADS: AtomicUsize = AtomicUsize::new(0);

/// An HTTP/1 request's body is now to be read (or no longer).
pub(crate) fn uploading(unread: bool) {
    match unread {
        true => UPLOADS.fetch_add(1, Ordering::Relaxed),
        false => UPLOADS.fetch_sub(1, Ordering::Relaxed),
    };
}

/// The bound on memory, from the running config.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bound {
    /// Bytes in use past which memory is short (0: none).
    pub max: u64,
    /// Kernel bytes counted in use for each answer whose last data waits
    /// to be written (its caller's send buffer and its upstream
    /// connection's receive buffer, full at worst): the container's limit
    /// counts socket buffers too.
    pub per_answer: usize,
    /// Kernel bytes counted in use for each answer waiting for memory: its
    /// upstream connection's receive buffer, full at worst (or twice what
    /// is left of its body, if less).
    pub per_waiting: usize,
    /// Kernel bytes counted in use for each HTTP/1 request body not yet
    /// read: its caller connection's receive buffer, full at worst (an
    /// upstream that does not read, or a request waiting for a slot).
    pub per_upload: usize,
}

/// Bytes in use as answers count them: allocated, and the kernel buffers
/// behind each answer that holds some for its caller.
fn counted(measure: fn() -> usize) -> usize {
    let answers = HOLDING.load(Ordering::Relaxed);
    measure()
        .saturating_add(answers.saturating_mul(PER_ANSWER.load(Ordering::Relaxed)))
        .saturating_add(super::closing::held())
}

/// Bytes in use as admission counts them: [`counted`], the upstream
/// receive queues behind the answers waiting for memory, and the caller
/// receive queues of the HTTP/1 request bodies not yet read.
fn committed(counted: usize) -> usize {
    let uploads = UPLOADS.load(Ordering::Relaxed);
    counted
        .saturating_add(WAITING_BYTES.load(Ordering::Relaxed))
        .saturating_add(uploads.saturating_mul(PER_UPLOAD.load(Ordering::Relaxed)))
}

/// Answers whose last frame went to their connection and that have not
/// been asked for the next: it waits to be written (a caller that reads
/// slowly or not at all, or one being served now).
static HOLDING: AtomicUsize = AtomicUsize::new(0);

fn hold(holds: bool) {
    match holds {
        true => HOLDING.fetch_add(1, Ordering::Relaxed),
        false => HOLDING.fetch_sub(1, Ordering::Relaxed),
    };
}

/// Whether memory is under pressure: new connections and requests are
/// refused. Asked at each of them, it also looks at the bytes in use: a
/// burst of callers admitted between two ticks (a thousand in 100 ms) took
/// the process twice past the bound before the next tick saw it.
pub fn under_pressure() -> bool {
    UNDER_PRESSURE.load(Ordering::Relaxed) || past_the_bound(false)
}

/// Whether memory is short for the answers already admitted (see
/// [`SHORT`]); looks at the bytes in use too.
fn memory_short() -> bool {
    SHORT.load(Ordering::Relaxed) || past_the_bound(true)
}

/// Memory past the bound now, as admission counts it (or as answers do,
/// `for_answers`): pressure starts at once, the next tick cuts.
fn past_the_bound(for_answers: bool) -> bool {
    let bound = BOUND.load(Ordering::Relaxed);
    let Some(&measure) = MEASURE.get().filter(|_| bound != 0) else {
        return false;
    };
    let counted = counted(measure);
    let short = counted > bound;
    if short {
        SHORT.store(true, Ordering::Relaxed);
    }
    let past = short || committed(counted) > bound;
    if past {
        UNDER_PRESSURE.store(true, Ordering::Relaxed);
    }
    match for_answers {
        true => short,
        false => past,
    }
}

/// The answer to an HTTP/1 connection refused at the door.
const DOOR_503: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
    content-type: text/plain; charset=utf-8\r\n\
    x-herdguard-error: overloaded\r\n\
    retry-after: 2\r\n\
    connection: close\r\n\
    content-length: 95\r\n\r\n\
    herdguard: memory is short (listen.max_memory): new connections are refused; try again shortly\n";

/// Connections refused at the door under pressure, not yet reported.
static REFUSED: AtomicU64 = AtomicU64::new(0);

/// Refuses a new connection while memory is short, with no connection
/// state built: HTTP/1 is answered 503 `overloaded` and closed; HTTP/2 gets
/// a GOAWAY naming no stream (none was processed: its caller may send them
/// again); TLS is closed before its handshake. What the caller already
/// sent is read and dropped for up to a second first, so that the close
/// does not reset the answer away.
pub(crate) async fn refuse_at_the_door(mut stream: tokio::net::TcpStream, h2: bool, tls: bool) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    REFUSED.fetch_add(1, Ordering::Relaxed);
    const H2: [u8; 26] = [
        0, 0, 0, 0x4, 0, 0, 0, 0, 0, // SETTINGS, empty: the server's preface
        0, 0, 8, 0x7, 0, 0, 0, 0, 0, // GOAWAY on stream 0
        0, 0, 0, 0, // last stream processed: none
        0, 0, 0, 0x7, // REFUSED_STREAM
    ];
    let answer: &[u8] = match (tls, h2) {
        (true, _) => b"",
        (false, true) => &H2,
        (false, false) => DOOR_503,
    };
    let refuse = async {
        stream.write_all(answer).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 512];
        let mut left = 64usize << 10;
        while left > 0 {
            match stream.read(&mut sink).await? {
                0 => break,
                n => left = left.saturating_sub(n),
            }
        }
        Ok::<_, std::io::Error>(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), refuse).await;
}

/// Connections refused at the door since the last call.
pub fn refused_since() -> u64 {
    REFUSED.swap(0, Ordering::Relaxed)
}

/// What one look found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Look {
    /// Bytes in use.
    pub in_use: usize,
    /// Under pressure after this look.
    pub pressed: bool,
    /// Connections cut by this look.
    pub cut: usize,
}

/// Whether `in_use` bytes are past a bound of `max` (0: none): from past
/// it until back under nine tenths of it, `was` saying which side.
fn pressed(in_use: usize, max: u64, was: bool) -> bool {
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    max > 0
        && match was {
            true => in_use >= max / 10 * 9,
            false => in_use > max,
        }
}

/// The connections of the listeners a bound watches over.
#[derive(Default)]
pub struct Pressure {
    listeners: Mutex<Vec<Open>>,
}

impl Pressure {
    /// Watches the connections of a listener too.
    pub(crate) fn watch(&self, open: &Open) {
        self.lock().push(open.clone());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Open>> {
        self.listeners.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One look with `in_use` bytes in use and a bound of `max` (0: none):
    /// sets the flag, and under pressure cuts what holds unread answers.
    pub fn look(&self, in_use: usize, max: u64, was: bool) -> Look {
        let pressed = pressed(in_use, max, was);
        let cut = if pressed { self.cut_stalled() } else { 0 };
        Look {
            in_use,
            pressed,
            cut,
        }
    }

    /// Cuts the connections stalled on their callers, and asks a share of
    /// the idle ones to close; gives back how many.
    fn cut_stalled(&self) -> usize {
        let now = Instant::now();
        let mut windows_shut: Vec<(Instant, Arc<Conduct>)> = Vec::new();
        let mut idle: Vec<(Duration, Arc<Conduct>)> = Vec::new();
        let mut cut = 0;
        for open in self.lock().iter() {
            let every = open.lock().unwrap_or_else(|e| e.into_inner());
            for conduct in every.values().filter_map(std::sync::Weak::upgrade) {
                let written = &conduct.written;
                let last = written.last();
                // Answers waiting on their upstream hold nothing for their
                // caller: a slow upstream is not a caller that reads slowly.
                let streams = conduct
                    .streaming()
                    .saturating_sub(conduct.awaiting_upstream());
                // HTTP/2 answers that trickle out (a caller granting a few
                // bytes of window at a time) hold as much as shut ones.
                // (Looked at on every connection: with no stream, the count
                // starts again.)
                let h2 = conduct.speaks_h2();
                let slow = written.slow_looks(match h2 {
                    true => TRICKLE_PER_STREAM * u64::from(streams),
                    false => TRICKLE_PER_STREAM,
                });
                let trickling = slow >= SLOW_LOOKS && streams > 0;
                if written.is_cut() || (now.saturating_duration_since(last) < STALLED && !trickling)
                {
                    continue;
                }
                if written.blocked() {
                    // An HTTP/1 caller that reads in bursts (64 KiB at a
                    // time) may leave its window shut for over a second: it
                    // is cut only after two seconds with less than 4 KiB a
                    // look out.
                    if h2 || slow >= H1_SLOW_LOOKS {
                        conduct.cut();
                        cut += 1;
                    }
                } else if streams > 0 {
                    // HTTP/1 writes nothing, unblocked, only while its
                    // answer waits on its upstream or for memory.
                    if h2 {
                        windows_shut.push((last, conduct));
                    }
                } else if conduct.streaming() == 0
                    && conduct.requests_open() == 0
                    && conduct.quiet_for() >= STALLED
                {
                    idle.push((conduct.quiet_for(), conduct));
                }
            }
        }
        windows_shut.sort_by_key(|(last, _)| *last);
        let share = windows_shut.len().div_ceil(H2_SHARE);
        for (_, conduct) in windows_shut.into_iter().take(share) {
            conduct.cut();
            cut += 1;
        }
        // Idle keep-alive connections hold their buffers (an HTTP/2 one
        // about 40 KiB): thousands of them alone can keep memory past the
        // bound, and refusing requests frees none of it. The longest idle
        // go first, a quarter a look (HTTP/2 with GOAWAY); their callers
        // connect again when they next need to.
        idle.sort_by_key(|(quiet, _)| std::cmp::Reverse(*quiet));
        let share = idle.len().div_ceil(IDLE_SHARE);
        for (_, conduct) in idle.into_iter().take(share) {
            cut += usize::from(conduct.expel_idle());
        }
        // Connections already closed with answers queued that their
        // callers do not read: by the rule for open HTTP/1 ones.
        cut + super::closing::cut_stalled(TICK * H1_SLOW_LOOKS)
    }
}

pin_project_lite::pin_project! {
    /// The body of an answer, counted in its connection's [`Conduct`]
    /// while it is being sent: an HTTP/2 connection with such answers and
    /// nothing written has them queued for a caller that gives no window;
    /// an HTTP/1 one is not idle, however long its upstream takes.
    pub struct Streaming<B> {
        #[pin]
        body: B,
        conduct: Option<Arc<Conduct>>,
        // Its last poll found nothing yet from the upstream.
        awaiting: bool,
        waiting: Waiting,
        // Its last frame was data, not yet written (see `HOLDING`).
        holding: bool,
    }

    impl<B> PinnedDrop for Streaming<B> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            ended(this.conduct, this.awaiting);
            if *this.holding {
                hold(false);
            }
        }
    }
}

/// An answer's body is over: it no longer counts as streaming.
fn ended(conduct: &mut Option<Arc<Conduct>>, awaiting: &mut bool) {
    if let Some(conduct) = conduct.take() {
        conduct.streams(false);
        if std::mem::take(awaiting) {
            conduct.awaits_upstream(false);
        }
    }
}

impl<B: http_body::Body> Streaming<B> {
    /// `resp`'s body, counted in `conduct` if the body is not empty.
    pub fn of(resp: http::Response<B>, conduct: Option<&Arc<Conduct>>) -> http::Response<Self> {
        let counted = conduct.filter(|_| !resp.body().is_end_stream()).cloned();
        if let Some(c) = &counted {
            c.streams(true);
        }
        resp.map(|body| Streaming {
            body,
            conduct: counted,
            awaiting: false,
            waiting: Waiting::default(),
            holding: false,
        })
    }
}

impl<B: http_body::Body> http_body::Body for Streaming<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        use std::task::Poll;
        let this = self.project();
        let waits = !this.waiting.let_through && {
            let left = this.body.size_hint().upper();
            wait_for_memory(this.waiting, left, cx)
        };
        let polled = match waits {
            true => Poll::Pending,
            false => this.body.poll_frame(cx),
        };
        match (&polled, this.conduct.as_ref()) {
            (Poll::Ready(None | Some(Err(_))), _) => ended(this.conduct, this.awaiting),
            // HTTP/2 polls a body only when its caller has room for more:
            // one that waits here waits on its upstream, not on its caller.
            (Poll::Pending, Some(conduct)) if !*this.awaiting => {
                *this.awaiting = true;
                conduct.awaits_upstream(true);
            }
            (Poll::Ready(Some(Ok(_))), Some(conduct)) if *this.awaiting => {
                *this.awaiting = false;
                conduct.awaits_upstream(false);
            }
            _ => {}
        }
        let holds = matches!(&polled, Poll::Ready(Some(Ok(frame))) if frame.is_data());
        if holds != *this.holding {
            *this.holding = holds;
            hold(holds);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// Wakes the answers waiting for memory ([`wait_for_memory`]).
static RELIEF: Notify = Notify::const_new();

/// How many times memory stopped being short: an answer woken with it
/// unchanged was let through.
static RELIEVED: AtomicU64 = AtomicU64::new(0);

/// Answers let through per look while memory stays short for longer than
/// [`STALLED`]: a 128th of those waiting, at least 4. The waiting
/// ones themselves may be what holds it (each its upstream's first read
/// and a chunk: a thousand of them 30 MiB), and only once let through can
/// a caller that reads nothing be told from one that reads, and cut.
const LET_THROUGH_SHARE: usize = 128;
const LET_THROUGH_AT_LEAST: usize = 4;

/// Whether an answer must wait before it takes more from its upstream:
/// while memory is short, answers take nothing more (a burst of a thousand
/// requests admitted before the bound was seen would otherwise each fill
/// their buffers past it). Woken, through `relief`, by the look that finds
/// memory no longer short; or, while it stays short with nothing to cut,
/// a few at a time, oldest first, `let_through` for good: a caller that
/// reads nothing is seen only once its answer flows. Costs one measure
/// when memory is not short. `left`: what is left of its body, if known.
fn wait_for_memory(
    waiting: &mut Waiting,
    left: Option<u64>,
    cx: &mut std::task::Context<'_>,
) -> bool {
    if waiting.relief.is_none() {
        if !memory_short() {
            return false;
        }
        // Taken into the list before memory is asked again, so that the
        // look that ends the shortage cannot be missed.
        waiting.begin(left);
        if !memory_short() {
            waiting.end();
            return false;
        }
    }
    let woken = waiting
        .relief
        .as_mut()
        .is_some_and(|notified| notified.as_mut().poll(cx).is_ready());
    if woken {
        waiting.end();
        waiting.let_through = RELIEVED.load(Ordering::Relaxed) == waiting.since;
    }
    !woken
}

/// Answers waiting for memory now.
static WAITING: AtomicUsize = AtomicUsize::new(0);

/// What the kernel may hold behind the answers waiting for memory: each
/// one's [`Bound::per_waiting`], or twice what is left of its body if less
/// (a receive queue's bytes cost the kernel up to twice their size).
static WAITING_BYTES: AtomicUsize = AtomicUsize::new(0);

/// An answer's wait for memory.
#[derive(Default)]
struct Waiting {
    relief: Option<Pin<Box<Notified<'static>>>>,
    // Memory's reliefs when the wait began.
    since: u64,
    // Let through while memory stayed short: it waits no more.
    let_through: bool,
    // What it counts in `WAITING_BYTES`.
    bytes: usize,
}

impl Waiting {
    fn begin(&mut self, left: Option<u64>) {
        self.since = RELIEVED.load(Ordering::Relaxed);
        let notified = self.relief.insert(Box::pin(RELIEF.notified()));
        notified.as_mut().enable();
        let most = PER_WAITING.load(Ordering::Relaxed);
        self.bytes = left.map_or(most, |left| {
            usize::try_from(left.saturating_mul(2)).map_or(most, |twice| twice.min(most))
        });
        WAITING.fetch_add(1, Ordering::Relaxed);
        WAITING_BYTES.fetch_add(self.bytes, Ordering::Relaxed);
    }

    fn end(&mut self) {
        if self.relief.take().is_some() {
            WAITING.fetch_sub(1, Ordering::Relaxed);
            WAITING_BYTES.fetch_sub(std::mem::take(&mut self.bytes), Ordering::Relaxed);
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.end();
    }
}

/// Wakes `n` of the answers waiting for memory, oldest first.
fn wake(n: usize) {
    (0..n).for_each(|_| RELIEF.notify_one());
}

/// Answers woken per look once memory is no longer short: an eighth of
/// those waiting, at least [`WAKE_AT_LEAST`]. All at once, a thousand
/// waiting answers took memory past the bound again at once.
const WAKE_SHARE: usize = 8;
const WAKE_AT_LEAST: usize = 16;

/// Looks at memory every [`TICK`] until `stop`, with the bound `bound()`
/// gives (the running config's), reporting each look; nothing at all if no
/// measure was installed.
pub async fn guard(
    pressure: Arc<Pressure>,
    bound: impl Fn() -> Bound,
    report: impl Fn(Look),
    mut stop: watch::Receiver<bool>,
) {
    let Some(measure) = MEASURE.get().copied() else {
        return;
    };
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut guard = Guard::default();
    loop {
        tokio::select! {
            _ = crate::listen::stopped(&mut stop) => break,
            _ = tick.tick() => {}
        }
        let bound = bound();
        PER_ANSWER.store(bound.per_answer, Ordering::Relaxed);
        PER_WAITING.store(bound.per_waiting, Ordering::Relaxed);
        PER_UPLOAD.store(bound.per_upload, Ordering::Relaxed);
        BOUND.store(
            usize::try_from(bound.max).unwrap_or(usize::MAX),
            Ordering::Relaxed,
        );
        report(guard.look(&pressure, measure, bound.max));
    }
    BOUND.store(0, Ordering::Relaxed);
    UNDER_PRESSURE.store(false, Ordering::Relaxed);
    SHORT.store(false, Ordering::Relaxed);
    RELIEF.notify_waiters();
}

/// What the guard remembers from one look to the next.
#[derive(Default)]
struct Guard {
    // Looks in a row under pressure with nothing to cut.
    stuck: u32,
    // Looks in a row with memory short for answers.
    short_for: u32,
    // Pressure as last told.
    told: bool,
}

impl Guard {
    /// One look: pressure (admission, cuts) on what is committed, the
    /// answers' shortage on what is held, and the waiting answers woken
    /// or let through.
    fn look(&mut self, pressure: &Pressure, measure: fn() -> usize, max: u64) -> Look {
        let held = counted(measure);
        let look = pressure.look(committed(held), max, UNDER_PRESSURE.load(Ordering::Relaxed));
        let short = pressed(held, max, SHORT.load(Ordering::Relaxed));
        SHORT.store(short, Ordering::Relaxed);
        UNDER_PRESSURE.store(look.pressed, Ordering::Relaxed);
        self.short_for = match short {
            true => self.short_for.saturating_add(1),
            false => 0,
        };
        let waiting = WAITING.load(Ordering::Relaxed);
        self.stuck = match look.pressed && look.cut == 0 && waiting == 0 {
            true => self.stuck.saturating_add(1),
            false => 0,
        };
        // Ten seconds past the bound with no connection to cut: what holds
        // the memory is the config itself (its routes' series), not callers.
        if self.stuck == STUCK_LOOKS {
            tracing::error!(
                in_use = look.in_use,
                max,
                "memory stays past listen.max_memory with no connection to cut, and every request is refused: raise listen.max_memory (the config itself may need more)"
            );
        }
        if !short && waiting > 0 {
            RELIEVED.fetch_add(1, Ordering::Relaxed);
            wake((waiting / WAKE_SHARE).max(WAKE_AT_LEAST).min(waiting));
        } else if short && self.short_for > STALLED_LOOKS {
            wake(
                (waiting / LET_THROUGH_SHARE)
                    .max(LET_THROUGH_AT_LEAST)
                    .min(waiting),
            );
        }
        self.tell(look, max);
        look
    }

    /// Logs where pressure starts and ends.
    fn tell(&mut self, look: Look, max: u64) {
        if look.pressed == self.told {
            return;
        }
        self.told = look.pressed;
        match look.pressed {
            true => tracing::warn!(
                in_use = look.in_use,
                max,
                "memory under pressure: new requests refused, callers that read nothing cut"
            ),
            false => tracing::info!(in_use = look.in_use, "memory pressure over"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_door_answer_is_one_whole_response() {
        let text = std::str::from_utf8(DOOR_503).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 "));
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .map(|v| v.parse::<usize>().unwrap());
        assert_eq!(length, Some(body.len()));
        assert!(head.lines().all(|l| !l.starts_with(' ')), "{head}");
    }

    #[test]
    fn an_answer_waiting_for_memory_counts_its_upstream_receive_queue() {
        // The library's tests install no measure: nothing else waits.
        PER_WAITING.store(128 << 10, Ordering::Relaxed);
        let before = committed(0);
        let (mut small, mut large, mut unknown) = Default::default();
        Waiting::begin(&mut small, Some(1000));
        Waiting::begin(&mut large, Some(10 << 20));
        Waiting::begin(&mut unknown, None);
        assert_eq!(committed(0) - before, 2000 + 2 * (128 << 10));
        drop(large);
        Waiting::end(&mut small);
        Waiting::end(&mut small);
        assert_eq!(committed(0) - before, 128 << 10);
        drop(unknown);
        assert_eq!(committed(0), before);
    }

    #[test]
    fn pressure_starts_past_the_bound_and_ends_under_nine_tenths_of_it() {
        let p = Pressure::default();
        assert!(!p.look(100, 100, false).pressed);
        assert!(p.look(101, 100, false).pressed);
        assert!(p.look(91, 100, true).pressed);
        assert!(!p.look(89, 100, true).pressed);
        // No bound.
        assert!(!p.look(usize::MAX, 0, true).pressed);
    }
}
