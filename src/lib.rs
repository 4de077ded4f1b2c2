//! herdguard: a sidecar retrying HTTP reverse proxy.
//!
//! The binary (`main.rs`) only parses arguments; everything else lives here so
//! tests can start the whole proxy in-process on ephemeral ports.
#![forbid(unsafe_code)]

pub mod access_log;
pub mod admin;
pub mod app;
pub mod config;
pub mod demo;
pub mod drain;
pub mod h1;
pub mod metrics;
pub mod policy;
pub mod proxy;
pub mod retry;
pub mod stall;
pub mod stamp;
pub mod telemetry;
pub mod tls;
