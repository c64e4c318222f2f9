//! The model: resolved config ([config]) and the CPU reference forward pass.
//!
//! - `ops`: matmul over row-major `[out, in]` weights, norms, activations.
//! - `weights`: binding logical tensor names to dequantized f32 weights.
//! - `attention`, `gdn`, `moe`: the three blocks (model-spec.md §2.3-2.5).
//! - `forward`: [`Model`], per-sequence [`SeqState`] and the forward pass (§2.2).
//! - `mtp`: the MTP block (§3.1) and its state.

pub mod config;

pub mod attention;
pub mod forward;
pub mod gdn;
pub mod moe;
pub mod mtp;
pub mod ops;
pub mod weights;

#[cfg(test)]
pub(crate) mod testutil;
#[cfg(test)]
mod tests;

pub use config::{LayerKind, ModelConfig};
pub use forward::{ForwardOut, LayerState, LogitRows, Model, SeqState};
pub use mtp::MtpState;
pub use weights::ModelError;
