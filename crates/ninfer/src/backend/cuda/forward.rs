//! One forward pass on the GPU over a batch of sequence segments laid out back to back
//! (model-spec.md §2.2): embed, every decoder layer, final norm, and the head on the rows that
//! want logits. Activations are bf16 with f32 math inside each kernel, the roundings of a bf16
//! transformers run (model-spec.md §2.7); logits come back to the host as f32.
//!
//! Matrix products go through the small-batch gemv kernels, 16 rows per launch, so a prompt
//! chunk is processed 16 tokens at a time per projection; the GDN recurrence walks each
//! sequence's tokens in order inside one launch. Decode rows of several sequences share every
//! launch.

use std::sync::Arc;

use half::bf16;
use ninfer_kernels::cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
use ninfer_kernels::{
    AttentionBatch, GdnDims, GemvOut, HeadLayout, KernelSet, MatrixView, PagedKv, Rows, SeqSlots, Weights,
    GEMV_MAX_BATCH,
};

use crate::model::ModelConfig;

use super::memory::{Dims, States, Workspace, LOGIT_ROWS, PAGE};
use super::plan::PassMeta;
use super::weights::{Arena, AttnW, DevMat, GdnW, MixerW, ModelW, MoeW};
use super::{drv, kern, BackendError};

/// Everything a pass reads and never writes.
pub(super) struct Ctx<'a> {
    pub ks: &'a KernelSet,
    pub s: &'a Arc<CudaStream>,
    pub cfg: &'a ModelConfig,
    pub dims: &'a Dims,
    pub model: &'a ModelW,
    pub arena: &'a Arena,
}

/// The pass's tables as device views (offsets of plan.rs's `MetaLayout`).
struct Tables<'a> {
    ids: CudaView<'a, i32>,
    pos: CudaView<'a, i32>,
    kv_rows: CudaView<'a, i32>,
    zeros: CudaView<'a, i32>,
    cu: CudaView<'a, i32>,
    slots: CudaView<'a, i32>,
    kv_len: CudaView<'a, i32>,
    block_table: CudaView<'a, i32>,
}

/// y[r] = x[r]·Wᵀ for `rows` rows, at most 16 per launch.
fn linear<O: GemvOut>(
    cx: &Ctx,
    w: &DevMat,
    x: CudaView<'_, bf16>,
    rows: usize,
    ldx: usize,
    mut y: CudaViewMut<'_, O>,
    ldy: usize,
) -> Result<(), BackendError> {
    let m = cx.arena.mat(w);
    let mut r0 = 0;
    while r0 < rows {
        let b = (rows - r0).min(GEMV_MAX_BATCH);
        let xs = x.slice(r0 * ldx..);
        let mut ys = y.slice_mut(r0 * ldy..);
        cx.ks.gemv(cx.s, &m, &xs, b, ldx, &mut ys, ldy).map_err(kern)?;
        r0 += b;
    }
    Ok(())
}

/// Runs one pass; `out` receives `meta.logit_rows.len()` rows of vocabulary-sized f32 logits.
/// `tables` is the device buffer the pass's packed tables are uploaded into.
pub(super) fn run_pass(
    cx: &Ctx,
    st: &mut States,
    ws: &mut Workspace,
    tables: &mut CudaSlice<i32>,
    meta: &PassMeta,
    out: &mut [f32],
) -> Result<(), BackendError> {
    let d = cx.dims;
    let (t, h, v) = (meta.tokens, d.h, d.v);
    let eps = cx.cfg.rms_norm_eps;
    cx.s.memcpy_htod(&meta.data, &mut tables.slice_mut(..meta.data.len())).map_err(drv("uploading the step tables"))?;
    let tables = &*tables;
    let ml = d.meta();
    let seqs = meta.seqs;
    let view = |off: usize, n: usize| tables.slice(off..off + n);
    let tb = Tables {
        ids: view(ml.ids(), t),
        pos: view(ml.pos(), t),
        kv_rows: view(ml.kv_rows(), t),
        zeros: view(ml.zeros(), t),
        cu: view(ml.cu(), seqs + 1),
        slots: view(ml.slots(), seqs),
        kv_len: view(ml.kv_len(), seqs),
        block_table: view(ml.block_table(), seqs * meta.bt_stride),
    };
    let rows = Rows::dense(t, h);

    // h₀ = Embed[token].
    cx.ks.embed(cx.s, &cx.arena.mat(&cx.model.embed), &tb.ids, t, &mut ws.h, h).map_err(kern)?;
    let (mut gi, mut ai) = (0, 0);
    for lw in &cx.model.layers {
        // a = RMSNorm_in(h); delta = Mixer(a); h += delta; a = RMSNorm_post(h); h += MoE(a).
        cx.ks.rms_norm(cx.s, &ws.h, rows, &cx.arena.bf16(lw.attn_norm), &mut ws.a, rows, eps).map_err(kern)?;
        match &lw.mixer {
            MixerW::Gdn(g) => {
                gdn(cx, g, st, ws, &tb, meta, gi)?;
                gi += 1;
            }
            MixerW::Attn(at) => {
                attention(cx, at, st, ws, &tb, meta, ai)?;
                ai += 1;
            }
        }
        let moe_norm = cx.arena.bf16(lw.moe_norm);
        cx.ks.add_rms_norm(cx.s, &mut ws.h, &ws.delta, rows, &moe_norm, &mut ws.a, rows, eps).map_err(kern)?;
        moe(cx, &lw.moe, ws, &tb, t)?;
    }

    // Final norm, then the head over the rows that want logits, LOGIT_ROWS at a time: the rows
    // are gathered with the embedding kernel, reading the normed activations as a bf16 table.
    cx.ks.rms_norm(cx.s, &ws.h, rows, &cx.arena.bf16(cx.model.final_norm), &mut ws.a, rows, eps).map_err(kern)?;
    let n = meta.logit_rows.len();
    let table = MatrixView { weights: Weights::Bf16 { data: ws.a.slice(..t * h) }, experts: 1, rows: t, cols: h };
    let mut c0 = 0;
    while c0 < n {
        let rc = (n - c0).min(LOGIT_ROWS);
        let picks = tables.slice(ml.gather() + c0..ml.gather() + c0 + rc);
        cx.ks.embed(cx.s, &table, &picks, rc, &mut ws.sel, h).map_err(kern)?;
        linear::<f32>(cx, &cx.model.head, ws.sel.as_view(), rc, h, ws.logits.as_view_mut(), v)?;
        cx.s.memcpy_dtoh(&ws.logits.slice(..rc * v), &mut out[c0 * v..(c0 + rc) * v]).map_err(drv("copying logits back"))?;
        c0 += rc;
    }
    cx.s.synchronize().map_err(drv("running the step"))
}

/// Gated DeltaNet mixer (model-spec.md §2.4) into `ws.delta`.
fn gdn(cx: &Ctx, g: &GdnW, st: &mut States, ws: &mut Workspace, tb: &Tables, meta: &PassMeta, gi: usize) -> Result<(), BackendError> {
    let d = cx.dims;
    let (t, h, cd, vd, hv) = (meta.tokens, d.h, d.cd, d.vd, d.hv);
    // Step 1: projections; b and a side by side in one [T, 2·Hv] buffer.
    linear(cx, &g.qkv, ws.a.as_view(), t, h, ws.proj.as_view_mut(), cd)?;
    linear(cx, &g.z, ws.a.as_view(), t, h, ws.z.as_view_mut(), vd)?;
    linear(cx, &g.b, ws.a.as_view(), t, h, ws.ba.as_view_mut(), 2 * hv)?;
    linear(cx, &g.a, ws.a.as_view(), t, h, ws.ba.slice_mut(hv..), 2 * hv)?;
    let batch = SeqSlots { seqs: meta.seqs, tokens: t, cu: tb.cu.slice(..), slots: tb.slots.slice(..) };
    // Step 2: causal conv + SiLU, continuing each slot's conv state.
    let conv_w = cx.arena.bf16(g.conv);
    cx.ks.gdn_conv(cx.s, &ws.proj, cd, &conv_w, cd, &mut st.conv[gi], d.slots, &batch, &mut ws.conv, cd).map_err(kern)?;
    // Steps 3-7: gates, q/k norms and the recurrence per token.
    let dims = GdnDims { hk: cx.cfg.linear_num_key_heads, hv, dk: d.dk, dv: d.dv };
    let (a_log, dt_bias) = (cx.arena.f32(g.a_log), cx.arena.f32(g.dt_bias));
    let alpha = ws.ba.slice(hv..);
    cx.ks
        .gdn_recurrent(cx.s, &ws.conv, cd, &ws.ba, &alpha, 2 * hv, &a_log, &dt_bias, &mut st.rec[gi], d.slots, &batch, dims, &mut ws.mix)
        .map_err(kern)?;
    // Step 8: gated RMSNorm per value head with z, then the output projection.
    let norm_w = cx.arena.bf16(g.norm);
    cx.ks.gated_rms_norm(cx.s, &ws.mix, &ws.z, &norm_w, &mut ws.proj, t * hv, d.dv, cx.cfg.rms_norm_eps).map_err(kern)?;
    linear(cx, &g.out, ws.proj.as_view(), t, vd, ws.delta.as_view_mut(), h)
}

/// Gated full attention (model-spec.md §2.3) into `ws.delta`.
fn attention(cx: &Ctx, at: &AttnW, st: &mut States, ws: &mut Workspace, tb: &Tables, meta: &PassMeta, ai: usize) -> Result<(), BackendError> {
    let d = cx.dims;
    let (t, h, hq, hkv, dd) = (meta.tokens, d.h, d.hq, d.hkv, d.d);
    // Steps 1-2: q_proj gives per head D query values then D gate values.
    linear(cx, &at.q, ws.a.as_view(), t, h, ws.proj.as_view_mut(), 2 * hq * dd)?;
    linear(cx, &at.k, ws.a.as_view(), t, h, ws.k.as_view_mut(), hkv * dd)?;
    linear(cx, &at.v, ws.a.as_view(), t, h, ws.v.as_view_mut(), hkv * dd)?;
    let ql = HeadLayout { heads: hq, ld: 2 * hq * dd, head_stride: 2 * dd };
    let kl = HeadLayout { heads: hkv, ld: hkv * dd, head_stride: dd };
    // Steps 3-4: q/k norms and partial RoPE at each token's position.
    let (qn, kn) = (cx.arena.bf16(at.q_norm), cx.arena.bf16(at.k_norm));
    let theta = cx.cfg.rope_theta as f32;
    cx.ks
        .qk_norm_rope(cx.s, &mut ws.proj, ql, &mut ws.k, kl, t, dd, cx.cfg.rotary_dim, Some(&qn), Some(&kn), &tb.pos, theta, cx.cfg.rms_norm_eps)
        .map_err(kern)?;
    let (kc, vc) = &mut st.kv[ai];
    cx.ks.kv_write(cx.s, &ws.k, kl, &ws.v, kl, t, dd, &tb.kv_rows, kc, vc, d.cache_rows()).map_err(kern)?;
    // Steps 5-6: causal GQA attention over each slot's pages, times sigmoid(gate).
    let kv = PagedKv { k: kc.slice(..), v: vc.slice(..), page_size: PAGE, kv_heads: hkv, dim: dd };
    let batch = AttentionBatch {
        seqs: meta.seqs,
        tokens: t,
        max_q_len: meta.max_q,
        max_kv_len: meta.max_kv,
        cu_q: tb.cu.slice(..),
        kv_len: tb.kv_len.slice(..),
        block_table: tb.block_table.slice(..),
        bt_stride: meta.bt_stride,
    };
    let gate = ws.proj.slice(dd..);
    let scale = 1.0 / (dd as f32).sqrt();
    cx.ks.attention(cx.s, &ws.proj, ql, Some(&gate), &kv, &batch, scale, &mut ws.mix).map_err(kern)?;
    // Step 7: output projection.
    linear(cx, &at.o, ws.mix.as_view(), t, hq * dd, ws.delta.as_view_mut(), h)
}

/// Sparse MoE block (model-spec.md §2.5), added into the residual `ws.h` in bf16.
fn moe(cx: &Ctx, mw: &MoeW, ws: &mut Workspace, tb: &Tables, t: usize) -> Result<(), BackendError> {
    let d = cx.dims;
    let (h, e, k) = (d.h, d.e, d.topk);
    // Router logits, and the shared expert's gate logit in column E of the same rows.
    linear(cx, &mw.router, ws.a.as_view(), t, h, ws.router.as_view_mut(), e + 1)?;
    if let Some(sh) = &mw.shared {
        linear(cx, &sh.gate, ws.a.as_view(), t, h, ws.router.slice_mut(e..), e + 1)?;
    }
    cx.ks.moe_route(cx.s, &ws.router, e + 1, t, e, k, mw.shared.is_some(), &mut ws.ids, &mut ws.route_w).map_err(kern)?;
    let (gu, dn) = (cx.arena.mat(&mw.gate_up), cx.arena.mat(&mw.down));
    match &mw.shared {
        Some(sh) if mw.fused => {
            let (sgu, sdn) = (cx.arena.mat(&sh.gate_up), cx.arena.mat(&sh.down));
            cx.ks.moe_gate_up(cx.s, &gu, Some(&sgu), &ws.a, h, t, k, &ws.ids, &mut ws.gu).map_err(kern)?;
            cx.ks.moe_down(cx.s, &dn, Some(&sdn), &ws.gu, t, k, &ws.ids, &ws.route_w, &mut ws.h, h, true).map_err(kern)
        }
        shared => {
            cx.ks.moe_gate_up(cx.s, &gu, None, &ws.a, h, t, k, &ws.ids, &mut ws.gu).map_err(kern)?;
            cx.ks.moe_down(cx.s, &dn, None, &ws.gu, t, k, &ws.ids, &ws.route_w, &mut ws.h, h, true).map_err(kern)?;
            let Some(sh) = shared else { return Ok(()) };
            // A shared expert of another encoding or width runs as a one-expert bank with id 0
            // for every token, weighted by its sigmoid gate (stored after the routed weights).
            let (sgu, sdn) = (cx.arena.mat(&sh.gate_up), cx.arena.mat(&sh.down));
            let gate_w = ws.route_w.slice(t * k..);
            cx.ks.moe_gate_up(cx.s, &sgu, None, &ws.a, h, t, 1, &tb.zeros, &mut ws.gu).map_err(kern)?;
            cx.ks.moe_down(cx.s, &sdn, None, &ws.gu, t, 1, &tb.zeros, &gate_w, &mut ws.h, h, true).map_err(kern)
        }
    }
}

/// Bytes per second of a device-to-device copy of a 1 GiB buffer (read plus write), the best of
/// several: the roofline figure `ninfer bench` divides by.
pub(super) fn copy_bandwidth(s: &Arc<CudaStream>) -> Result<f64, BackendError> {
    use ninfer_kernels::cudarc::driver::sys::CUevent_flags;
    const N: usize = 1 << 30;
    let what = "measuring the copy bandwidth";
    let src: CudaSlice<u8> = s.alloc_zeros(N).map_err(drv(what))?;
    let mut dst: CudaSlice<u8> = s.alloc_zeros(N).map_err(drv(what))?;
    let ctx = s.context();
    let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv(what))?;
    let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv(what))?;
    s.memcpy_dtod(&src, &mut dst).map_err(drv(what))?;
    let mut best = 0f64;
    for _ in 0..8 {
        start.record(s).map_err(drv(what))?;
        s.memcpy_dtod(&src, &mut dst).map_err(drv(what))?;
        end.record(s).map_err(drv(what))?;
        let ms = start.elapsed_ms(&end).map_err(drv(what))? as f64;
        if ms > 0.0 {
            best = best.max(2.0 * N as f64 / (ms / 1e3));
        }
    }
    Ok(best)
}
