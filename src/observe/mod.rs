//! What operators see: Prometheus metrics, the access log, logging, traces.

pub mod access_log;
pub(crate) mod cpu_wait;
pub(crate) mod histogram;
pub(crate) mod metrics;
pub mod telemetry;
pub mod trace;
