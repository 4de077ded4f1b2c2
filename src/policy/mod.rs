//! Pure decisions: who was at fault, whether to retry and after how long,
//! whether the budget affords it, whether the breaker lets it through, how
//! the concurrency limit moves, which route a request takes. Each is a value
//! or a small state machine with the clock and the randomness passed in,
//! unit-tested without a socket. Nothing here sleeps or sends; the loop in
//! `retry/` and the proxy above it act on what these say.

pub mod backoff;
pub mod breaker;
pub mod budget;
pub mod decide;
pub mod limit;
pub mod outcome;
pub mod outlier;
pub mod paths;
pub mod retry;
pub mod route;
pub mod settings;

pub use backoff::{Backoff, BackoffState};
pub use budget::Budget;
pub use decide::{decide, Decision, Ended, Stop};
pub use outcome::{CallerFault, Fault, GrpcStatus, Outcome, Refusal, SkipReason, UpstreamFault};
pub use retry::{Policy, RequestFacts};
