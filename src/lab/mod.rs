//! `herdguard lab`: reproducible experiments that show what the retry layer
//! does to an upstream in trouble. Everything runs in-process on loopback.

pub mod backoff;
pub mod outage;
pub mod plot;
