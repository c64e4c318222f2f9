//! ninfer: an inference engine for Qwen3.5/3.6 hybrid mixture-of-experts models.
//!
//! A tour, in the order data flows:
//! - [`artifact`]: the `.ninfer` file (mmap reader, streaming writer, reference codecs).
//! - [`model`]: the resolved model config and the CPU reference forward pass (model-spec.md §2-3).
//! - [`backend`]: the `Backend` seam between runtime and hardware; `cpu` is the reference.
//! - [`tokenizer`]: tokenizer.json through the `tokenizers` crate, incremental detokenizing.
//! - [`runtime`]: sequences, sampling, the generation loop, the `Engine` for Rust embedding.

pub mod artifact;
pub mod backend;
pub mod model;
pub mod runtime;
pub mod tokenizer;

pub use runtime::{Engine, EngineOptions};
