//! The runtime: everything between a request and the backend (DESIGN.md §6).
//! - `sampler`: sampling parameters and the per-sequence sampler (seeded, penalties, logprobs).
//! - `stop`: stop strings matched across token boundaries without retracting text.
//! - `request`: requests in, events out, the collected `Completion`.
//! - `scheduler`: the thread that batches all running sequences into backend steps.
//! - `engine`: the `Engine` that Rust embedders, the Python bindings and the server drive.

mod engine;
pub mod request;
pub mod sampler;
mod scheduler;
pub mod stop;

pub use engine::{Device, Engine, EngineError, EngineOptions, Stream};
pub use request::{Completion, Event, EventSink, FinishReason, Usage};
pub use sampler::{SamplingParams, TokenLogprob};
pub use scheduler::Stats;

#[cfg(test)]
mod tests;
