//! Backends: the seam between the runtime and the hardware (DESIGN.md §5).
//!
//! A backend works at the level of a *step* (a batch of prompt chunks and decode rows), not of
//! single ops, so that a GPU backend is free to fuse kernels and capture graphs. It owns every
//! sequence's state (attention KV, GDN conv and recurrent state) in slots that the runtime
//! allocates and frees.
//! - `cpu`: the reference, f32 math over dequantized weights.
//! - `cuda` (feature `cuda`): the GPU backend over the kernels of `ninfer-kernels`.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use crate::model::ModelConfig;

/// Index of a sequence-state slot owned by the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(pub u32);

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("no free sequence slot ({0} in use)")]
    NoFreeSlot(usize),
    #[error("sequence would exceed the maximum context of {max} tokens (needs {needed})")]
    ContextFull { max: usize, needed: usize },
    #[error("unknown or released slot {0:?}")]
    BadSlot(SlotId),
    #[error("the KV pool is full: {needed} more pages needed, {free} of {total} free")]
    KvFull { needed: usize, free: usize, total: usize },
    #[error("token id {id} out of range (vocabulary {vocab})")]
    BadToken { id: u32, vocab: usize },
    #[error("{0}")]
    Model(String),
    #[error(transparent)]
    Artifact(#[from] crate::artifact::ArtifactError),
}

/// Size of a backend's KV pool, in pages of `page_size` positions (of every attention layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPool {
    pub page_size: usize,
    pub pages: usize,
    /// Pages held by live slots now.
    pub used: usize,
}

impl KvPool {
    /// Pages a sequence of `tokens` positions holds.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }

    /// Positions the whole pool holds.
    pub fn capacity(&self) -> usize {
        self.pages * self.page_size
    }
}

/// One row of a step: `tokens` are appended to the slot's sequence at its current length.
#[derive(Debug, Clone)]
pub struct StepInput<'a> {
    pub slot: SlotId,
    pub tokens: &'a [u32],
    /// Logits for every position of `tokens` (golden tests, perplexity) instead of the last only.
    pub all_logits: bool,
    /// What the caller does with the last position's logits; a backend that picks tokens on
    /// its device may return the token (`RowLogits::token`) instead of the logits.
    pub pick: Pick,
}

/// How the caller turns a row's last logits into a token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pick {
    /// It needs the logits (penalties, logprobs, golden tests).
    Logits,
    /// Their argmax (greedy decoding).
    Argmax,
    /// A token drawn from their filtered softmax with a uniform number it drew.
    Sample(SampleSpec),
}

/// The filters and the draw of `Pick::Sample`, as runtime/sampler.rs defines them: softmax at
/// `temperature` over the top-k (0: all), top-p (1: all) and min-p (0: all) survivors; the token
/// is where the running mass of the kept tokens first exceeds `u` times their total.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleSpec {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub u: f32,
}

/// Logits of one row: `rows` × vocab values, row-major; or, for a row whose pick a backend
/// makes on its device, `token` with no values.
#[derive(Debug, Clone)]
pub struct RowLogits {
    pub rows: usize,
    pub values: Vec<f32>,
    pub token: Option<u32>,
}

/// Logits of a row plus the final-normed hidden state of each of its tokens (the MTP input),
/// from the `step_with_hidden` and `mtp_step` of the backends that have an MTP block.
#[derive(Debug, Clone)]
pub struct RowOutput {
    pub logits: RowLogits,
    /// `tokens × H`, row-major.
    pub hidden: Vec<f32>,
}

pub trait Backend: Send {
    fn config(&self) -> &ModelConfig;
    /// A short name for logs and `doctor` ("cpu", "cuda:0 NVIDIA H200").
    fn name(&self) -> String;
    /// Allocates an empty sequence state.
    fn alloc_slot(&mut self) -> Result<SlotId, BackendError>;
    /// Frees a slot; its state is gone.
    fn free_slot(&mut self, slot: SlotId);
    /// Tokens already in a slot's state.
    fn slot_len(&self, slot: SlotId) -> Result<usize, BackendError>;
    /// The KV pool shared by all slots, sized at open: a slot takes pages as its sequence grows
    /// and gives them back when freed. A step that would need more pages than are free fails
    /// with `KvFull` before any state changes; the scheduler reserves pages so that it never
    /// does.
    fn kv_pool(&self) -> KvPool;
    /// Whether `Pick::Argmax` and `Pick::Sample` rows come back as tokens (picked on the device)
    /// rather than logits.
    fn picks_tokens(&self) -> bool {
        false
    }
    /// Runs the model over every row (each row's tokens continue its own sequence) and returns the
    /// logits of each row in order.
    fn step(&mut self, rows: &[StepInput<'_>]) -> Result<Vec<RowLogits>, BackendError>;
    /// As `step`, also timing each of the step's launches (`ninfer bench --profile`); backends
    /// that cannot refuse.
    fn profile_step(&mut self, rows: &[StepInput<'_>]) -> Result<(Vec<RowLogits>, Vec<LaunchTime>), BackendError> {
        let _ = rows;
        Err(BackendError::Model(format!("the {} backend cannot time its launches", self.name())))
    }
}

/// One timed span of a profiled step: a kernel launch (or a few under one label).
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchTime {
    pub label: &'static str,
    pub ms: f64,
    /// Bytes the launch must at least read or write (weights, state, cache); 0 when negligible.
    pub bytes: usize,
}
