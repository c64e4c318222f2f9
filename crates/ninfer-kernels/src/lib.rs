//! CUDA kernels of ninfer with typed launchers (DESIGN.md section 5).
//!
//! With the `build-cubins` feature, `build.rs` compiles `kernels/*.cu` into sm_90a and sm_120a
//! cubins plus compute_90 PTX and embeds them; [`KernelSet::load`] picks the image for the
//! device, resolves every kernel symbol, and exposes one checked launcher method per kernel.
//! Each launcher checks buffer sizes, shapes and alignment against the kernel's contract (the
//! header comment of its .cu file) before launching, and returns [`KernelError::BadArgs`]
//! instead of launching on a mismatch. Without the feature this crate is empty, so CPU-only
//! builds need no CUDA toolkit.
// Launchers mirror the parameter lists of their kernels.
#![cfg_attr(feature = "build-cubins", allow(clippy::too_many_arguments))]

#[cfg(feature = "build-cubins")]
mod attention;
#[cfg(feature = "build-cubins")]
mod embed;
#[cfg(feature = "build-cubins")]
mod experts;
#[cfg(feature = "build-cubins")]
mod fused;
#[cfg(feature = "build-cubins")]
mod gdn;
#[cfg(feature = "build-cubins")]
mod gemv;
#[cfg(feature = "build-cubins")]
mod launch;
#[cfg(feature = "build-cubins")]
mod layout;
#[cfg(feature = "build-cubins")]
mod loader;
#[cfg(feature = "build-cubins")]
mod moe;
#[cfg(feature = "build-cubins")]
mod norm;
#[cfg(feature = "build-cubins")]
mod rope;
#[cfg(feature = "build-cubins")]
mod sample;
#[cfg(feature = "build-cubins")]
mod table;

#[cfg(feature = "build-cubins")]
pub use cudarc;
#[cfg(feature = "build-cubins")]
pub use half::{bf16, f16};

#[cfg(feature = "build-cubins")]
pub use attention::{
    attention_workspace_len, AttentionBatch, AttnTiles, PagedKv, ATTN_MAX_DIM, ATTN_MAX_SPLITS,
};
#[cfg(feature = "build-cubins")]
pub use experts::{BATCH_MAX_TOKENS, GROUPED_MAX_TOKENS};
#[cfg(feature = "build-cubins")]
pub use fused::{gnorm_takes_batch, route_fold_takes, ConvTail, RouterFold, FOLD_MAX_EXPERTS, NORM_BATCH_X};
#[cfg(feature = "build-cubins")]
pub use gdn::{DeltaForm, GdnDims, SeqSlots, GDN_CHUNK, GDN_CHUNK_MIN, GDN_CONV_WIDTH, GDN_MAX_DK};
#[cfg(feature = "build-cubins")]
pub use gemv::{GemvOut, MatrixView, Weights, GEMV_MAX_BATCH};
#[cfg(feature = "build-cubins")]
pub use launch::KernelError;
#[cfg(feature = "build-cubins")]
pub use layout::nvfp4_device_word;
#[cfg(feature = "build-cubins")]
pub use loader::{ImageKind, KernelSet};
#[cfg(feature = "build-cubins")]
pub use moe::{Routing, ROUTE_MAX_EXPERTS};
#[cfg(feature = "build-cubins")]
pub use norm::Rows;
#[cfg(feature = "build-cubins")]
pub use rope::{HeadLayout, KvCacheOut, ROPE_MAX_DIM};
#[cfg(feature = "build-cubins")]
pub use sample::SamplingRow;
#[cfg(feature = "build-cubins")]
pub use table::Kernel;
