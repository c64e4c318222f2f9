//! The CUDA backend (DESIGN.md §5): drives the kernels of `ninfer-kernels` on one NVIDIA GPU.
//!
//! At open it loads the kernels for the card, plans every byte of device memory (weights,
//! paged KV for the full-attention layers sized for `max_slots × max_context`, GDN conv and
//! recurrent state slots, the activation workspace of the largest pass), checks the plan against
//! the free memory and allocates it; nothing is allocated per token. A step may mix decode rows
//! and prompt chunks; rows are cut into passes of at most `max_step_tokens` tokens (plan.rs) and
//! each pass runs the whole model (forward.rs). Logits come back to the host as f32, where the
//! runtime samples them.
//!
//! - `plan`: host-side pass planning and the packed per-pass tables.
//! - `weights`: the weight arena, uploaded once from the mapped artifact.
//! - `memory`: sizes and allocation of state and workspace.
//! - `forward`: the kernel launches of one pass.

mod forward;
mod memory;
mod plan;
mod weights;

use std::sync::Arc;

use ninfer_kernels::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};
use ninfer_kernels::{
    ImageKind, KernelError, KernelSet, ATTN_MAX_DIM, GDN_CONV_WIDTH, GDN_MAX_DK, ROPE_MAX_DIM, ROUTE_MAX_EXPERTS,
};

use crate::artifact::Artifact;
use crate::model::ModelConfig;

use super::{Backend, BackendError, RowLogits, SlotId, StepInput};
use forward::{run_pass, Ctx};
use memory::{alloc_tables, Dims, States, Workspace};
use plan::{pass_meta, split_passes, RowSpec};
use weights::{Arena, ModelW};

#[derive(Debug, Clone, Copy)]
pub struct CudaOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// Sequences that can be alive at once (each owns a KV run and a GDN state slot).
    pub max_slots: usize,
    /// Tokens per sequence (also capped by the model's `max_position_embeddings`).
    pub max_context: usize,
    /// Tokens of one forward pass (the activation workspace is sized for it); longer steps run
    /// as several passes.
    pub max_step_tokens: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions { device: 0, max_slots: 4, max_context: 4096, max_step_tokens: 512 }
    }
}

pub(crate) fn kern(e: KernelError) -> BackendError {
    BackendError::Model(format!("CUDA kernel: {e}"))
}

pub(crate) fn drv(what: &'static str) -> impl Fn(DriverError) -> BackendError {
    move |e| BackendError::Model(format!("CUDA driver error while {what}: {e}"))
}

/// A context on device `ordinal`, or why there is none (no driver, no such device).
fn context(ordinal: usize) -> Result<Arc<CudaContext>, BackendError> {
    // SAFETY: only tries to load the driver library; nothing else is called without it.
    if !unsafe { ninfer_kernels::cudarc::driver::sys::is_culib_present() } {
        return Err(BackendError::Model("no NVIDIA driver found (libcuda could not be loaded)".into()));
    }
    let n = CudaContext::device_count().map_err(drv("counting CUDA devices"))?;
    if n <= 0 || ordinal >= n as usize {
        return Err(BackendError::Model(format!("no CUDA device {ordinal} ({n} found)")));
    }
    CudaContext::new(ordinal).map_err(drv("creating the CUDA context"))
}

/// The name of device 0 when it is a GPU this build has kernels for; None otherwise (no
/// driver, no device, or a card older than compute capability 9.0).
pub fn supported_gpu() -> Option<String> {
    let ctx = context(0).ok()?;
    let (major, minor) = ctx.compute_capability().ok()?;
    ImageKind::for_capability(major, minor)?;
    ctx.name().ok()
}

/// Device-to-device copy bandwidth of device 0 in bytes/s (read + write counted).
pub fn copy_bandwidth() -> Result<f64, BackendError> {
    forward::copy_bandwidth(&context(0)?.default_stream())
}

/// The shapes the kernels take (their header contracts), checked once at open.
fn check_limits(c: &ModelConfig) -> Result<(), BackendError> {
    let mut bad = Vec::new();
    if !c.hidden_size.is_multiple_of(8) {
        bad.push(format!("hidden size {} (a multiple of 8)", c.hidden_size));
    }
    if !c.head_dim.is_multiple_of(8) || c.head_dim > ATTN_MAX_DIM.min(ROPE_MAX_DIM) {
        bad.push(format!("attention head dim {} (a multiple of 8, at most {ATTN_MAX_DIM})", c.head_dim));
    }
    if c.num_attention_heads / c.num_kv_heads > 32 {
        bad.push(format!("{} query heads per kv head (at most 32)", c.num_attention_heads / c.num_kv_heads));
    }
    if !c.linear_key_head_dim.is_multiple_of(8) || c.linear_key_head_dim > GDN_MAX_DK {
        bad.push(format!("GDN key head dim {} (a multiple of 8, at most {GDN_MAX_DK})", c.linear_key_head_dim));
    }
    if !c.linear_value_head_dim.is_multiple_of(8) {
        bad.push(format!("GDN value head dim {} (a multiple of 8)", c.linear_value_head_dim));
    }
    if c.linear_conv_kernel != GDN_CONV_WIDTH {
        bad.push(format!("GDN conv kernel {} (exactly {GDN_CONV_WIDTH})", c.linear_conv_kernel));
    }
    if c.num_experts > ROUTE_MAX_EXPERTS || c.num_experts_per_tok > 32 {
        bad.push(format!(
            "{} experts top-{} (at most {ROUTE_MAX_EXPERTS} experts, top-32)",
            c.num_experts, c.num_experts_per_tok
        ));
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(BackendError::Model(format!("the CUDA kernels do not take this model's {}", bad.join(", "))))
    }
}

fn gb(b: usize) -> f64 {
    b as f64 / 1e9
}

pub struct CudaBackend {
    config: ModelConfig,
    name: String,
    ks: KernelSet,
    stream: Arc<CudaStream>,
    dims: Dims,
    model: ModelW,
    arena: Arena,
    states: States,
    ws: Workspace,
    tables: CudaSlice<i32>,
    /// Tokens in each slot's sequence; None for a free slot.
    lens: Vec<Option<usize>>,
    max_context: usize,
}

impl CudaBackend {
    pub fn open(art: &Artifact, opts: CudaOptions) -> Result<Self, BackendError> {
        let text = art.component("text").ok_or_else(|| BackendError::Model("the artifact has no `text` component".into()))?;
        let config = ModelConfig::from_json(text).map_err(BackendError::Model)?;
        if opts.max_slots == 0 || opts.max_context == 0 || opts.max_step_tokens == 0 {
            return Err(BackendError::Model("max_slots, max_context and max_step_tokens must be positive".into()));
        }
        check_limits(&config)?;
        let ctx = context(opts.device)?;
        let ks = KernelSet::load(&ctx).map_err(|e| match e {
            KernelError::UnsupportedDevice { .. } => BackendError::Model(e.to_string()),
            other => kern(other),
        })?;
        let name = format!("cuda:{} {}", opts.device, ks.device_name());
        let max_context = opts.max_context.min(config.max_position_embeddings);
        let dims = Dims::new(&config, opts.max_slots, max_context, opts.max_step_tokens);
        let plan = weights::plan(art, &config)?;
        let (w, s, a) = (plan.bytes(), dims.state_bytes(), dims.workspace_bytes());
        let (free, total) = ctx.mem_get_info().map_err(drv("reading free GPU memory"))?;
        if w + s + a > free {
            return Err(BackendError::Model(format!(
                "the model needs {:.2} GB on {name} (weights {:.2} GB, sequence state {:.2} GB for {} slots of {} tokens, \
                 workspace {:.2} GB) but only {:.2} GB of {:.2} GB are free: lower the concurrency or the context",
                gb(w + s + a),
                gb(w),
                gb(s),
                opts.max_slots,
                max_context,
                gb(a),
                gb(free),
                gb(total)
            )));
        }
        let stream = ctx.default_stream();
        let arena = Arena::upload(&stream, &plan, &name)?;
        let states = States::alloc(&stream, &dims)?;
        let ws = Workspace::alloc(&stream, &dims)?;
        let tables = alloc_tables(&stream, &dims)?;
        stream.synchronize().map_err(drv("allocating device memory"))?;
        Ok(CudaBackend {
            config,
            name,
            ks,
            stream,
            dims,
            model: plan.model,
            arena,
            states,
            ws,
            tables,
            lens: vec![None; opts.max_slots],
            max_context,
        })
    }

    pub fn max_context(&self) -> usize {
        self.max_context
    }

    fn len_of(&self, slot: SlotId) -> Result<usize, BackendError> {
        self.lens.get(slot.0 as usize).copied().flatten().ok_or(BackendError::BadSlot(slot))
    }

    /// Every row is checked before any state changes.
    fn validate(&self, rows: &[StepInput<'_>]) -> Result<Vec<RowSpec>, BackendError> {
        let vocab = self.config.vocab_size;
        let mut specs = Vec::with_capacity(rows.len());
        for (i, r) in rows.iter().enumerate() {
            let have = self.len_of(r.slot)?;
            if rows[..i].iter().any(|o| o.slot == r.slot) {
                return Err(BackendError::Model(format!("slot {:?} appears twice in one step", r.slot)));
            }
            if let Some(&id) = r.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(BackendError::BadToken { id, vocab });
            }
            if have + r.tokens.len() > self.max_context {
                return Err(BackendError::ContextFull { max: self.max_context, needed: have + r.tokens.len() });
            }
            specs.push(RowSpec { slot: r.slot.0, have, n: r.tokens.len(), all_logits: r.all_logits });
        }
        Ok(specs)
    }
}

impl Backend for CudaBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    fn alloc_slot(&mut self) -> Result<SlotId, BackendError> {
        let free = self.lens.iter().position(|l| l.is_none()).ok_or(BackendError::NoFreeSlot(self.lens.len()))?;
        self.states.reset_slot(&self.stream, &self.dims, free)?;
        self.lens[free] = Some(0);
        Ok(SlotId(free as u32))
    }

    fn free_slot(&mut self, slot: SlotId) {
        if let Some(l) = self.lens.get_mut(slot.0 as usize) {
            *l = None;
        }
    }

    fn slot_len(&self, slot: SlotId) -> Result<usize, BackendError> {
        self.len_of(slot)
    }

    fn step(&mut self, rows: &[StepInput<'_>]) -> Result<Vec<RowLogits>, BackendError> {
        let specs = self.validate(rows)?;
        let v = self.config.vocab_size;
        let mut outs: Vec<RowLogits> = rows.iter().map(|_| RowLogits { rows: 0, values: Vec::new() }).collect();
        let cx = Ctx {
            ks: &self.ks,
            s: &self.stream,
            cfg: &self.config,
            dims: &self.dims,
            model: &self.model,
            arena: &self.arena,
        };
        let layout = self.dims.meta();
        for pass in split_passes(&specs, self.dims.t_cap) {
            let meta = pass_meta(&layout, memory::PAGE, &pass, |s| &rows[s.row].tokens[s.tok0..s.tok0 + s.n]);
            let mut logits = vec![0f32; meta.logit_rows.len() * v];
            run_pass(&cx, &mut self.states, &mut self.ws, &mut self.tables, &meta, &mut logits)?;
            for (k, &(s, _)) in meta.logit_rows.iter().enumerate() {
                let o = &mut outs[pass.segs[s].row];
                o.values.extend_from_slice(&logits[k * v..(k + 1) * v]);
                o.rows += 1;
            }
            for seg in &pass.segs {
                if let Some(l) = self.lens[seg.slot as usize].as_mut() {
                    *l += seg.n;
                }
            }
        }
        Ok(outs)
    }
}

#[cfg(test)]
mod tests;
