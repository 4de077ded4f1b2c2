//! What operators see: Prometheus metrics, the access log, logging.

pub mod access_log;
pub mod metrics;
pub mod telemetry;
