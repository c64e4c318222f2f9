//! The CUDA backend (DESIGN.md §5): drives the kernels of `ninfer-kernels` on one NVIDIA GPU.
//!
//! At open it loads the kernels for the card, plans every byte of device memory (weights,
//! paged KV for the full-attention layers sized for `max_slots × max_context`, GDN conv and
//! recurrent state slots, the activation workspace of the largest pass), checks the plan against
//! the free memory and allocates it; nothing is allocated per token. A step may mix decode rows
//! and prompt chunks; rows are cut into passes of at most `max_step_tokens` tokens (plan.rs) and
//! each pass runs the whole model (forward.rs). A pass of decode rows only (one new token per
//! sequence) is captured once as a CUDA graph per sequence count and KV-length bucket and
//! replayed: one launch from the host instead of hundreds. Logits come back to the host as f32,
//! where the runtime samples them, or, for rows that decode greedily, their argmax is taken on
//! the GPU and only the token comes back.
//!
//! - `plan`: host-side pass planning and the packed per-pass tables.
//! - `weights`: the weight arena, uploaded once from the mapped artifact.
//! - `memory`: sizes and allocation of state and workspace.
//! - `forward`: the kernel launches of one pass.
//! - `mtp`: the MTP block's passes and the target's final-normed hidden states it reads.
//! - `profile`: per-launch timing of an eager step from CUDA events.

mod forward;
mod memory;
mod mtp;
mod plan;
mod profile;
mod weights;

use std::collections::hash_map::{Entry, HashMap};
use std::sync::Arc;

use ninfer_kernels::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use ninfer_kernels::cudarc::driver::{CudaContext, CudaGraph, CudaSlice, CudaStream, DriverError};
use ninfer_kernels::{
    ImageKind, KernelError, KernelSet, SamplingRow, ATTN_MAX_DIM, GDN_CONV_WIDTH, GDN_MAX_DK, ROPE_MAX_DIM, ROUTE_MAX_EXPERTS,
};

use crate::artifact::Artifact;
use crate::model::ModelConfig;

use super::{Backend, BackendError, KvPool, LaunchTime, Pick, RowLogits, RowOutput, SlotId, StepInput};
use forward::{body, fetch, head, run_pass, upload_tables, Ctx, Fetch};
use memory::{alloc_tables, Dims, States, Workspace, LOGIT_ROWS, PAGE};
use plan::{kv_bucket, pass_meta, split_passes, RowSpec, Want};
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
    /// Positions of the KV pool all sequences share (rounded up to pages); None: every slot
    /// can reach `max_context`, or what fits on the card if less.
    pub kv_capacity: Option<usize>,
    /// Replay decode passes as CUDA graphs; off, every launch of every pass is issued from the
    /// host (slower; for comparison and debugging).
    pub graphs: bool,
    /// Load the MTP block, if the artifact has the `mtp` component ([`CudaBackend::mtp_step`]).
    pub mtp: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions { device: 0, max_slots: 4, max_context: 4096, max_step_tokens: 512, kv_capacity: None, graphs: true, mtp: false }
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
    let ctx = CudaContext::new(ordinal).map_err(drv("creating the CUDA context"))?;
    // SAFETY: each user of the context orders all its work on one stream of its own, so the
    // per-buffer events that order work across streams are not needed; they would also be
    // recorded into the graphs a decode pass is captured as.
    unsafe { ctx.disable_event_tracking() };
    Ok(ctx)
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

/// Device memory left to the driver after the plan (graph instantiation, module data, etc.).
const KV_MARGIN: usize = 1 << 30;

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
    /// Rows in each slot's MTP cache (mtp.rs).
    mtp_lens: Vec<usize>,
    /// The pool pages each slot holds, in position order, and the free pages.
    slot_pages: Vec<Vec<u32>>,
    free_pages: Vec<u32>,
    max_context: usize,
    graphs_on: bool,
    /// Captured decode passes by (sequence count, KV bucket).
    graphs: HashMap<(usize, usize), Graph>,
}

/// A captured decode pass, owned by its backend.
struct Graph(CudaGraph);

// SAFETY: a graph is used only through `&mut CudaBackend`, by one thread at a time, which is
// all CUDA asks of graph objects (they may move between threads, not be used concurrently).
unsafe impl Send for Graph {}

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
        let sample_words = ks.sample_workspace_len(LOGIT_ROWS).map_err(kern)?;
        let plan = weights::plan(art, &config, opts.mtp)?;
        let mut dims = Dims::new(&config, opts.max_slots, max_context, opts.max_step_tokens, sample_words, plan.model.mtp.is_some());
        let (w, g, a) = (plan.bytes(), dims.gdn_bytes(), dims.workspace_bytes());
        let per_page = dims.page_bytes().max(1);
        let (free, total) = ctx.mem_get_info().map_err(drv("reading free GPU memory"))?;
        let fixed = w + g + a;
        // What the KV pool may take: all that is free past the rest, less a margin for the
        // driver's own allocations (graphs, module data) made after this point.
        let room = free.saturating_sub(fixed + KV_MARGIN);
        let fits = room / per_page;
        let need = |pages: usize| {
            BackendError::Model(format!(
                "the model needs {:.2} GB on {name} (weights {:.2} GB, GDN state {:.2} GB for {} slots, workspace {:.2} GB, \
                 KV pool {:.2} GB for {} tokens) but only {:.2} GB of {:.2} GB are free: lower the concurrency, the context \
                 or the KV capacity",
                gb(fixed + pages * per_page),
                gb(w),
                gb(g),
                opts.max_slots,
                gb(a),
                gb(pages * per_page),
                pages * PAGE,
                gb(free),
                gb(total)
            ))
        };
        dims.kv_pages = match opts.kv_capacity {
            // auto: every slot can reach the full context, or as many pages as fit when that
            // is more than the card holds, as long as one sequence can reach the full context.
            None if dims.kv_layers() == 0 => dims.slots * dims.pages,
            None => (dims.slots * dims.pages).min(fits),
            Some(tokens) => tokens.div_ceil(PAGE),
        };
        // An explicit capacity below one full-context sequence is the caller's choice (the
        // runtime refuses requests that need more); auto must hold at least one.
        let least = if opts.kv_capacity.is_some() { 1 } else { dims.pages };
        if dims.kv_layers() > 0 && (dims.kv_pages > fits || dims.kv_pages < least) {
            return Err(need(dims.kv_pages.max(least)));
        }
        // A stream of our own: the legacy default stream cannot be captured into a graph.
        let stream = ctx.new_stream().map_err(drv("creating a CUDA stream"))?;
        let arena = Arena::upload(&stream, &ks, &plan, &name)?;
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
            mtp_lens: vec![0; opts.max_slots],
            slot_pages: vec![Vec::new(); opts.max_slots],
            // Popped from the end: a new sequence takes the lowest pages first.
            free_pages: (0..dims.kv_pages as u32).rev().collect(),
            max_context,
            graphs_on: opts.graphs,
            graphs: HashMap::new(),
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
        let mut specs = Vec::with_capacity(rows.len());
        for (i, r) in rows.iter().enumerate() {
            if rows[..i].iter().any(|o| o.slot == r.slot) {
                return Err(BackendError::Model(format!("slot {:?} appears twice in one step", r.slot)));
            }
            specs.push(self.row_spec(r.slot, self.len_of(r.slot)?, r.tokens, r.all_logits)?);
        }
        self.check_pages(&specs)?;
        Ok(specs)
    }

    /// `tokens` continuing a sequence of `have` positions in `slot`: ids in the vocabulary and
    /// room in the context.
    fn row_spec(&self, slot: SlotId, have: usize, tokens: &[u32], all_logits: bool) -> Result<RowSpec, BackendError> {
        let vocab = self.config.vocab_size;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(BackendError::BadToken { id, vocab });
        }
        if have + tokens.len() > self.max_context {
            return Err(BackendError::ContextFull { max: self.max_context, needed: have + tokens.len() });
        }
        Ok(RowSpec { slot: slot.0, have, n: tokens.len(), all_logits })
    }

    /// Whether the pool has the pages the rows add to their slots.
    fn check_pages(&self, specs: &[RowSpec]) -> Result<(), BackendError> {
        let needed: usize = specs.iter().map(|r| (r.have + r.n).div_ceil(PAGE).saturating_sub(self.slot_pages[r.slot as usize].len())).sum();
        if needed > self.free_pages.len() {
            return Err(BackendError::KvFull { needed, free: self.free_pages.len(), total: self.dims.kv_pages });
        }
        Ok(())
    }

    /// Gives every row's slot the pages its new tokens need (validated to be free).
    fn take_pages(&mut self, specs: &[RowSpec]) {
        for r in specs {
            let held = &mut self.slot_pages[r.slot as usize];
            while held.len() < (r.have + r.n).div_ceil(PAGE) {
                held.push(self.free_pages.pop().expect("validate checked the free pages"));
            }
        }
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
        self.mtp_lens[free] = 0;
        Ok(SlotId(free as u32))
    }

    fn free_slot(&mut self, slot: SlotId) {
        if let Some(l) = self.lens.get_mut(slot.0 as usize) {
            *l = None;
            self.free_pages.append(&mut self.slot_pages[slot.0 as usize]);
        }
    }

    fn picks_tokens(&self) -> bool {
        true
    }

    fn kv_pool(&self) -> KvPool {
        KvPool { page_size: PAGE, pages: self.dims.kv_pages, used: self.dims.kv_pages - self.free_pages.len() }
    }

    fn slot_len(&self, slot: SlotId) -> Result<usize, BackendError> {
        self.len_of(slot)
    }

    fn step(&mut self, rows: &[StepInput<'_>]) -> Result<Vec<RowLogits>, BackendError> {
        self.run_step(rows, None, None)
    }

    /// Runs the step with CUDA events between its launches: a decode pass as a graph of its own
    /// (when graphs are on), any other pass eagerly.
    fn profile_step(&mut self, rows: &[StepInput<'_>]) -> Result<(Vec<RowLogits>, Vec<LaunchTime>), BackendError> {
        let prof = profile::Profiler::start(&self.stream)?;
        let out = self.run_step(rows, Some(&prof), None)?;
        Ok((out, prof.into_inner().finish()?))
    }
}

impl CudaBackend {
    /// Runs every pass of a step; with `hidden` (one vector per row), also appends each row's
    /// final-normed hidden states to its vector.
    fn run_step(
        &mut self,
        rows: &[StepInput<'_>],
        prof: Option<&std::cell::RefCell<profile::Profiler>>,
        mut hidden: Option<&mut [Vec<f32>]>,
    ) -> Result<Vec<RowLogits>, BackendError> {
        let specs = self.validate(rows)?;
        self.take_pages(&specs);
        let v = self.config.vocab_size;
        let mut outs: Vec<RowLogits> = rows.iter().map(|_| RowLogits { rows: 0, values: Vec::new(), token: None }).collect();
        let cx = Ctx {
            ks: &self.ks,
            s: &self.stream,
            cfg: &self.config,
            dims: &self.dims,
            model: &self.model,
            arena: &self.arena,
            prof,
        };
        let cap = self.dims.meta();
        let kv_cap = self.dims.pages * PAGE;
        for pass in split_passes(&specs, self.dims.t_cap) {
            // Tokens are picked on the GPU when no row with logits in this pass needs them.
            let picked = pass.segs.iter().all(|s| match s.want {
                Want::None => true,
                Want::Last => rows[s.row].pick != Pick::Logits,
                Want::All => false,
            });
            let graph = self.graphs_on && pass.is_decode() && pass.segs.len() <= LOGIT_ROWS;
            let max_kv = pass.segs.iter().map(|s| s.pos0 + s.n).max().unwrap_or(0);
            let pad = graph.then(|| kv_bucket(max_kv, kv_cap));
            let slot_pages = &self.slot_pages;
            let meta = pass_meta(&cap, PAGE, &pass, pad, |s| &rows[s.row].tokens[s.tok0..s.tok0 + s.n], |slot| &slot_pages[slot as usize]);
            let n = meta.logit_rows.len();
            let (mut logits, mut tokens) = (Vec::new(), Vec::new());
            let mut out = if picked {
                tokens = vec![0i32; n];
                let picks: Vec<Pick> = meta.logit_rows.iter().map(|&(s, _)| rows[pass.segs[s].row].pick).collect();
                Fetch::Tokens { out: &mut tokens, params: sampling_rows(&picks) }
            } else {
                logits = vec![0f32; n * v];
                Fetch::Logits(&mut logits)
            };
            if let Some(bucket) = pad {
                upload_tables(&cx, &mut self.tables, &meta)?;
                // A profiled step is a graph of its own, with the profile's events in it.
                let profiled;
                let graph = match self.graphs.entry((meta.seqs, bucket)) {
                    _ if prof.is_some() => {
                        profiled = Graph(capture(&cx, &mut self.states, &mut self.ws, &self.tables, &meta)?);
                        &profiled
                    }
                    Entry::Occupied(g) => g.into_mut(),
                    Entry::Vacant(v) => v.insert(Graph(capture(&cx, &mut self.states, &mut self.ws, &self.tables, &meta)?)),
                };
                graph.0.launch().map_err(drv("launching a decode graph"))?;
                fetch(&cx, &mut self.ws, &mut out, 0, n)?;
                self.stream.synchronize().map_err(drv("running the step"))?;
            } else {
                run_pass(&cx, &mut self.states, &mut self.ws, &mut self.tables, &meta, out)?;
            }
            if let Some(hid) = hidden.as_deref_mut() {
                let values = mtp::fetch_hidden(&cx, &self.ws, meta.tokens)?;
                let mut r0 = 0;
                for seg in &pass.segs {
                    hid[seg.row].extend_from_slice(&values[r0 * self.dims.h..(r0 + seg.n) * self.dims.h]);
                    r0 += seg.n;
                }
            }
            for (k, &(s, _)) in meta.logit_rows.iter().enumerate() {
                let o = &mut outs[pass.segs[s].row];
                if picked {
                    o.token = Some(tokens[k] as u32);
                } else {
                    o.values.extend_from_slice(&logits[k * v..(k + 1) * v]);
                }
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

/// The sampling kernel's rows for `picks` (argmax rows as temperature 0, which it treats as
/// argmax), or None when every row is an argmax.
fn sampling_rows(picks: &[Pick]) -> Option<Vec<SamplingRow>> {
    if picks.iter().all(|p| *p == Pick::Argmax) {
        return None;
    }
    let row = |p: &Pick| match *p {
        Pick::Sample(s) => SamplingRow {
            temperature: s.temperature,
            top_p: s.top_p,
            min_p: s.min_p,
            u: s.u,
            // The kernel reads k <= 0 or k >= vocab as no top-k, as the sampler reads 0.
            top_k: s.top_k.min(i32::MAX as usize) as i32,
            pad: [0; 3],
        },
        _ => SamplingRow::default(),
    };
    Some(picks.iter().map(row).collect())
}

/// Captures a decode pass (its launches through the head, into `ws.logits`) as a graph. The
/// graph reads the tables from the buffer they are uploaded to before every replay; everything
/// else a launch takes is fixed by the sequence count and the KV bucket of `meta`.
fn capture(cx: &Ctx, st: &mut States, ws: &mut Workspace, tables: &CudaSlice<i32>, meta: &plan::PassMeta) -> Result<CudaGraph, BackendError> {
    let what = "capturing a decode graph";
    cx.s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).map_err(drv(what))?;
    let restarted = cx.prof.map_or(Ok(()), |p| p.borrow_mut().restart_in_capture());
    let recorded = restarted.and_then(|_| body(cx, st, ws, tables, meta)).and_then(|_| head(cx, ws, tables, meta, 0, meta.logit_rows.len()));
    // The capture is ended whatever happened, so the stream is usable again.
    let graph = cx.s.end_capture(CUgraphInstantiate_flags(0)).map_err(drv(what));
    recorded?;
    graph?.ok_or_else(|| BackendError::Model("capturing a decode graph recorded nothing".into()))
}

#[cfg(test)]
mod tests;
