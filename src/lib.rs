//! herdguard: a sidecar retrying HTTP reverse proxy.
//!
//! The binary (`main.rs`) only parses arguments; everything else lives here so
//! tests can start the whole proxy in-process on ephemeral ports.
#![forbid(unsafe_code)]

pub mod config;
