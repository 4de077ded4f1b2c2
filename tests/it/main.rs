//! herdguard's integration tests, one binary with a module per feature: the
//! whole proxy started in-process (or as its binary) on ephemeral loopback
//! ports, against upstreams the tests start themselves.

mod common;

mod access_log;
mod admin;
mod admission;
mod attribution;
mod backoff;
mod breaker;
mod budget;
mod cli;
mod config;
mod demo;
mod deploy;
mod discovery;
mod drain;
mod exchange;
mod exchange_body;
mod explain_and_faults;
mod fault_matrix;
mod faults;
mod forwarding;
mod fuzz;
mod grpc;
mod hedging;
mod hostile;
mod keepalive;
mod layout;
mod memory;
mod metrics_reload;
mod observability;
mod otel;
mod outlier;
mod passthrough;
mod pool;
mod pressure;
mod recovery;
mod reload;
mod retry;
mod routing;
mod tls;
mod tls_listener;
mod transparent;
mod upgrade;
