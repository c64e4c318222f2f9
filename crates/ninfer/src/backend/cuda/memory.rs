//! Device memory besides the weights, planned and allocated once at open (DESIGN.md §5, §6):
//! sequence state (the pool of KV pages of the full-attention layers that all slots share, GDN
//! conv and recurrent state per slot) and the activation workspace of the largest pass.
//! Sizes are computed first, so that a plan larger than the free memory fails with the numbers
//! before anything is allocated.

use std::sync::Arc;

use half::bf16;
use ninfer_kernels::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use ninfer_kernels::{attention_workspace_len, SamplingRow, ATTN_MAX_SPLITS, GDN_CONV_WIDTH};

use crate::model::{LayerKind, ModelConfig};

use super::plan::MetaLayout;
use super::{drv, BackendError};

/// KV positions per page; a slot takes pages from the pool as its sequence grows.
pub(super) const PAGE: usize = 64;
/// Rows of logits computed and copied back at a time.
pub(super) const LOGIT_ROWS: usize = 64;

/// The fewest tokens of a pass whose MoE runs grouped by expert (forward.rs `moe`); shorter
/// passes run the per-slot expert kernels, or those of a decode batch. On an H200 (the
/// `bench_moe_prompt` kernel timing, Qwen3.6-35B-A3B shapes) the per-slot kernels are 3.1x
/// faster at 16 tokens and 1.7x at 64, the grouped ones 1.8x faster at 512.
pub(super) const GROUPED_MIN_TOKENS: usize = 256;

/// The fewest tokens of a pass whose MoE runs on the decode-batch expert kernels (forward.rs
/// `batch`; at most `ninfer_kernels::BATCH_MAX_TOKENS`).
pub(super) const BATCH_MIN_TOKENS: usize = 4;

/// Every size the allocations follow.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub slots: usize,
    pub t_cap: usize,
    /// Pages of one sequence at the full context (the block-table row length).
    pub pages: usize,
    /// Pages of the pool, shared by all slots.
    pub kv_pages: usize,
    pub h: usize,
    pub v: usize,
    pub cd: usize,
    pub vd: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub e: usize,
    pub topk: usize,
    pub inter: usize,
    pub linear_layers: usize,
    pub attn_layers: usize,
    /// Whether the MTP block is loaded: its attention layer has a KV cache of its own (after
    /// the model's, in the same pages) and its fc input `[e ‖ g]` rows go through `proj`.
    pub mtp: bool,
    /// u32 scratch words of the GPU argmax and sampling over LOGIT_ROWS rows (the kernel set's
    /// figure).
    pub sample_words: usize,
}

impl Dims {
    pub fn new(c: &ModelConfig, slots: usize, max_context: usize, t_cap: usize, sample_words: usize, mtp: bool) -> Dims {
        Dims {
            slots,
            t_cap,
            pages: max_context.div_ceil(PAGE),
            kv_pages: slots * max_context.div_ceil(PAGE),
            h: c.hidden_size,
            v: c.vocab_size,
            cd: c.gdn_conv_dim(),
            vd: c.gdn_value_dim(),
            hv: c.linear_num_value_heads,
            dk: c.linear_key_head_dim,
            dv: c.linear_value_head_dim,
            hq: c.num_attention_heads,
            hkv: c.num_kv_heads,
            d: c.head_dim,
            e: c.num_experts,
            topk: c.num_experts_per_tok,
            inter: c.moe_intermediate_size.max(c.shared_expert_intermediate_size),
            linear_layers: c.layer_types.iter().filter(|k| **k == LayerKind::LinearAttention).count(),
            attn_layers: c.layer_types.iter().filter(|k| **k == LayerKind::FullAttention).count(),
            mtp,
            sample_words,
        }
    }

    pub fn meta(&self) -> MetaLayout {
        MetaLayout { t_cap: self.t_cap, s_cap: self.slots, pages: self.pages }
    }

    /// Attention layers with a KV cache: the model's, then the MTP layer's.
    pub fn kv_layers(&self) -> usize {
        self.attn_layers + usize::from(self.mtp)
    }

    /// KV cache rows of one layer (every page of the pool).
    pub fn cache_rows(&self) -> usize {
        self.kv_pages * PAGE
    }

    fn kv_elems(&self) -> usize {
        self.cache_rows() * self.hkv * self.d
    }

    /// Bytes one page takes over all attention layers (K and V, bf16).
    pub fn page_bytes(&self) -> usize {
        self.kv_layers() * 2 * PAGE * self.hkv * self.d * 2
    }

    fn conv_elems(&self) -> usize {
        self.slots * (GDN_CONV_WIDTH - 1) * self.cd
    }

    fn rec_elems(&self) -> usize {
        self.slots * self.hv * self.dk * self.dv
    }

    /// Bytes of the GDN state of every slot.
    pub fn gdn_bytes(&self) -> usize {
        self.linear_layers * (self.conv_elems() * 2 + self.rec_elems() * 4)
    }

    fn proj_elems(&self) -> usize {
        // z, qkv, b and a side by side (the stacked projection); q‖gate, k, v; the MTP's [e ‖ g].
        let gdn = if self.linear_layers > 0 { self.vd + self.cd + 2 * self.hv } else { 0 };
        let attn = if self.kv_layers() > 0 { self.qkv_ld() } else { 0 };
        let mtp = if self.mtp { 2 * self.h } else { 0 };
        self.t_cap * gdn.max(attn).max(self.vd).max(mtp)
    }

    /// Row of an attention layer's projections in `proj`: q‖gate per head, then k, then v.
    pub fn qkv_ld(&self) -> usize {
        2 * self.hq * self.d + 2 * self.hkv * self.d
    }

    fn conv_elems_ws(&self) -> usize {
        if self.linear_layers > 0 {
            self.t_cap * self.cd
        } else {
            1
        }
    }

    fn mix_elems(&self) -> usize {
        self.t_cap * self.vd.max(self.hq * self.d)
    }

    /// MoE slots of a pass: routed plus one shared slot per token.
    fn moe_slots(&self) -> usize {
        self.t_cap * (self.topk + 1)
    }

    /// f32 per-slot down projections of a grouped MoE pass or a decode batch (forward.rs),
    /// `[slots, H]`; none when passes are too short for either.
    fn moe_part_elems(&self) -> usize {
        if self.t_cap >= BATCH_MIN_TOKENS && self.e > 0 {
            self.moe_slots() * self.h
        } else {
            1
        }
    }

    /// f32 partials of split-KV decode attention: one query row per slot, every split.
    fn attn_part_elems(&self) -> usize {
        if self.kv_layers() == 0 {
            return 1;
        }
        attention_workspace_len(self.slots.min(self.t_cap), self.hq, self.d, ATTN_MAX_SPLITS)
    }

    /// Bytes of the activation workspace.
    pub fn workspace_bytes(&self) -> usize {
        let bf = 3 * self.t_cap * self.h
            + self.proj_elems()
            + self.conv_elems_ws()
            + self.t_cap * self.vd
            + self.t_cap * 2 * self.hv
            + self.mix_elems()
            + self.t_cap * (self.e + 1)
            + self.moe_slots() * self.inter
            + LOGIT_ROWS * self.h;
        let f = self.moe_slots() + self.moe_part_elems() + LOGIT_ROWS * self.v + self.attn_part_elems();
        // Tokens (1 word) and sampling parameters (8 words) per logit row.
        let i = self.t_cap * self.topk + self.meta().len() + LOGIT_ROWS * 9 + self.sample_words;
        bf * 2 + f * 4 + i * 4
    }
}

/// Per-slot sequence state of every layer, indexed by the layer's position among its kind.
pub(super) struct States {
    /// (k, v) caches `[cache_rows, Hkv, D]` per full-attention layer, the MTP layer's last.
    pub kv: Vec<(CudaSlice<bf16>, CudaSlice<bf16>)>,
    /// bf16 `[slots, 3, Cd]` per GDN layer.
    pub conv: Vec<CudaSlice<bf16>>,
    /// f32 `[slots, Hv, dk, dv]` per GDN layer.
    pub rec: Vec<CudaSlice<f32>>,
}

fn zeros<T: DeviceRepr + ValidAsZeroBits>(s: &Arc<CudaStream>, n: usize, what: &'static str) -> Result<CudaSlice<T>, BackendError> {
    s.alloc_zeros::<T>(n.max(1)).map_err(drv(what))
}

impl States {
    pub fn alloc(s: &Arc<CudaStream>, d: &Dims) -> Result<States, BackendError> {
        let kv = (0..d.kv_layers())
            .map(|_| Ok((zeros(s, d.kv_elems(), "the KV cache")?, zeros(s, d.kv_elems(), "the KV cache")?)))
            .collect::<Result<Vec<_>, BackendError>>()?;
        let conv = (0..d.linear_layers).map(|_| zeros(s, d.conv_elems(), "the GDN conv state")).collect::<Result<_, _>>()?;
        let rec = (0..d.linear_layers).map(|_| zeros(s, d.rec_elems(), "the GDN state")).collect::<Result<_, _>>()?;
        Ok(States { kv, conv, rec })
    }

    /// Zeroes a slot's GDN state (a new sequence starts from zero state, model-spec.md §2.4);
    /// its KV rows need no clearing, attention reads only positions below the sequence length.
    pub fn reset_slot(&mut self, s: &Arc<CudaStream>, d: &Dims, slot: usize) -> Result<(), BackendError> {
        let (cn, rn) = (d.conv_elems() / d.slots, d.rec_elems() / d.slots);
        for c in &mut self.conv {
            s.memset_zeros(&mut c.slice_mut(slot * cn..(slot + 1) * cn)).map_err(drv("clearing a slot"))?;
        }
        for r in &mut self.rec {
            s.memset_zeros(&mut r.slice_mut(slot * rn..(slot + 1) * rn)).map_err(drv("clearing a slot"))?;
        }
        Ok(())
    }
}

/// Activation buffers for one pass of up to `t_cap` tokens.
pub(super) struct Workspace {
    /// Residual stream `[T, H]`.
    pub h: CudaSlice<bf16>,
    /// Normed input of a block `[T, H]`.
    pub a: CudaSlice<bf16>,
    /// A mixer's output `[T, H]`.
    pub delta: CudaSlice<bf16>,
    /// GDN qkv `[T, Cd]` (or the stacked z‖qkv‖b‖a `[T, Vd + Cd + 2·Hv]`), the gated norm's
    /// output `[T, Vd]`, attention q‖gate, k and v side by side `[T, Dims::qkv_ld]`, or the
    /// MTP's fc input `[T, 2·H]`.
    pub proj: CudaSlice<bf16>,
    /// GDN z gate `[T, Vd]`, or the gated norm's output when z is read from the stacked rows.
    pub z: CudaSlice<bf16>,
    /// GDN b then a logits, `[T, 2·Hv]`.
    pub ba: CudaSlice<bf16>,
    /// GDN conv output `[T, Cd]`.
    pub conv: CudaSlice<bf16>,
    /// GDN recurrence output `[T, Vd]` or attention output `[T, Hq·D]`.
    pub mix: CudaSlice<bf16>,
    /// Router logits plus the shared gate's, `[T, E + 1]`.
    pub router: CudaSlice<bf16>,
    /// A folded router's sums and ticket (`RouterFold`): zero between launches.
    pub route_acc: CudaSlice<i64>,
    pub route_ticket: CudaSlice<u32>,
    pub ids: CudaSlice<i32>,
    pub route_w: CudaSlice<f32>,
    /// SiLU(g)·u of every MoE slot.
    pub gu: CudaSlice<bf16>,
    /// Each MoE slot's weighted down projection (grouped passes).
    pub moe_part: CudaSlice<f32>,
    /// Final-normed rows that get logits, `[LOGIT_ROWS, H]`.
    pub sel: CudaSlice<bf16>,
    pub logits: CudaSlice<f32>,
    /// Split-KV attention partials.
    pub attn_part: CudaSlice<f32>,
    /// The token picked for each logit row, the sampling parameters of each, and the scratch of
    /// the argmax and sampling kernels.
    pub tokens: CudaSlice<i32>,
    pub sample_params: CudaSlice<SamplingRow>,
    pub sample_ws: CudaSlice<u32>,
}

impl Workspace {
    pub fn alloc(s: &Arc<CudaStream>, d: &Dims) -> Result<Workspace, BackendError> {
        let t = d.t_cap;
        let w = "the activation workspace";
        Ok(Workspace {
            h: zeros(s, t * d.h, w)?,
            a: zeros(s, t * d.h, w)?,
            delta: zeros(s, t * d.h, w)?,
            proj: zeros(s, d.proj_elems(), w)?,
            z: zeros(s, t * d.vd, w)?,
            ba: zeros(s, t * 2 * d.hv, w)?,
            conv: zeros(s, d.conv_elems_ws(), w)?,
            mix: zeros(s, d.mix_elems(), w)?,
            router: zeros(s, t * (d.e + 1), w)?,
            route_acc: zeros(s, d.e + 1, w)?,
            route_ticket: zeros(s, 1, w)?,
            ids: zeros(s, t * d.topk, w)?,
            route_w: zeros(s, d.moe_slots(), w)?,
            gu: zeros(s, d.moe_slots() * d.inter, w)?,
            moe_part: zeros(s, d.moe_part_elems(), w)?,
            sel: zeros(s, LOGIT_ROWS * d.h, w)?,
            logits: zeros(s, LOGIT_ROWS * d.v, w)?,
            attn_part: zeros(s, d.attn_part_elems(), w)?,
            tokens: zeros(s, LOGIT_ROWS, w)?,
            sample_params: s.clone_htod(&[SamplingRow::default(); LOGIT_ROWS]).map_err(drv(w))?,
            sample_ws: zeros(s, d.sample_words, w)?,
        })
    }
}

/// The device buffer of the packed per-pass tables (plan.rs).
pub(super) fn alloc_tables(s: &Arc<CudaStream>, d: &Dims) -> Result<CudaSlice<i32>, BackendError> {
    zeros(s, d.meta().len(), "the step tables")
}
