//! herdguard: a sidecar retrying HTTP reverse proxy.
//!
//! The tree is laid out by direction, and imports between its rooms point
//! down this list only:
//! - [`app`]: the running server: binds the listeners, reloads, the admin
//!   endpoints;
//! - [`listen`]: what talks to callers: accept loop, limits, HTTP/1.1 and
//!   HTTP/2 serving, TLS, eviction, drain;
//! - [`proxy`]: the request path: route, forward, answer;
//! - [`upstream`]: what talks to upstreams: endpoints, pick, pool, one
//!   attempt and its classification, the replayable body, tunnels;
//! - [`retry`]: the one loop that sleeps and resends;
//! - [`wire`]: header rules, the caller's body and upgrade, activity stamps,
//!   shared by both sides;
//! - [`observe`]: metrics, access log, logging;
//! - [`config`]: the file, parsed and checked;
//! - [`policy`]: pure decisions: outcome, decide, backoff, budget, breaker,
//!   limit, outlier, route matching.
//!
//! The binary (`main.rs`) only parses arguments; everything else lives here so
//! tests can start the whole proxy in-process on ephemeral ports.
#![forbid(unsafe_code)]

pub mod app;
pub mod config;
pub mod demo;
pub mod listen;
pub mod observe;
pub mod policy;
pub mod proxy;
pub mod retry;
pub mod units;
pub mod upstream;
pub mod wire;
