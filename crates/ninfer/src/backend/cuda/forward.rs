//! One forward pass on the GPU over a batch of sequence segments laid out back to back
//! (model-spec.md §2.2): embed, every decoder layer, final norm, and the head on the rows that
//! want logits. Activations are bf16 with f32 math inside each kernel, the roundings of a bf16
//! transformers run (model-spec.md §2.7); logits come back to the host as f32.
//!
//! Matrix products go through the small-batch gemv kernels (on the tensor cores from 2 rows
//! for bf16, q8_g32 and q6_g64), 16 rows per launch, so a prompt chunk is processed 16 tokens at a time
//! per projection; the experts of a pass of 256 tokens or more run grouped by expert
//! (kernels/experts.cu), those of a decode batch of 4-16 tokens once per chosen expert
//! (kernels/experts_batch.cu); the GDN recurrence walks each sequence's tokens in order inside one
//! launch. Decode rows of several sequences share every launch.

use std::cell::RefCell;
use std::sync::Arc;

use half::bf16;
use ninfer_kernels::cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
use ninfer_kernels::{
    gnorm_takes_batch, route_fold_takes, AttentionBatch, AttnTiles, ConvTail, DeltaForm, GdnDims, GDN_CHUNK_MIN, GemvOut, SamplingRow, GDN_CONV_WIDTH, HeadLayout, KernelSet, KvCacheOut, MatrixView, PagedKv, RouterFold, Routing, Rows, SeqSlots, Weights,
    BATCH_MAX_TOKENS, GEMV_MAX_BATCH, GROUPED_MAX_TOKENS, NORM_BATCH_X,
};

use crate::model::ModelConfig;

use super::memory::{Dims, States, Workspace, BATCH_MIN_TOKENS, GROUPED_MIN_TOKENS, LOGIT_ROWS, PAGE};
use super::plan::PassMeta;
use super::profile::Profiler;
use super::weights::{Arena, AttnW, DevMat, GdnW, LayerW, MixerW, ModelW, MoeW, SharedW, Span};
use super::{drv, kern, BackendError};

/// Everything a pass reads and never writes.
pub(super) struct Ctx<'a> {
    pub ks: &'a KernelSet,
    pub s: &'a Arc<CudaStream>,
    pub cfg: &'a ModelConfig,
    pub dims: &'a Dims,
    pub model: &'a ModelW,
    pub arena: &'a Arena,
    /// Set when the pass is profiled (profile.rs).
    pub prof: Option<&'a RefCell<Profiler>>,
}

impl Ctx<'_> {
    /// Closes a profiled span: the launches since the previous mark, which move `bytes`.
    pub fn mark(&self, label: &'static str, bytes: usize) {
        if let Some(p) = self.prof {
            p.borrow_mut().mark(label, bytes);
        }
    }
}

/// The pass's tables as device views (offsets of plan.rs's `MetaLayout`), and the host-side
/// facts of the pass.
pub(super) struct Tables<'a> {
    pub meta: &'a PassMeta,
    pub ids: CudaView<'a, i32>,
    pos: CudaView<'a, i32>,
    kv_rows: CudaView<'a, i32>,
    zeros: CudaView<'a, i32>,
    cu: CudaView<'a, i32>,
    slots: CudaView<'a, i32>,
    kv_len: CudaView<'a, i32>,
    block_table: CudaView<'a, i32>,
}

impl<'a> Tables<'a> {
    pub fn of(tables: &'a CudaSlice<i32>, meta: &'a PassMeta) -> Self {
        let (t, seqs, ml) = (meta.tokens, meta.seqs, meta.layout());
        let view = |off: usize, n: usize| tables.slice(off..off + n);
        Tables {
            meta,
            ids: view(ml.ids(), t),
            pos: view(ml.pos(), t),
            kv_rows: view(ml.kv_rows(), t),
            zeros: view(ml.zeros(), t),
            cu: view(ml.cu(), seqs + 1),
            slots: view(ml.slots(), seqs),
            kv_len: view(ml.kv_len(), seqs),
            block_table: view(ml.block_table(), seqs * meta.bt_stride),
        }
    }
}

/// y[r] = x[r]·Wᵀ for `rows` rows, at most 16 per launch; profiled as `label`.
#[allow(clippy::too_many_arguments)] // KernelSet::gemv's list, plus the context and label
pub(super) fn linear<O: GemvOut>(
    cx: &Ctx,
    label: &'static str,
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
    cx.mark(label, w.bytes() * rows.div_ceil(GEMV_MAX_BATCH));
    Ok(())
}

/// Which of a layer's norms run inside the projections next to them (`body`).
#[derive(Clone, Copy)]
struct Fuse<'w> {
    /// The pre-mixer norm's weight, applied inside the mixer's first projection.
    norm_in: Option<Span>,
    /// The mixer's output projection adds into h, and the MoE norms h inside its router product.
    add_out: bool,
    /// The MoE router (and the post-mixer norm's weight) run by the mixer's output projection
    /// of one token as it adds into h (`RouterFold`): no router launch of its own.
    route: Option<(&'w DevMat, Span)>,
}

/// `Fuse::route`'s [`RouterFold`] for router `r` and norm weight `norm` over the workspace's
/// buffers (borrowed beside h): the normed row into `a`, the logits into `logits`, their
/// routing into `ids` and `route_w`.
fn router_fold<'a>(
    cx: &'a Ctx,
    (r, norm): (&'a MatrixView<'a>, Span),
    (acc, ticket): (&'a mut CudaSlice<i64>, &'a mut CudaSlice<u32>),
    (logits, a): (&'a mut CudaSlice<bf16>, &'a mut CudaSlice<bf16>),
    (ids, route_w): (&'a mut CudaSlice<i32>, &'a mut CudaSlice<f32>),
) -> RouterFold<'a, 'a> {
    let (d, eps) = (cx.dims, cx.cfg.rms_norm_eps);
    let (logits, a_out) = (logits.slice_mut(..r.rows), a.slice_mut(..d.h));
    let (ids, route_w) = (ids.slice_mut(..d.topk), route_w.slice_mut(..d.topk + r.rows.saturating_sub(d.e)));
    RouterFold { r, norm_w: cx.arena.bf16(norm), acc, ticket, logits, a_out, eps, routed: d.e, topk: d.topk, ids, route_w }
}

/// The output projection of a mixer over `t` rows: into `delta`, or with `add` straight into
/// the residual `h` (`y = bf16(h + bf16(x·Wᵀ))`, the add of `add_rms_norm`).
fn out_linear(
    cx: &Ctx,
    label: &'static str,
    w: &DevMat,
    x: CudaView<'_, bf16>,
    (t, ldx): (usize, usize),
    (h_rows, delta): (&mut CudaSlice<bf16>, &mut CudaSlice<bf16>),
    add: bool,
) -> Result<(), BackendError> {
    let h = cx.dims.h;
    if !add {
        return linear(cx, label, w, x, t, ldx, delta.as_view_mut(), h);
    }
    cx.ks.gemv_add(cx.s, &cx.arena.mat(w), &x, t, ldx, h_rows, h).map_err(kern)?;
    cx.mark(label, w.bytes());
    Ok(())
}

/// The first projection after a norm (a mixer's, or the router's) over `t` rows: `linear` of
/// `a`, or, with `norm` (a pass of at most 16 tokens), one launch that norms `h` with that
/// weight, stores the result in `a` for the launches after it, and multiplies.
#[allow(clippy::too_many_arguments)] // as `linear`
fn first_linear(
    cx: &Ctx,
    label: &'static str,
    w: &DevMat,
    (h_rows, a): (&CudaSlice<bf16>, &mut CudaSlice<bf16>),
    norm: Option<Span>,
    t: usize,
    mut y: CudaViewMut<'_, bf16>,
    ldy: usize,
) -> Result<(), BackendError> {
    let h = cx.dims.h;
    let Some(norm) = norm else {
        return linear(cx, label, w, a.as_view(), t, h, y, ldy);
    };
    let (nw, eps) = (cx.arena.bf16(norm), cx.cfg.rms_norm_eps);
    cx.ks.gemv_norm(cx.s, &cx.arena.mat(w), &h_rows.slice(..t * h), (t, ldy), (&nw, eps), &mut y, Some(&mut a.slice_mut(..t * h))).map_err(kern)?;
    cx.mark(label, w.bytes());
    Ok(())
}

/// What a pass hands back for its logit rows.
pub(super) enum Fetch<'o> {
    /// Vocabulary-sized f32 logits, row after row.
    Logits(&'o mut [f32]),
    /// A token per row picked on the GPU: the argmax of every row, or with `params` (one per
    /// logit row) drawn by the sampling kernel.
    Tokens { out: &'o mut [i32], params: Option<Vec<SamplingRow>> },
}

/// Uploads the pass's packed tables (plan.rs) into the device buffer every launch reads them from.
pub(super) fn upload_tables(cx: &Ctx, tables: &mut CudaSlice<i32>, meta: &PassMeta) -> Result<(), BackendError> {
    cx.s.memcpy_htod(&meta.data, &mut tables.slice_mut(..meta.data.len())).map_err(drv("uploading the step tables"))
}

/// Runs one pass eagerly: tables up, every launch, then the head over the logit rows,
/// LOGIT_ROWS at a time, and their logits or tokens back to the host.
pub(super) fn run_pass(
    cx: &Ctx,
    st: &mut States,
    ws: &mut Workspace,
    tables: &mut CudaSlice<i32>,
    meta: &PassMeta,
    mut out: Fetch,
) -> Result<(), BackendError> {
    upload_tables(cx, tables, meta)?;
    body(cx, st, ws, tables, meta)?;
    heads(cx, ws, tables, meta, &mut out)?;
    cx.s.synchronize().map_err(drv("running the step"))
}

/// The head over the pass's logit rows, LOGIT_ROWS at a time, each batch fetched into `out`.
pub(super) fn heads(cx: &Ctx, ws: &mut Workspace, tables: &CudaSlice<i32>, meta: &PassMeta, out: &mut Fetch) -> Result<(), BackendError> {
    let (n, mut c0) = (meta.logit_rows.len(), 0);
    while c0 < n {
        let rc = (n - c0).min(LOGIT_ROWS);
        head(cx, ws, tables, meta, c0, rc)?;
        fetch(cx, ws, out, c0, rc)?;
        c0 += rc;
    }
    Ok(())
}

/// Copies (or reduces on the GPU, then copies) the logits of head rows `c0..c0 + rc`, which the
/// last `head` call left in `ws.logits`, into `out`.
pub(super) fn fetch(cx: &Ctx, ws: &mut Workspace, out: &mut Fetch, c0: usize, rc: usize) -> Result<(), BackendError> {
    let v = cx.dims.v;
    match out {
        Fetch::Logits(o) => cx.s.memcpy_dtoh(&ws.logits.slice(..rc * v), &mut o[c0 * v..(c0 + rc) * v]).map_err(drv("copying logits back")),
        Fetch::Tokens { out, params } => {
            let mut ids = ws.tokens.slice_mut(..rc);
            match params {
                None => cx.ks.argmax(cx.s, &ws.logits, rc, v, v, &mut ids).map_err(kern)?,
                Some(p) => {
                    let mut dp = ws.sample_params.slice_mut(..rc);
                    cx.s.memcpy_htod(&p[c0..c0 + rc], &mut dp).map_err(drv("uploading sampling parameters"))?;
                    cx.ks.sample(cx.s, &ws.logits, rc, v, v, &dp, &mut ids, &mut ws.sample_ws).map_err(kern)?
                }
            }
            cx.s.memcpy_dtoh(&ws.tokens.slice(..rc), &mut out[c0..c0 + rc]).map_err(drv("copying tokens back"))
        }
    }
}

/// Every launch of a pass up to the final norm: stream-ordered work only, with no host
/// synchronisation or copy, so that a decode pass can be captured as a CUDA graph.
pub(super) fn body(cx: &Ctx, st: &mut States, ws: &mut Workspace, tables: &CudaSlice<i32>, meta: &PassMeta) -> Result<(), BackendError> {
    let (t, h) = (meta.tokens, cx.dims.h);
    let tb = Tables::of(tables, meta);
    // h₀ = Embed[token].
    cx.ks.embed(cx.s, &cx.arena.mat(&cx.model.embed), &tb.ids, t, &mut ws.h, h).map_err(kern)?;
    cx.mark("embed", 0);
    let (mut gi, mut ai) = (0, 0);
    for lw in &cx.model.layers {
        let index = match lw.mixer {
            MixerW::Gdn(_) => &mut gi,
            MixerW::Attn(_) => &mut ai,
        };
        layer(cx, lw, st, ws, &tb, *index)?;
        *index += 1;
    }
    final_norm(cx, ws, t, cx.model.final_norm)
}

/// RMSNorm of the residual with weight `w` into `ws.a`, where the head reads its rows.
pub(super) fn final_norm(cx: &Ctx, ws: &mut Workspace, t: usize, w: Span) -> Result<(), BackendError> {
    let rows = Rows::dense(t, cx.dims.h);
    cx.ks.rms_norm(cx.s, &ws.h, rows, &cx.arena.bf16(w), &mut ws.a, rows, cx.cfg.rms_norm_eps).map_err(kern)?;
    cx.mark("rms_norm", 0);
    Ok(())
}

/// One decoder layer on the residual `ws.h` (model-spec.md §2.1); `index` is the layer's place
/// among the layers of its mixer kind (its GDN state or KV cache).
pub(super) fn layer(cx: &Ctx, lw: &LayerW, st: &mut States, ws: &mut Workspace, tb: &Tables, index: usize) -> Result<(), BackendError> {
    let t = tb.meta.tokens;
    let rows = Rows::dense(t, cx.dims.h);
    let eps = cx.cfg.rms_norm_eps;
    // a = RMSNorm_in(h); delta = Mixer(a); h += delta; a = RMSNorm_post(h); h += MoE(a).
    // A pass of at most 16 tokens (a decode step, or a short prompt) launches neither norm on
    // its own: the mixer's first projection norms h (and stores a for the others), its output
    // projection adds into h, and the router product norms h again (storing a for the experts).
    let first = match &lw.mixer {
        MixerW::Gdn(g) => g.stack.as_ref().map_or(&g.qkv, |s| &s.m),
        MixerW::Attn(at) => at.stack.as_ref().unwrap_or(&at.q),
    };
    let router = lw.moe.router_gate.as_ref().unwrap_or(&lw.moe.router);
    let normed = t == 1 || (t <= GEMV_MAX_BATCH && t * cx.dims.h <= NORM_BATCH_X);
    let out = match &lw.mixer {
        MixerW::Gdn(g) => &g.out,
        MixerW::Attn(at) => &at.o,
    };
    let add_out = normed && router.takes_norm();
    let fold = add_out && t == 1 && route_fold_takes(&cx.arena.mat(out), &cx.arena.mat(router));
    let fuse = Fuse { norm_in: (normed && first.takes_norm()).then_some(lw.attn_norm), add_out, route: fold.then_some((router, lw.moe_norm)) };
    if fuse.norm_in.is_none() {
        cx.ks.rms_norm(cx.s, &ws.h, rows, &cx.arena.bf16(lw.attn_norm), &mut ws.a, rows, eps).map_err(kern)?;
        cx.mark("rms_norm", 0);
    }
    match &lw.mixer {
        MixerW::Gdn(g) => gdn(cx, g, st, ws, tb, index, fuse)?,
        MixerW::Attn(at) => attention(cx, at, st, ws, tb, index, fuse)?,
    }
    if !fuse.add_out {
        let moe_norm = cx.arena.bf16(lw.moe_norm);
        cx.ks.add_rms_norm(cx.s, &mut ws.h, &ws.delta, rows, &moe_norm, &mut ws.a, rows, eps).map_err(kern)?;
        cx.mark("add_rms_norm", 0);
    }
    moe(cx, &lw.moe, ws, tb, t, fuse.add_out.then_some(lw.moe_norm), fold)
}

/// The head over logit rows `c0..c0 + rc` of `meta` into `ws.logits`: the rows are gathered
/// with the embedding kernel, reading the final-normed activations as a bf16 table.
pub(super) fn head(cx: &Ctx, ws: &mut Workspace, tables: &CudaSlice<i32>, meta: &PassMeta, c0: usize, rc: usize) -> Result<(), BackendError> {
    let (h, v) = (cx.dims.h, cx.dims.v);
    let ml = meta.layout();
    let t = ws.a.len() / h;
    let table = MatrixView { weights: Weights::Bf16 { data: ws.a.slice(..t * h) }, experts: 1, rows: t, cols: h };
    let picks = tables.slice(ml.gather() + c0..ml.gather() + c0 + rc);
    cx.ks.embed(cx.s, &table, &picks, rc, &mut ws.sel, h).map_err(kern)?;
    cx.mark("head_gather", 0);
    linear::<f32>(cx, "head", &cx.model.head, ws.sel.as_view(), rc, h, ws.logits.as_view_mut(), v)
}

/// Gated DeltaNet mixer (model-spec.md §2.4) into `ws.delta`, or added into `ws.h` with
/// `fuse.add_out`.
fn gdn(cx: &Ctx, g: &GdnW, st: &mut States, ws: &mut Workspace, tb: &Tables, gi: usize, fuse: Fuse<'_>) -> Result<(), BackendError> {
    let meta = tb.meta;
    let d = cx.dims;
    let (t, h, cd, vd, hv) = (meta.tokens, d.h, d.cd, d.vd, d.hv);
    let conv_w = cx.arena.bf16(g.conv);
    // Step 1: projections. With the stacked matrix, one launch gives each token's row
    // [z | qkv | b | a] (or [qkv | b | a] with z on its own); otherwise qkv, b‖a and z come
    // from four launches into their own buffers. `q0` is where qkv starts in a `ld` row. The
    // stacked projection of a decode step (every sequence one token) norms its input and runs
    // step 2 itself; that of another pass of at most 16 tokens norms its input.
    let (ld, q0, conv_done) = match &g.stack {
        Some(stack) => {
            let ld = if stack.with_z { vd + cd + 2 * hv } else { cd + 2 * hv };
            let label = if stack.with_z { "gdn.zqkvba" } else { "gdn.qkvba" };
            let q0 = if stack.with_z { vd } else { 0 };
            match fuse.norm_in {
                Some(norm) if meta.max_q == 1 && meta.seqs == t => {
                    let tail = ConvTail { w: conv_w.slice(..), state: &mut st.conv[gi], slot: tb.slots.slice(..t), y: &mut ws.conv.slice_mut(..t * cd), lo: q0 };
                    let (nw, eps) = (cx.arena.bf16(norm), cx.cfg.rms_norm_eps);
                    let (m, hr) = (cx.arena.mat(&stack.m), ws.h.slice(..t * h));
                    cx.ks.gemv_norm_conv(cx.s, &m, &hr, t, (&nw, eps), &mut ws.proj.slice_mut(..t * ld), Some(&mut ws.a.slice_mut(..t * h)), tail).map_err(kern)?;
                    cx.mark(label, stack.m.bytes());
                    (ld, q0, true)
                }
                norm => {
                    first_linear(cx, label, &stack.m, (&ws.h, &mut ws.a), norm, t, ws.proj.as_view_mut(), ld)?;
                    (ld, q0, false)
                }
            }
        }
        None => {
            first_linear(cx, "gdn.qkv", &g.qkv, (&ws.h, &mut ws.a), fuse.norm_in, t, ws.proj.as_view_mut(), cd)?;
            linear(cx, "gdn.b", &g.b, ws.a.as_view(), t, h, ws.ba.as_view_mut(), 2 * hv)?;
            linear(cx, "gdn.a", &g.a, ws.a.as_view(), t, h, ws.ba.slice_mut(hv..), 2 * hv)?;
            (cd, 0, false)
        }
    };
    let z_stacked = g.stack.as_ref().is_some_and(|s| s.with_z);
    if !z_stacked {
        linear(cx, "gdn.z", &g.z, ws.a.as_view(), t, h, ws.z.as_view_mut(), vd)?;
    }
    let (ba, ba_ld) = match g.stack {
        Some(_) => (ws.proj.slice(q0 + cd..), ld),
        None => (ws.ba.slice(..), 2 * hv),
    };
    let batch = SeqSlots { seqs: meta.seqs, tokens: t, cu: tb.cu.slice(..), slots: tb.slots.slice(..) };
    // Step 2: causal conv + SiLU, continuing each slot's conv state.
    if !conv_done {
        let qkv = ws.proj.slice(q0..);
        cx.ks.gdn_conv(cx.s, &qkv, ld, &conv_w, cd, &mut st.conv[gi], d.slots, &batch, &mut ws.conv, cd).map_err(kern)?;
        cx.mark("gdn_conv", meta.seqs * 2 * (GDN_CONV_WIDTH - 1) * cd * 2);
    }
    // Steps 3-7: gates, q/k norms and the recurrence, token by token or in chunks.
    let dims = GdnDims { hk: cx.cfg.linear_num_key_heads, hv, dk: d.dk, dv: d.dv };
    let (a_log, dt_bias) = (cx.arena.f32(g.a_log), cx.arena.f32(g.dt_bias));
    let alpha = ba.slice(hv..);
    // The chunked kernel walks chunks shorter than GDN_CHUNK_MIN as the recurrent one does, so
    // a pass without a longer segment takes the recurrent kernel and the same bits.
    let form = if meta.max_q >= GDN_CHUNK_MIN { DeltaForm::Chunked } else { DeltaForm::Recurrent };
    cx.ks
        .gdn_delta(form, cx.s, &ws.conv, cd, &ba, &alpha, ba_ld, &a_log, &dt_bias, &mut st.rec[gi], d.slots, &batch, dims, &mut ws.mix)
        .map_err(kern)?;
    // The f32 state of each sequence is read and written once per launch.
    let label = if form == DeltaForm::Chunked { "gdn_chunked" } else { "gdn_recurrent" };
    cx.mark(label, meta.seqs * 2 * hv * d.dk * d.dv * 4);
    // Step 8: gated RMSNorm per value head with z, then the output projection. A stacked z is
    // read in place from the projection rows, so the norm writes to the z buffer instead. A
    // single token's output projection norms its own input when it adds into h.
    let norm_w = cx.arena.bf16(g.norm);
    let eps = cx.cfg.rms_norm_eps;
    let m = cx.arena.mat(&g.out);
    if fuse.add_out && ((t == 1 && g.out.takes_norm()) || gnorm_takes_batch(&m, t)) {
        let (z, ldz) = if z_stacked { (ws.proj.slice(..(t - 1) * ld + vd), ld) } else { (ws.z.slice(..t * vd), vd) };
        let x = ws.mix.slice(..t * vd);
        let (hr, norm) = (&mut ws.h.slice_mut(..t * h), (&norm_w, d.dv, eps));
        let Some((router, moe_norm)) = fuse.route else {
            cx.ks.gemv_gnorm(cx.s, &m, &x, (&z, t, ldz), norm, hr, true).map_err(kern)?;
            cx.mark("gdn.out", g.out.bytes());
            return Ok(());
        };
        let r = cx.arena.mat(router);
        let fold = router_fold(cx, (&r, moe_norm), (&mut ws.route_acc, &mut ws.route_ticket), (&mut ws.router, &mut ws.a), (&mut ws.ids, &mut ws.route_w));
        cx.ks.gemv_gnorm_route(cx.s, &m, &x, (&z, ldz), norm, hr, fold).map_err(kern)?;
        cx.mark("gdn.out+router", g.out.bytes() + router.bytes());
        return Ok(());
    }
    let normed = if z_stacked {
        cx.ks.gated_rms_norm(cx.s, &ws.mix, &ws.proj, hv, ld, &norm_w, &mut ws.z, t * hv, d.dv, eps).map_err(kern)?;
        ws.z.as_view()
    } else {
        cx.ks.gated_rms_norm(cx.s, &ws.mix, &ws.z, 1, d.dv, &norm_w, &mut ws.proj, t * hv, d.dv, eps).map_err(kern)?;
        ws.proj.as_view()
    };
    cx.mark("gated_rms_norm", 0);
    out_linear(cx, "gdn.out", &g.out, normed, (t, vd), (&mut ws.h, &mut ws.delta), fuse.add_out)
}

/// Gated full attention (model-spec.md §2.3) into `ws.delta`.
fn attention(cx: &Ctx, at: &AttnW, st: &mut States, ws: &mut Workspace, tb: &Tables, ai: usize, fuse: Fuse<'_>) -> Result<(), BackendError> {
    let meta = tb.meta;
    let d = cx.dims;
    let (t, h, hq, hkv, dd) = (meta.tokens, d.h, d.hq, d.hkv, d.d);
    // Steps 1-2: each token's row of proj holds per q head D query values then D gate values,
    // then k, then v: one launch of the stacked matrix, or three.
    let (ld, k0, v0) = (d.qkv_ld(), 2 * hq * dd, 2 * hq * dd + hkv * dd);
    match &at.stack {
        Some(m) => first_linear(cx, "attn.qkv", m, (&ws.h, &mut ws.a), fuse.norm_in, t, ws.proj.as_view_mut(), ld)?,
        None => {
            first_linear(cx, "attn.q", &at.q, (&ws.h, &mut ws.a), fuse.norm_in, t, ws.proj.as_view_mut(), ld)?;
            linear(cx, "attn.k", &at.k, ws.a.as_view(), t, h, ws.proj.slice_mut(k0..), ld)?;
            linear(cx, "attn.v", &at.v, ws.a.as_view(), t, h, ws.proj.slice_mut(v0..), ld)?;
        }
    }
    let ql = HeadLayout { heads: hq, ld, head_stride: 2 * dd };
    let kl = HeadLayout { heads: hkv, ld, head_stride: dd };
    // Steps 3-4: q/k norms and partial RoPE at each token's position; the same launch writes
    // the tokens' k and v rows into this layer's cache.
    let (qn, kn) = (cx.arena.bf16(at.q_norm), cx.arena.bf16(at.k_norm));
    let theta = cx.cfg.rope_theta as f32;
    let (kc, vc) = &mut st.kv[ai];
    let cache = KvCacheOut { v_at: v0, v_layout: kl, slots: tb.kv_rows.slice(..), k_cache: kc.slice_mut(..), v_cache: vc.slice_mut(..), cache_rows: d.cache_rows() };
    cx.ks
        .qk_norm_rope(cx.s, &mut ws.proj, ql, k0, kl, t, dd, cx.cfg.rotary_dim, Some(&qn), Some(&kn), &tb.pos, theta, cx.cfg.rms_norm_eps, Some(cache))
        .map_err(kern)?;
    cx.mark("qk_norm_rope", 0);
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
    // The tensor-core kernel wherever the head dim allows it.
    let tiles = if dd.is_multiple_of(16) { AttnTiles::Mma } else { AttnTiles::Simt };
    if meta.max_q == 1 {
        // Decode: few query rows, long caches; the cache is cut into ranges over more blocks.
        cx.ks.attention_split_kv(tiles, cx.s, &ws.proj, ql, Some(&gate), &kv, &batch, scale, &mut ws.mix, &mut ws.attn_part).map_err(kern)?;
    } else {
        cx.ks.attention(tiles, cx.s, &ws.proj, ql, Some(&gate), &kv, &batch, scale, &mut ws.mix).map_err(kern)?;
    }
    // Every sequence reads its K and V rows (the longest bounds the others).
    cx.mark("attention", meta.seqs * meta.max_kv * 2 * hkv * dd * 2);
    // Step 7: output projection.
    if let Some((router, moe_norm)) = fuse.route {
        let (m, r) = (cx.arena.mat(&at.o), cx.arena.mat(router));
        let fold = router_fold(cx, (&r, moe_norm), (&mut ws.route_acc, &mut ws.route_ticket), (&mut ws.router, &mut ws.a), (&mut ws.ids, &mut ws.route_w));
        cx.ks.gemv_add_route(cx.s, &m, &ws.mix.slice(..hq * dd), &mut ws.h.slice_mut(..h), fold).map_err(kern)?;
        cx.mark("attn.o+router", at.o.bytes() + router.bytes());
        return Ok(());
    }
    out_linear(cx, "attn.o", &at.o, ws.mix.as_view(), (t, hq * dd), (&mut ws.h, &mut ws.delta), fuse.add_out)
}

/// Sparse MoE block (model-spec.md §2.5), added into the residual `ws.h` in bf16.
fn moe(cx: &Ctx, mw: &MoeW, ws: &mut Workspace, tb: &Tables, t: usize, norm: Option<Span>, folded: bool) -> Result<(), BackendError> {
    let (h, e, k) = (cx.dims.h, cx.dims.e, cx.dims.topk);
    // Router logits, and the shared expert's gate logit in column E of the same rows: one
    // launch of the stacked matrix, or two (with `norm`, a single-token pass, the first norms
    // h and stores a). Then the routing: a single token whose router the output projection
    // ran (`folded`) on every router row (the shared gate stacked, or no shared expert) was
    // routed there too; another single token whose shared expert rides in the experts'
    // launches (or that has none) is routed by the expert kernels themselves (experts.cu),
    // every other pass by its own launch.
    if let Some(m) = &mw.router_gate {
        if !folded {
            first_linear(cx, "moe.router_gate", m, (&ws.h, &mut ws.a), norm, t, ws.router.as_view_mut(), e + 1)?;
        }
    } else {
        if !folded {
            first_linear(cx, "moe.router", &mw.router, (&ws.h, &mut ws.a), norm, t, ws.router.as_view_mut(), e + 1)?;
        }
        if let Some(sh) = &mw.shared {
            linear(cx, "moe.shared_gate", &sh.gate, ws.a.as_view(), t, h, ws.router.slice_mut(e..), e + 1)?;
        }
    }
    let routed = folded && (mw.router_gate.is_some() || mw.shared.is_none());
    let in_experts = !routed && t == 1 && (mw.shared.is_none() || mw.fused);
    if !routed && !in_experts {
        cx.ks.moe_route(cx.s, &ws.router, e + 1, t, e, k, mw.shared.is_some(), &mut ws.ids, &mut ws.route_w).map_err(kern)?;
        cx.mark("moe.route", 0);
    }
    experts(cx, mw, ws, tb, t, in_experts)
}

/// The routed and shared experts, added into the residual `ws.h`: of the ids `moe_route` (or
/// the folded router) chose, or with `in_experts` routed by the expert kernels from the one
/// token's logits.
fn experts(cx: &Ctx, mw: &MoeW, ws: &mut Workspace, tb: &Tables, t: usize, in_experts: bool) -> Result<(), BackendError> {
    let d = cx.dims;
    let (h, e, k) = (d.h, d.e, d.topk);
    // Of each bank, the experts the tokens chose (at most all of them); the shared expert once.
    let touched = |bank: &DevMat| bank.bytes() / e * (t * k).min(e);
    let shared = |f: fn(&SharedW) -> &DevMat| mw.shared.as_ref().map_or(0, |sh| f(sh).bytes());
    let (gu, dn) = (cx.arena.mat(&mw.gate_up), cx.arena.mat(&mw.down));
    let prompt = grouped(mw, d, t);
    if prompt || (!in_experts && batch(mw, d, t)) {
        // Each chosen expert runs once for every slot that chose it: grouped by expert for a
        // prompt pass, on the batch kernels for a decode batch; the slots then summed.
        let (sgu, sdn) = match &mw.shared {
            Some(sh) => (Some(cx.arena.mat(&sh.gate_up)), Some(cx.arena.mat(&sh.down))),
            None => (None, None),
        };
        let (gu_bytes, dn_bytes) = (touched(&mw.gate_up) + shared(|sh| &sh.gate_up), touched(&mw.down) + shared(|sh| &sh.down));
        if prompt {
            cx.ks.moe_gate_up_grouped(cx.s, &gu, sgu.as_ref(), &ws.a, h, t, k, &ws.ids, &mut ws.gu).map_err(kern)?;
            cx.mark("moe.gate_up_grouped", gu_bytes);
            cx.ks.moe_down_grouped(cx.s, &dn, sdn.as_ref(), &ws.gu, t, k, &ws.ids, &ws.route_w, &mut ws.moe_part).map_err(kern)?;
            cx.mark("moe.down_grouped", dn_bytes);
        } else {
            cx.ks.moe_gate_up_batch(cx.s, &gu, sgu.as_ref(), &ws.a, h, (t, k), &ws.ids, &mut ws.gu).map_err(kern)?;
            cx.mark("moe.gate_up_batch", gu_bytes);
            cx.ks.moe_down_batch(cx.s, &dn, sdn.as_ref(), &ws.gu, (t, k), &ws.ids, &ws.route_w, &mut ws.moe_part).map_err(kern)?;
            cx.mark("moe.down_batch", dn_bytes);
        }
        cx.ks.moe_combine(cx.s, &ws.moe_part, &ws.ids, t, k, e, mw.shared.is_some(), &mut ws.h, h, h).map_err(kern)?;
        cx.mark("moe.combine", 0);
        return Ok(());
    }
    let routing = if in_experts {
        Routing::Logits(ws.router.slice(..e + 1))
    } else {
        Routing::Table { ids: ws.ids.slice(..), w: ws.route_w.slice(..) }
    };
    let fused = mw.shared.as_ref().filter(|_| mw.fused).map(|sh| (cx.arena.mat(&sh.gate_up), cx.arena.mat(&sh.down)));
    cx.ks.moe_gate_up(cx.s, &gu, fused.as_ref().map(|f| &f.0), &ws.a, h, (t, k), &routing, &mut ws.gu).map_err(kern)?;
    cx.mark("moe.gate_up", touched(&mw.gate_up) + if fused.is_some() { shared(|sh| &sh.gate_up) } else { 0 });
    cx.ks.moe_down(cx.s, &dn, fused.as_ref().map(|f| &f.1), &ws.gu, (t, k), &routing, &mut ws.h, h, true).map_err(kern)?;
    cx.mark("moe.down", touched(&mw.down) + if fused.is_some() { shared(|sh| &sh.down) } else { 0 });
    let Some(sh) = mw.shared.as_ref().filter(|_| !mw.fused) else { return Ok(()) };
    // A shared expert of another encoding or width runs as a one-expert bank with id 0 for
    // every token, weighted by its sigmoid gate (stored after the routed weights).
    let (sgu, sdn) = (cx.arena.mat(&sh.gate_up), cx.arena.mat(&sh.down));
    let alone = Routing::Table { ids: tb.zeros.slice(..), w: ws.route_w.slice(t * k..) };
    cx.ks.moe_gate_up(cx.s, &sgu, None, &ws.a, h, (t, 1), &alone, &mut ws.gu).map_err(kern)?;
    cx.mark("moe.shared_gate_up", sh.gate_up.bytes());
    cx.ks.moe_down(cx.s, &sdn, None, &ws.gu, (t, 1), &alone, &mut ws.h, h, true).map_err(kern)?;
    cx.mark("moe.shared_down", sh.down.bytes());
    Ok(())
}

/// Whether a pass of `t` tokens runs its experts on the batch kernels, once per chosen expert
/// (kernels/experts_batch.cu): 4-16 tokens (one layer's experts in the kernel bench on an H200:
/// 37.6 against 47.8 µs per slot at 4 tokens, 29.9 against 29.3 at 2), NVFP4 banks with the
/// shared expert in the same launches (or none), H a multiple of 128 and I of 512.
fn batch(mw: &MoeW, d: &Dims, t: usize) -> bool {
    let nvfp4 = mw.gate_up.is_nvfp4() && mw.down.is_nvfp4();
    let shapes = d.h.is_multiple_of(128) && d.inter.is_multiple_of(512);
    (BATCH_MIN_TOKENS..=BATCH_MAX_TOKENS).contains(&t) && nvfp4 && (mw.shared.is_none() || mw.fused) && shapes
}

/// Whether a pass of `t` tokens runs its experts grouped (kernels/experts.cu): NVFP4 banks, a
/// shared expert riding in the same launches (or none), and shapes the grouped kernels take.
fn grouped(mw: &MoeW, d: &Dims, t: usize) -> bool {
    let nvfp4 = mw.gate_up.is_nvfp4() && mw.down.is_nvfp4();
    let shapes = d.h.is_multiple_of(32) && d.inter.is_multiple_of(32) && d.h.max(d.inter) <= 2048;
    (GROUPED_MIN_TOKENS..=GROUPED_MAX_TOKENS).contains(&t) && nvfp4 && (mw.shared.is_none() || mw.fused) && shapes
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
