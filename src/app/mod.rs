//! Binds the listeners, runs the accept loops, and drains on shutdown.
//!
//! `start` returns once both listeners are bound, with their real addresses,
//! so tests can run the whole proxy in-process on `127.0.0.1:0`.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper::Request;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::config::tls::Tls;
use crate::config::{Config, ConfigErrors, Validated};
use crate::listen::pressure::{Pressure, Streaming};
use crate::listen::{accept_loop, local_addr, stopped, Abandoned, Limits};
use crate::observe::metrics::Metrics;
use crate::proxy::{BuildError, Caller, Proxy, Runtime};
use crate::wire::CallerBody;

mod admin;
mod reload;
pub mod threads;

pub use reload::Reloader;

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {what} address {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Invalid(#[from] ConfigErrors),
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error("listen.tls: {0}")]
    Tls(#[from] crate::config::tls::TlsError),
    #[error("listen.max_memory ({max} MiB) leaves no room: the config alone has {in_use} MiB in use, past three quarters of the bound (requests are refused past it until back under 90%); raise listen.max_memory")]
    NoRoom { max: u64, in_use: u64 },
}

/// Whether the memory bound leaves room to serve once the config is built
/// (when memory is measured: the binary): with the routes' own state past
/// where pressure ends, every request would be refused for as long as the
/// process ran.
fn room_to_serve(max: u64) -> Result<(), StartError> {
    let Some(in_use) = crate::listen::pressure::in_use() else {
        return Ok(());
    };
    let in_use = in_use as u64;
    // A quarter left for what serving takes besides (scrapes, requests):
    // pressure ends only under nine tenths.
    match max != 0 && in_use >= max / 4 * 3 {
        true => Err(StartError::NoRoom {
            max: max >> 20,
            in_use: in_use >> 20,
        }),
        false => Ok(()),
    }
}

/// State shared by the proxy and admin listeners.
pub struct Shared {
    pub proxy: Arc<Proxy>,
    /// Set once shutdown begins: /readyz turns 503.
    pub draining: AtomicBool,
    /// Held while a reload builds and swaps: one at a time, so a reload
    /// never builds on a runtime another is about to replace.
    reloading: std::sync::Mutex<()>,
    /// Held while `/metrics` is rendered: one scrape at a time.
    /// One `/metrics` render at a time, and the last page rendered.
    /// When the newest was rendered, the newest and the one before.
    pub(crate) rendering:
        Arc<tokio::sync::Mutex<Option<(std::time::Instant, admin::PageRef, admin::PageRef)>>>,
    /// The config file as the last reload from it found it, before reading
    /// it: the watcher does not reload again what a SIGHUP reloaded.
    read: std::sync::Mutex<Option<Fingerprint>>,
}

impl Shared {
    /// The config file as the last reload from it found it.
    fn last_read(&self) -> Option<Fingerprint> {
        *self.read.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A reload is about to read the config file, found as `stamp`.
    fn read_as(&self, stamp: Option<Fingerprint>) {
        *self.read.lock().unwrap_or_else(|e| e.into_inner()) = stamp;
    }

    /// A reload is about to read the config file at `path`.
    pub(super) fn reading(&self, path: &Path) {
        self.read_as(fingerprint(path));
    }
}

/// A running proxy.
pub struct Server {
    proxy_addr: SocketAddr,
    admin_addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Server {
    /// Checks `config`, builds the runtime from it, binds both listeners
    /// and starts serving.
    pub async fn start(config: Config) -> Result<Server, StartError> {
        Server::start_validated(config.validate()?).await
    }

    /// Builds the runtime from `config`, binds both listeners and starts serving.
    pub async fn start_validated(config: Validated) -> Result<Server, StartError> {
        let metrics = Metrics::with_buckets(&config.config().metrics.latency_buckets);
        // Telemetry never takes the proxy down: an exporter that cannot
        // start (a malformed OTEL_EXPORTER_OTLP_ENDPOINT) is said, and the
        // proxy serves without it.
        let tracing = crate::observe::trace::Tracing::start(&config.config().tracing)
            .unwrap_or_else(|e| {
                tracing::error!(error = %e, "tracing is off: its exporter could not start");
                None
            });
        let runtime = Runtime::build(config, &metrics)?;
        let config = runtime.config.clone();
        room_to_serve(config.listen.max_memory)?;
        let proxy = Arc::new(Proxy::new(runtime, metrics).traced(tracing));

        let bind = |what, addr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Bind { what, addr, source })
        };
        let tls = match &config.listen.tls {
            Some(c) => Some(Tls::new(&c.cert, &c.key, c.client_ca.as_deref())?),
            None => None,
        };
        let listener = bind("listen", config.listen.address).await?;
        let admin_listener = bind("admin", config.admin.address).await?;
        let proxy_addr = local_addr(&listener);
        let admin_addr = local_addr(&admin_listener);
        proxy.listening_on(proxy_addr, admin_addr);

        let shared = Arc::new(Shared {
            proxy,
            draining: AtomicBool::new(false),
            reloading: std::sync::Mutex::new(()),
            rendering: Arc::default(),
            read: std::sync::Mutex::new(None),
        });
        let (shutdown, shutdown_rx) = watch::channel(false);
        let drain_rx = shutdown_rx.clone();
        let shutdown_rx_upkeep = shutdown_rx.clone();
        let (admin_stop, admin_stop_rx) = watch::channel(false);
        let drain_timeout = config.listen.drain_timeout;

        if let Some(tls) = &tls {
            tls.watch(Duration::from_secs(1), shutdown_rx.clone());
        }
        let proxy_loop = serve_callers(&shared, listener, tls.as_ref(), &config, shutdown_rx);
        let admin_loop = serve_admin(&shared, admin_listener, admin_stop_rx);
        let upkeep = upkeep(shared.proxy.clone(), shutdown_rx_upkeep);
        let task = tokio::spawn(run(
            shared.clone(),
            [Box::pin(proxy_loop), Box::pin(admin_loop), Box::pin(upkeep)],
            admin_stop,
            drain_rx,
            drain_timeout,
        ));
        let runtime = tokio::runtime::Handle::current();
        let scheduler = match runtime.runtime_flavor() {
            tokio::runtime::RuntimeFlavor::CurrentThread => "current-thread",
            _ => "multi-thread",
        };
        let threads = runtime.metrics().num_workers();
        info!(listen = %proxy_addr, admin = %admin_addr, routes = config.routes.len(), threads, scheduler, "herdguard serving");
        Ok(Server {
            proxy_addr,
            admin_addr,
            shared,
            shutdown,
            task,
        })
    }

    pub fn proxy_addr(&self) -> SocketAddr {
        self.proxy_addr
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    pub fn proxy(&self) -> &Arc<Proxy> {
        &self.shared.proxy
    }

    /// Replaces routes and policies with those of `config` (see [`Reloader::reload`]).
    pub fn reload(&self, config: Config) -> Result<(), BuildError> {
        self.reloader().reload(config)
    }

    /// Reads, checks and applies a config file (see [`Reloader::reload_file`]).
    pub fn reload_file(&self, path: &Path) -> Result<(), String> {
        self.reloader().reload_file(path)
    }

    /// A handle that reloads this server from other tasks (signal handlers).
    pub fn reloader(&self) -> Reloader {
        Reloader {
            shared: self.shared.clone(),
        }
    }

    /// Watches `path` and reloads when its content changes and then stays the
    /// same for one more `every` (so a file being written is not read half
    /// way). `loaded` is the file as it was before the running config was
    /// read from it ([`FileStamp::of`]): a change made while the server
    /// started is a change. Runs until the server shuts down.
    pub fn watch(&self, path: PathBuf, every: Duration, loaded: FileStamp) -> JoinHandle<()> {
        let reloader = self.reloader();
        let mut stop = self.shutdown.subscribe();
        reloader.shared.read_as(loaded.0);
        tokio::spawn(async move {
            let mut seen = loaded.0;
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stopped(&mut stop) => return,
                    _ = tick.tick() => {}
                }
                let read = path.clone();
                let now = tokio::task::spawn_blocking(move || fingerprint(&read))
                    .await
                    .ok()
                    .flatten();
                if now.is_some() && now == seen && now != reloader.shared.last_read() {
                    info!(path = %path.display(), "config file changed");
                    let _ = reloader.reload_file_in_background(path.clone()).await;
                }
                seen = now;
            }
        })
    }

    /// Waits (at most 3 s) until the file at `path` stays as it is for a
    /// quarter of a second: a SIGHUP sent while the file is being written
    /// (not swapped whole) must not load half of it.
    pub async fn settled(path: &Path) {
        let look = |path: PathBuf| async move {
            tokio::task::spawn_blocking(move || fingerprint(&path))
                .await
                .ok()
                .flatten()
        };
        let mut before = look(path.to_owned()).await;
        for _ in 0..12 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let now = look(path.to_owned()).await;
            if now == before {
                return;
            }
            before = now;
        }
    }

    /// Turns `/readyz` to 503 (what a SIGTERM does first); the listener
    /// goes on serving until [`shutdown`](Self::shutdown).
    pub fn not_ready(&self) {
        self.shared.draining.store(true, Ordering::Release);
    }

    /// `listen.drain_delay` of the running config.
    pub fn drain_delay(&self) -> Duration {
        self.shared.proxy.runtime().config.listen.drain_delay
    }

    /// Stops accepting and lets in-flight requests finish, up to `drain_timeout`.
    pub fn shutdown(&self) {
        let _ = self.shutdown.send(true);
    }

    /// Waits until the proxy has drained and both listeners are closed.
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

/// The proxy's listener: each request handed to the proxy, and its
/// connection told whether it was answered or abandoned.
fn serve_callers(
    shared: &Arc<Shared>,
    listener: TcpListener,
    tls: Option<&Tls>,
    config: &Config,
    stop: watch::Receiver<bool>,
) -> impl Future<Output = ()> + Send + 'static {
    let proxy = shared.proxy.clone();
    let tls_on = tls.is_some();
    let limits = Limits {
        tls: tls.map(|t| t.acceptor.clone()),
        max_connections: config.listen.max_connections,
        header_read_timeout: config.listen.header_read_timeout,
        write_timeout: config.listen.write_timeout,
        idle_timeout: config.listen.idle_timeout,
        drain_timeout: config.listen.drain_timeout,
        transparent: config.listen.transparent,
        traffic: counted(&proxy, "listen"),
        pressure: Some(guard_memory(&proxy, stop.clone())),
        send_buffer: match config.listen.send_buffer {
            0 => None,
            size => Some(usize::try_from(size).unwrap_or(usize::MAX)),
        },
    };
    accept_loop(
        "listen",
        listener,
        limits,
        stop,
        move |peer, original, conduct| {
            let proxy = proxy.clone();
            let caller = Arc::new(Caller::new(peer, tls_on).redirected_from(original));
            let conduct = conduct.clone();
            service_fn(move |req: Request<CallerBody>| {
                let proxy = proxy.clone();
                let caller = caller.clone();
                let conduct = conduct.clone();
                // The request on the heap, and the future boxed: hyper keeps
                // room for one request's future per connection for as long as
                // the connection lives, and an idle one needs none; see
                // `Proxy::handle` for the request.
                let req = Box::new(req);
                Box::pin(async move {
                    // Dropped unanswered only when the caller abandoned the request.
                    conduct.begun();
                    let pending = Abandoned(Some(conduct));
                    let resp = proxy.handle(req, &caller).await;
                    let conduct = pending.answered(&resp);
                    Ok::<_, Infallible>(Streaming::of(resp, conduct.as_ref()))
                })
            })
        },
    )
}

/// The bound on the process's memory (`listen.max_memory`, the running
/// config's), looked at until `stop` and reported in the metrics.
fn guard_memory(proxy: &Arc<Proxy>, stop: watch::Receiver<bool>) -> Arc<Pressure> {
    let pressure = Arc::new(Pressure::default());
    let (bound, report) = (proxy.clone(), proxy.clone());
    tokio::spawn(crate::listen::pressure::guard(
        pressure.clone(),
        move || memory_bound(&bound.runtime().config),
        move |look| {
            let refused = crate::listen::pressure::refused_since();
            report
                .metrics()
                .memory(look.in_use, look.pressed, look.cut, refused)
        },
        stop,
    ));
    pressure
}

/// The memory bound of `config`: `listen.max_memory`, and what the kernel
/// may hold for each answer on its way (its caller's send buffer, and the
/// largest receive buffer of an upstream connection behind it; each
/// doubled, as the kernel counts them).
fn memory_bound(config: &Config) -> crate::listen::pressure::Bound {
    let receive = config
        .upstreams
        .values()
        .map(|u| u.receive_buffer)
        .max()
        .unwrap_or(0);
    let kernel = |size: u64, autotuned: u64| {
        let size = match size {
            0 => autotuned,
            size => size.saturating_mul(2),
        };
        usize::try_from(size).unwrap_or(usize::MAX)
    };
    let (send_max, receive_max, receive_first) = *autotuned_buffers();
    crate::listen::pressure::Bound {
        max: config.listen.max_memory,
        per_answer: kernel(config.listen.send_buffer, send_max)
            .saturating_add(kernel(receive, receive_max)),
        per_waiting: kernel(receive, receive_max),
        per_upload: usize::try_from(receive_first).unwrap_or(usize::MAX),
    }
}

/// The largest send and receive buffers the kernel's autotuning gives a
/// TCP connection (`net.ipv4.tcp_wmem` and `tcp_rmem`, their last field),
/// and the receive buffer a connection starts with (`tcp_rmem`'s middle
/// field: what a caller's socket holds of a body nobody reads); Linux's
/// defaults if they cannot be read.
fn autotuned_buffers() -> &'static (u64, u64, u64) {
    static SIZES: std::sync::OnceLock<(u64, u64, u64)> = std::sync::OnceLock::new();
    SIZES.get_or_init(|| {
        let field = |name: &str, at: usize, default: u64| {
            std::fs::read_to_string(format!("/proc/sys/net/ipv4/{name}"))
                .ok()
                .and_then(|text| text.split_whitespace().nth(at)?.parse().ok())
                .unwrap_or(default)
        };
        (
            field("tcp_wmem", 2, 4 << 20),
            field("tcp_rmem", 2, 6 << 20),
            field("tcp_rmem", 1, 128 << 10),
        )
    })
}

/// The connections and bytes of listener `name`, counted in the metrics.
fn counted(proxy: &Proxy, name: &'static str) -> Arc<crate::observe::metrics::Traffic> {
    let traffic = Arc::default();
    proxy.metrics().listener(name, Arc::clone(&traffic));
    traffic
}

/// The admin listener. Probes and scrapes send their few bytes at once: a
/// short header time and room for many makes starving them (slowloris) cost
/// an attacker about 85 new connections a second.
fn serve_admin(
    shared: &Arc<Shared>,
    listener: TcpListener,
    stop: watch::Receiver<bool>,
) -> impl Future<Output = ()> + Send + 'static {
    let shared = shared.clone();
    let limits = Limits {
        tls: None,
        max_connections: 256,
        header_read_timeout: Duration::from_secs(3),
        write_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(10),
        drain_timeout: Duration::from_secs(1),
        transparent: false,
        traffic: counted(&shared.proxy, "admin"),
        pressure: None,
        // Probes and scrapes: small answers, read at once.
        send_buffer: None,
    };
    accept_loop("admin", listener, limits, stop, move |peer, _, conduct| {
        let shared = shared.clone();
        let conduct = conduct.clone();
        service_fn(move |req: Request<CallerBody>| {
            // A whole head came: no longer evicted for a new caller.
            conduct.heard();
            let shared = shared.clone();
            Box::pin(async move {
                let mut resp = admin::serve(&shared, peer, &req).await;
                // One request per HTTP/1 connection: probes and scrapes open
                // one each time anyway, and 256 connections kept busy with a
                // request every few seconds cannot lock the kubelet out.
                if req.version() < http::Version::HTTP_2 {
                    resp.headers_mut().insert(
                        http::header::CONNECTION,
                        http::HeaderValue::from_static("close"),
                    );
                }
                Ok::<_, Infallible>(resp)
            })
        })
    })
}

/// Upstream connections are swept once a second; discovery is looked at
/// then, and at once after a reload.
async fn upkeep(proxy: Arc<Proxy>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stopped(&mut stop) => break,
            () = proxy.swapped.notified() => proxy.runtime().discover(),
            _ = tick.tick() => {
                proxy.sweep();
                proxy.runtime().discover();
            }
        }
    }
}

/// Which file is at `path` and when it last changed, from its metadata; a
/// change to a file that cannot be a config (too large, a FIFO) is still
/// tried, and refused by the reload with its reason; a file that is gone is
/// no change.
fn fingerprint(path: &Path) -> Option<Fingerprint> {
    // Metadata only, never the content: the watcher runs every second, and a
    // file swapped for a huge one, a FIFO or a device must cost it nothing
    // (the reload it triggers reads bounded and refuses such files). The
    // symlink is followed, so a ConfigMap's `..data` swap is a new inode.
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(path).ok()?;
    Some(Fingerprint {
        device: meta.dev(),
        inode: meta.ino(),
        len: meta.len(),
        modified: (meta.mtime(), meta.mtime_nsec()),
        changed: (meta.ctime(), meta.ctime_nsec()),
    })
}

/// A config file's metadata as the watcher compares it: take it before the
/// file is read for the config the server starts with.
#[derive(Clone, Copy, Debug)]
pub struct FileStamp(Option<Fingerprint>);

impl FileStamp {
    /// The file at `path` as it is now (none: it is not there).
    pub fn of(path: &Path) -> Self {
        FileStamp(fingerprint(path))
    }
}

/// What the config watcher compares from one look to the next.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Fingerprint {
    device: u64,
    inode: u64,
    len: u64,
    modified: (i64, i64),
    changed: (i64, i64),
}

/// One of the server's long-running parts.
type Task = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// Serves until shutdown is asked for, then drains: readiness turns 503 at
/// once, the proxy's listener and upgraded connections drain (up to
/// `drain_timeout`), then the admin listener and the upkeep stop.
async fn run(
    shared: Arc<Shared>,
    [proxy_loop, admin_loop, upkeep]: [Task; 3],
    admin_stop: watch::Sender<bool>,
    mut drain_rx: watch::Receiver<bool>,
    drain_timeout: Duration,
) {
    let upkeep = tokio::spawn(upkeep);
    let admin = tokio::spawn(admin_loop);
    let draining = async {
        stopped(&mut drain_rx).await;
        shared.draining.store(true, Ordering::Release);
        // Upgraded connections have left hyper's hands: the drain waits
        // for them as for connections.
        let tunnels = shared.proxy.tunnels();
        let open = tunnels.count();
        if open > 0 {
            info!(tunnels = open, timeout = ?drain_timeout, "draining upgraded connections");
        }
        if !tunnels.closed_within(drain_timeout).await {
            warn!(
                tunnels = tunnels.count(),
                timeout = ?drain_timeout,
                "drain timeout passed with upgraded connections still open; closing them"
            );
        }
    };
    tokio::join!(proxy_loop, draining);
    let _ = admin_stop.send(true);
    let _ = admin.await;
    let _ = upkeep.await;
    // The last spans are sent before the process ends; the export they
    // wait on runs on this runtime.
    if let Some(tracing) = shared.proxy.tracing().cloned() {
        let _ = tokio::task::spawn_blocking(move || tracing.shutdown()).await;
    }
}

/// Runs `work` on a thread that ends with it, and waits for it without
/// holding up the runtime's workers. For work that frees much memory
/// (dropping a big config, rendering its series): glibc's malloc keeps up
/// to seven freed blocks of each small size for the thread that freed
/// them (its tcache), so a thread that lives on pins hundreds of blocks
/// scattered over pages that could otherwise go back to the system (the
/// blocking pool's threads, kept alive by the config watcher, did so after
/// a reload to a smaller config: docs/memory.md). A thread that ends hands
/// its blocks back.
pub(crate) async fn on_own_thread<T: Send + 'static>(
    name: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _ = tx.send(work());
        })?;
    rx.await
        .map_err(|_| std::io::Error::other("the thread ended without an answer"))
}
