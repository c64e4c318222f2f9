//! The model: resolved config ([config]) and the CPU reference forward pass.

pub mod config;

pub use config::{LayerKind, ModelConfig};
