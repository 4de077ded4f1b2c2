//! herdguard's lab: reproducible experiments that show what the retry layer
//! does to an upstream in trouble. Everything runs in-process on loopback,
//! through the proxy's library; the proxy binary carries none of it (nor the
//! plotting it needs).
#![forbid(unsafe_code)]

pub mod backoff;
pub mod outage;
pub mod plot;
pub mod train;
