//! Launchers of the fused projections (kernels/fused.cu, and `gemv_add` of kernels/gemv.cu):
//! rows normed inside their product (`gemv_norm`, one row or a batch of up to 16), the same
//! with the GDN conv in its epilogue (`gemv_norm_conv`), a row gated-normed inside its product
//! (`gemv_gnorm`), a product added into the residual stream (`gemv_add`); the last two with
//! the MoE router of the same layer folded in (`gemv_gnorm_route`, `gemv_add_route`).

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, SyncOnDrop};
use half::bf16;

use crate::gdn::GDN_CONV_WIDTH;
use crate::gemv::{bulk_cols, is_bulk, rows_ld, span, Encoding, GemvArgs, GemvOut, MatrixView, Weights, GEMV_MAX_BATCH, ROWS_PER_BLOCK};
use crate::launch::{blocks, device_args, dptr, dptr_mut, Check, Result};
use crate::loader::KernelSet;
use crate::moe::ROUTE_MAX_EXPERTS;
use crate::table::Kernel;

#[repr(C)]
struct GemvNormArgs {
    g: GemvArgs,
    norm_w: u64,
    a_out: u64,
    eps: f32,
    pad: i32,
}
device_args!(GemvNormArgs, 112);

#[repr(C)]
struct NormConvArgs {
    n: GemvNormArgs,
    conv_w: u64,
    state: u64,
    conv_y: u64,
    slot: u64,
    lo: i32,
    channels: i32,
}
device_args!(NormConvArgs, 152);

#[repr(C)]
struct GatedArgs {
    g: GemvArgs,
    z: u64,
    norm_w: u64,
    dim: i32,
    eps: f32,
    ldz: i32,
    pad: i32,
}
device_args!(GatedArgs, 120);

#[repr(C)]
struct RouterFoldArgs {
    r: u64,
    norm_w: u64,
    acc: u64,
    ticket: u64,
    logits: u64,
    a_out: u64,
    ids: u64,
    route_w: u64,
    experts: i32,
    eps: f32,
    routed: i32,
    topk: i32,
}
device_args!(RouterFoldArgs, 80);

#[repr(C)]
struct GatedRouteArgs {
    g: GatedArgs,
    f: RouterFoldArgs,
}
device_args!(GatedRouteArgs, 200);

#[repr(C)]
struct GemvRouteArgs {
    g: GemvArgs,
    f: RouterFoldArgs,
}
device_args!(GemvRouteArgs, 168);

/// The MoE router that a one-row output projection runs on the row it adds into h
/// ([`KernelSet::gemv_gnorm_route`], [`KernelSet::gemv_add_route`]):
/// `a = bf16(h / rms(h) · (1 + norm_w))` into `a_out` (the bits of [`KernelSet::rms_norm`]) and
/// `logits[e] = bf16(Σ_d r[e, d] · (1 + norm_w[d]) · h[d] / rms(h))`, the normed router product
/// without a's rounding (kernels/route_fold.cuh); then the routing of those logits that
/// [`KernelSet::moe_route`] gives one token, into `ids` and `route_w`.
pub struct RouterFold<'a, 'b> {
    /// `[experts, h]` bf16 router rows (the routed experts', then the shared expert's gate), at
    /// most [`FOLD_MAX_EXPERTS`].
    pub r: &'b MatrixView<'a>,
    /// `[h]` the post-mixer norm's weight.
    pub norm_w: CudaView<'a, bf16>,
    /// `[experts]` the blocks' sums: zero at launch (allocated zeroed), and left zero.
    pub acc: &'b mut CudaSlice<i64>,
    /// The blocks' ticket: zero at launch, and left zero.
    pub ticket: &'b mut CudaSlice<u32>,
    /// `[experts]` the router logits.
    pub logits: CudaViewMut<'a, bf16>,
    /// `[h]` the normed row.
    pub a_out: CudaViewMut<'a, bf16>,
    pub eps: f32,
    /// The routed experts among the router rows: all of them, or all but the last, the shared
    /// expert's gate row.
    pub routed: usize,
    pub topk: usize,
    /// `[topk]` the picks, as [`KernelSet::moe_route`] writes them for one token.
    pub ids: CudaViewMut<'a, i32>,
    /// `[topk]` their weights, then (with the gate row) the shared expert's: `[topk + 1]`.
    pub route_w: CudaViewMut<'a, f32>,
}

/// The most router rows [`RouterFold`] takes (FOLD_MAX_E in route_fold.cuh).
pub const FOLD_MAX_EXPERTS: usize = 512;

/// The GDN conv a normed product runs on its rows `lo..lo + w.len() / 4` of each input row
/// ([`KernelSet::gemv_norm_conv`]), every row a one-token sequence.
pub struct ConvTail<'a, 'b> {
    /// `[C, 4]` conv weights.
    pub w: CudaView<'a, bf16>,
    /// `[num_slots, 3, C]` conv states.
    pub state: &'b mut CudaSlice<bf16>,
    /// Each row's state slot (one i32 per row on the device).
    pub slot: CudaView<'a, i32>,
    /// `[rows, C]` conv outputs.
    pub y: &'b mut CudaViewMut<'a, bf16>,
    /// The first conv row of the product.
    pub lo: usize,
}

/// Blocks per cluster of the gated-norm products (GNORM_CLUSTER in fused.cu).
const GNORM_CLUSTER: u32 = 8;

impl KernelSet {
    /// Rows normed and multiplied in one launch: `a = bf16(x / rms(x) · (1 + norm_w))` (the
    /// zero-centred RMSNorm of [`KernelSet::rms_norm`]) of each of `batch` (1..=16) dense rows of
    /// `x` and `y[b] = a[b] · Wᵀ` (`[batch, ldy]`), bit for bit what the two launches give; with
    /// `a_out`, `a` is stored there too (`[batch, cols]`). bf16 and q8_g32 matrices; 2-16 rows
    /// on the tensor cores, at most [`NORM_BATCH_X`] x elements.
    pub fn gemv_norm<O: GemvOut>(
        &self,
        stream: &CudaStream,
        w: &MatrixView,
        x: &impl DevicePtr<bf16>,
        (batch, ldy): (usize, usize),
        (norm_w, eps): (&impl DevicePtr<bf16>, f32),
        y: &mut impl DevicePtrMut<O>,
        a_out: Option<&mut CudaViewMut<'_, bf16>>,
    ) -> Result<()> {
        let c = normed_check(w, batch, false)?;
        c.ensure(ldy >= w.rows, || format!("ldy {ldy} < rows {}", w.rows))?;
        let (yl, (yp, _gy)) = (y.len(), dptr_mut(y, stream));
        c.len("y", yl, span(batch, w.rows, ldy))?;
        self.launch_normed(&c, stream, w, (x, norm_w, eps), (batch, ldy), (yp, O::IS_F32), a_out, |args| args)
    }

    /// [`KernelSet::gemv_norm`] into bf16 `y` (`[batch, rows]`), then [`KernelSet::gdn_conv`]
    /// on the rows `conv.lo..conv.lo + C` of each of the `batch` rows, row b a one-token
    /// sequence in state slot `conv.slot[b]`: bit for bit what the three launches give.
    pub fn gemv_norm_conv(
        &self,
        stream: &CudaStream,
        w: &MatrixView,
        x: &impl DevicePtr<bf16>,
        batch: usize,
        (norm_w, eps): (&impl DevicePtr<bf16>, f32),
        y: &mut impl DevicePtrMut<bf16>,
        a_out: Option<&mut CudaViewMut<'_, bf16>>,
        conv: ConvTail,
    ) -> Result<()> {
        let c = normed_check(w, batch, true)?;
        let ch = conv.w.len() / GDN_CONV_WIDTH;
        c.ensure(ch > 0 && conv.lo + ch <= w.rows, || format!("conv rows {}..{} of {} rows", conv.lo, conv.lo + ch, w.rows))?;
        c.ensure(conv.state.len().is_multiple_of((GDN_CONV_WIDTH - 1) * ch), || format!("conv state of {} for {ch} channels", conv.state.len()))?;
        // The lane-loaded kernel's lane k convolves its warp's k-th row (fused.cu); the bulk
        // kernel's thread i its block's row i, which bulk_launch checks.
        if batch == 1 && !is_bulk(c.kernel) {
            let per_warp = w.rows.div_ceil(self.row_grid(c.kernel, w.rows) as usize * ROWS_PER_BLOCK);
            c.ensure(per_warp <= 32, || format!("{} rows take {per_warp} per warp on this card, more than the conv epilogue's 32", w.rows))?;
        }
        let (yl, sl, (yp, _gy)) = (y.len(), conv.slot.len(), dptr_mut(y, stream));
        c.len("y", yl, batch * w.rows)?;
        c.len("slot", sl, batch)?;
        c.len("conv y", conv.y.len(), batch * ch)?;
        let (cwp, _gw) = conv.w.device_ptr(stream);
        c.aligned("conv w", cwp, 8)?;
        let (slp, _gsl) = conv.slot.device_ptr(stream);
        let (stp, _gst) = conv.state.device_ptr_mut(stream);
        let (cyp, _gcy) = conv.y.device_ptr_mut(stream);
        let (lo, channels) = (c.i32("lo", conv.lo)?, c.i32("channels", ch)?);
        let rows = (batch, w.rows);
        self.launch_normed(&c, stream, w, (x, norm_w, eps), rows, (yp, false), a_out, |n| NormConvArgs { n, conv_w: cwp, state: stp, conv_y: cyp, slot: slp, lo, channels })
    }

    /// `y (+)= a·Wᵀ` for `batch` rows (1..=8; `y` `[batch, rows]`), `a` the gated RMSNorm of
    /// [`KernelSet::gated_rms_norm`] of each row of `x` (`[batch, cols]`, `w.cols / dim` heads
    /// of `dim`) with its gates (row b at `z[b * ldz..]`, `w.cols` of them) and weight `norm_w`
    /// (`[dim]`); with `accumulate`, `y = bf16(y + bf16(a·Wᵀ))` as [`KernelSet::gemv_add`]. One
    /// row: bf16 and q8_g32 matrices, bit for bit the two launches; 2-8 rows: q8_g32 matrices
    /// that [`gnorm_takes_batch`] names, bit for bit the norm then [`KernelSet::gemv_add`].
    pub fn gemv_gnorm(
        &self,
        stream: &CudaStream,
        w: &MatrixView,
        x: &impl DevicePtr<bf16>,
        (z, batch, ldz): (&impl DevicePtr<bf16>, usize, usize),
        (norm_w, dim, eps): (&impl DevicePtr<bf16>, usize, f32),
        y: &mut impl DevicePtrMut<bf16>,
        accumulate: bool,
    ) -> Result<()> {
        self.gnorm_with(stream, w, x, (z, batch, ldz), (norm_w, dim, eps), y, accumulate, None)
    }

    /// [`KernelSet::gemv_gnorm`] of one row added into `h` (`[w.rows]`, a mixer's output
    /// projection), then the MoE router of `fold` on the new row, in one launch: q8_g32
    /// matrices of the bulk-copy kernel, `h` the same bits as without the fold.
    pub fn gemv_gnorm_route(
        &self,
        stream: &CudaStream,
        w: &MatrixView,
        x: &impl DevicePtr<bf16>,
        (z, ldz): (&impl DevicePtr<bf16>, usize),
        (norm_w, dim, eps): (&impl DevicePtr<bf16>, usize, f32),
        h: &mut impl DevicePtrMut<bf16>,
        fold: RouterFold,
    ) -> Result<()> {
        self.gnorm_with(stream, w, x, (z, 1, ldz), (norm_w, dim, eps), h, true, Some(fold))
    }

    /// [`KernelSet::gemv_add`] of one row (`h` `[w.rows]`), then the MoE router of `fold` on
    /// the new row, in one launch: q8_g32 matrices of the bulk-copy kernel, `h` the same bits
    /// as [`KernelSet::gemv_add`] gives.
    pub fn gemv_add_route(&self, stream: &CudaStream, w: &MatrixView, x: &impl DevicePtr<bf16>, h: &mut impl DevicePtrMut<bf16>, fold: RouterFold) -> Result<()> {
        let c = Check::new(Kernel::GemvQ8BulkRouteB1);
        c.ensure(bulk_cols(w, 1), || format!("no router fold on a {:?} product of {} columns", w.encoding(), w.cols))?;
        let hl = h.len();
        c.len("h", hl, w.rows)?;
        let (hp, _gh) = dptr_mut(h, stream);
        let mut fold = fold;
        let (f, _gf) = fold_args(&c, stream, w.rows, &mut fold)?;
        self.launch_row(&c, stream, w, x, (1, w.rows), (hp, false, true), (1, 0), |g| GemvRouteArgs { g, f })
    }

    #[allow(clippy::too_many_arguments)] // gemv_gnorm's, and the fold
    fn gnorm_with(
        &self,
        stream: &CudaStream,
        w: &MatrixView,
        x: &impl DevicePtr<bf16>,
        (z, batch, ldz): (&impl DevicePtr<bf16>, usize, usize),
        (norm_w, dim, eps): (&impl DevicePtr<bf16>, usize, f32),
        y: &mut impl DevicePtrMut<bf16>,
        accumulate: bool,
        fold: Option<RouterFold>,
    ) -> Result<()> {
        let c = match (bulk_cols(w, batch), batch) {
            (true, 1) if fold.is_some() => Check::new(Kernel::GemvQ8GnormBulkRouteB1),
            (_, _) if fold.is_some() => return Err(Check::new(Kernel::GemvQ8GnormBulkRouteB1).fail(format!("no router fold on a gated-norm product of {batch} rows for {:?} of {} columns", w.encoding(), w.cols))),
            (true, 1) => Check::new(Kernel::GemvQ8GnormBulkB1),
            (false, 1) => fused_check(w, (Kernel::GemvBf16GnormB1, Kernel::GemvQ8GnormB1), "gated-norm")?,
            (true, 2..=BULK_FUSED_MAX_BATCH) => Check::new(Kernel::GemvQ8GnormBulkB8),
            _ => return Err(Check::new(Kernel::GemvQ8GnormBulkB8).fail(format!("no gated-norm product of {batch} rows for {:?} of {} columns", w.encoding(), w.cols))),
        };
        c.ensure(dim > 0 && dim.is_multiple_of(8) && w.cols.is_multiple_of(dim), || format!("{} columns are not heads of {dim} (a multiple of 8)", w.cols))?;
        // The one-row bulk kernels build the gated row in every block, a head's chunks summed
        // by a power-of-two group of lanes of one warp; they keep their clusters only for when
        // their blocks become resident (fused.cu's header).
        let one_row = matches!(c.kernel, Kernel::GemvQ8GnormBulkB1 | Kernel::GemvQ8GnormBulkRouteB1);
        c.ensure(!one_row || (dim / 8).is_power_of_two() && dim <= 256, || format!("heads of {dim}: dim / 8 is not a power of two of at most 32"))?;
        c.ensure(ldz >= w.cols && ldz.is_multiple_of(8), || format!("z row stride {ldz} (a multiple of 8, at least {})", w.cols))?;
        let (zl, nl, yl) = (z.len(), norm_w.len(), y.len());
        c.len("z", zl, span(batch, w.cols, ldz))?;
        c.len("norm_w", nl, dim)?;
        c.len("y", yl, batch * w.rows)?;
        let (zp, _gz) = dptr(z, stream);
        let (np, _gn) = dptr(norm_w, stream);
        let (yp, _gy) = dptr_mut(y, stream);
        c.aligned("z", zp, 16)?;
        c.aligned("norm_w", np, 16)?;
        let (dim, ldz) = (c.i32("dim", dim)?, c.i32("ldz", ldz)?);
        let (rows, out, grid) = ((batch, w.rows), (yp, false, accumulate), (GNORM_CLUSTER, batch * rows_ld(w.cols) * 2));
        let gated = |g| GatedArgs { g, z: zp, norm_w: np, dim, eps, ldz, pad: 0 };
        match fold {
            None => self.launch_row(&c, stream, w, x, rows, out, grid, gated),
            Some(mut fold) => {
                let (f, _gf) = fold_args(&c, stream, w.rows, &mut fold)?;
                self.launch_row(&c, stream, w, x, rows, out, grid, |g| GatedRouteArgs { g: gated(g), f })
            }
        }
    }

    /// `y = bf16(y + bf16(x·Wᵀ))` for `batch` rows: a projection added into the residual stream
    /// in the model dtype, as a product and `add_rms_norm`'s add give it.
    pub fn gemv_add(
        &self,
        stream: &CudaStream,
        w: &MatrixView,
        x: &impl DevicePtr<bf16>,
        batch: usize,
        ldx: usize,
        y: &mut impl DevicePtrMut<bf16>,
        ldy: usize,
    ) -> Result<()> {
        self.gemv_with(stream, w, x, batch, ldx, y, ldy, true)
    }
}

/// Whether a one-row output projection `out` can run the router `r` on the row it adds into h
/// ([`RouterFold`]): `out` on the bulk-copy kernel (q8_g32), `r` bf16 rows of `out.rows`.
pub fn route_fold_takes(out: &MatrixView, r: &MatrixView) -> bool {
    bulk_cols(out, 1)
        && r.encoding() == Encoding::Bf16
        && r.experts == 1
        && r.cols == out.rows
        && (1..=FOLD_MAX_EXPERTS).contains(&r.rows)
        && out.rows.is_multiple_of(8)
        && out.rows <= NORM_MAX_K
}

/// The kernel arguments of `fold` for a projection of `h` rows (the new row's length), with the
/// guards of its device addresses.
fn fold_args<'s>(c: &Check, stream: &'s CudaStream, h: usize, fold: &'s mut RouterFold) -> Result<(RouterFoldArgs, Vec<SyncOnDrop<'s>>)> {
    let RouterFold { r, norm_w, acc, ticket, logits, a_out, eps, routed, topk, ids, route_w } = fold;
    let Weights::Bf16 { data } = &r.weights else {
        return Err(c.fail(format!("the folded router is bf16, got {:?}", r.encoding())));
    };
    let experts = r.rows;
    c.ensure(r.experts == 1 && r.cols == h, || format!("a router of {}x{}x{} for rows of {h}", r.experts, r.rows, r.cols))?;
    c.ensure((1..=FOLD_MAX_EXPERTS).contains(&experts), || format!("{experts} router rows (1..={FOLD_MAX_EXPERTS})"))?;
    c.ensure(h.is_multiple_of(8) && h <= NORM_MAX_K, || format!("rows of {h} (a multiple of 8, at most {NORM_MAX_K})"))?;
    c.len("router", data.len(), experts * h)?;
    c.len("norm_w", norm_w.len(), h)?;
    c.len("acc", acc.len(), experts)?;
    c.len("ticket", ticket.len(), 1)?;
    c.len("logits", logits.len(), experts)?;
    c.len("a_out", a_out.len(), h)?;
    let (routed, topk) = (*routed, *topk);
    let fits = routed <= experts && experts - routed <= 1 && routed <= ROUTE_MAX_EXPERTS && (1..=routed.min(32)).contains(&topk);
    c.ensure(fits, || format!("top-{topk} of {routed} routed experts among {experts} router rows"))?;
    let gate = experts - routed;
    c.len("ids", ids.len(), topk)?;
    c.len("route_w", route_w.len(), topk + gate)?;
    let mut guards = Vec::new();
    let mut keep = |what: &str, (p, g): (u64, SyncOnDrop<'s>), align: u64| {
        guards.push(g);
        c.aligned(what, p, align).map(|()| p)
    };
    let args = RouterFoldArgs {
        r: keep("router", data.device_ptr(stream), 16)?,
        norm_w: keep("norm_w", norm_w.device_ptr(stream), 16)?,
        acc: keep("acc", acc.device_ptr_mut(stream), 8)?,
        ticket: keep("ticket", ticket.device_ptr_mut(stream), 4)?,
        logits: keep("logits", logits.device_ptr_mut(stream), 2)?,
        a_out: keep("a_out", a_out.device_ptr_mut(stream), 16)?,
        ids: keep("ids", ids.device_ptr_mut(stream), 4)?,
        route_w: keep("route_w", route_w.device_ptr_mut(stream), 4)?,
        experts: experts as i32,
        eps: *eps,
        routed: routed as i32,
        topk: topk as i32,
    };
    Ok((args, guards))
}

/// The most rows a fused bulk-copy product takes (normed, normed with the conv, gated-normed):
/// of 9-16 rows they made a decode step of 16 sequences slower than the tensor-core normed
/// products and the gated norm as its own launch (tg128 x16 2,028.4 tok/s without them
/// against 1,798.8 with them, H100, docs/performance-log.md 2026-12-05), so those take 9-16
/// rows.
const BULK_FUSED_MAX_BATCH: usize = 8;

/// Whether [`KernelSet::gemv_gnorm`] takes `batch` rows (2..=8) of `w`: q8_g32 of K % 256 == 0
/// and K <= 4096, on the bulk-copy kernel.
pub fn gnorm_takes_batch(w: &MatrixView, batch: usize) -> bool {
    (2..=BULK_FUSED_MAX_BATCH).contains(&batch) && bulk_cols(w, batch)
}

/// The check of a fused product over `w`: its bf16 or its q8_g32 kernel, the only encodings
/// fused.cu has.
fn fused_check(w: &MatrixView, (bf16, q8): (Kernel, Kernel), what: &str) -> Result<Check> {
    match w.encoding() {
        Encoding::Bf16 => Ok(Check::new(bf16)),
        Encoding::Q8G32 => Ok(Check::new(q8)),
        other => Err(Check::new(q8).fail(format!("no {what} gemv for {other:?}"))),
    }
}

/// The check of a normed product (with the conv epilogue or without) of `batch` rows: the
/// one-row kernel, the bulk-copy one of 2-8 rows, or the tensor-core one of 2-8 or 9-16 rows.
fn normed_check(w: &MatrixView, batch: usize, conv: bool) -> Result<Check> {
    use Kernel::*;
    let kernels = match conv {
        false => [(GemvBf16NormB1, GemvQ8NormB1), (GemvBf16NormMmaB8, GemvQ8NormMmaB8), (GemvBf16NormMmaB16, GemvQ8NormMmaB16)],
        true => [(GemvBf16NormConvB1, GemvQ8NormConvB1), (GemvBf16NormConvMmaB8, GemvQ8NormConvMmaB8), (GemvBf16NormConvMmaB16, GemvQ8NormConvMmaB16)],
    };
    let bucket = match batch {
        0 | 1 => 0,
        2..=8 => 1,
        _ => 2,
    };
    let c = match (bulk_cols(w, batch), batch, conv) {
        (true, 1, false) => Check::new(GemvQ8NormBulkB1),
        (true, 1, true) => Check::new(GemvQ8NormConvBulkB1),
        (true, 2..=BULK_FUSED_MAX_BATCH, false) => Check::new(GemvQ8NormBulkB8),
        (true, 2..=BULK_FUSED_MAX_BATCH, true) => Check::new(GemvQ8NormConvBulkB8),
        _ => fused_check(w, kernels[bucket], "normed")?,
    };
    c.ensure((1..=GEMV_MAX_BATCH).contains(&batch), || format!("batch {batch} outside 1..={GEMV_MAX_BATCH}"))?;
    Ok(c)
}

/// The longest row a normed product takes (its copy in shared memory, kernels/fused.cu).
const NORM_MAX_K: usize = 8192;

/// The most x elements (rows times K) a normed product of 2-16 rows holds in shared memory:
/// 16 rows of 2,048 or 8 of 4,096, 87 KiB with the padding, the norm weight and the chunks'
/// sums (`norm_smem`), so that two blocks fit an SM.
pub const NORM_BATCH_X: usize = 32_768;

/// A normed tensor-core product's dynamic shared memory (fused.cu): the rows (stride NORM_LD),
/// the norm weight, and each 8-column chunk's sum of squares.
fn norm_smem(batch: usize, k: usize) -> usize {
    batch * rows_ld(k) * 2 + k * 2 + batch * k / 8 * 4
}

impl KernelSet {
    /// Checks and launches a normed product of `batch` rows writing `y` (its device address,
    /// and whether it is f32) with row stride `ldy`; `args` wraps the product's arguments into
    /// the kernel's.
    fn launch_normed<'s, A: DeviceRepr>(
        &self,
        c: &Check,
        stream: &'s CudaStream,
        w: &'s MatrixView,
        (x, norm_w, eps): (&'s impl DevicePtr<bf16>, &'s impl DevicePtr<bf16>, f32),
        (batch, ldy): (usize, usize),
        (yp, y_f32): (u64, bool),
        a_out: Option<&'s mut CudaViewMut<'_, bf16>>,
        args: impl FnOnce(GemvNormArgs) -> A,
    ) -> Result<()> {
        let nl = norm_w.len();
        let (np, _gn) = dptr(norm_w, stream);
        c.len("norm_w", nl, w.cols)?;
        c.aligned("norm_w", np, 16)?;
        let (ap, _ga) = match a_out {
            Some(a) => {
                c.len("a_out", a.len(), batch * w.cols)?;
                let (p, g) = dptr_mut(a, stream);
                c.aligned("a_out", p, 16)?;
                (p, Some(g))
            }
            None => (0, None),
        };
        c.ensure(batch == 1 || batch * w.cols <= NORM_BATCH_X, || format!("{batch} rows of {} columns past the {NORM_BATCH_X} x elements of a normed batch", w.cols))?;
        let xs = norm_smem(batch, w.cols);
        self.launch_row(c, stream, w, x, (batch, ldy), (yp, y_f32, false), (1, xs), |g| args(GemvNormArgs { g, norm_w: np, a_out: ap, eps, pad: 0 }))
    }

    /// The checks and launch every fused.cu kernel shares: one matrix of at most NORM_MAX_K
    /// columns, `batch` dense input rows `x`, output `y` (its device address, whether it is
    /// f32, whether the product is added into it) with row stride `ldy`. One row: a warp per
    /// output row on `row_grid`; 2-16 rows: 16-row tiles streamed by the resident blocks, the
    /// rows in `xs` bytes of dynamic shared memory (the bulk kernels' stages after them).
    /// `cluster`: blocks per cluster of the kernel. `args` wraps the product's arguments into
    /// the kernel's.
    fn launch_row<A: DeviceRepr>(
        &self,
        c: &Check,
        stream: &CudaStream,
        w: &MatrixView,
        x: &impl DevicePtr<bf16>,
        (batch, ldy): (usize, usize),
        (yp, y_f32, accumulate): (u64, bool, bool),
        (cluster, xs): (u32, usize),
        args: impl FnOnce(GemvArgs) -> A,
    ) -> Result<()> {
        c.ensure(w.experts == 1, || format!("gemv takes one matrix, got a bank of {}", w.experts))?;
        c.ensure(w.cols <= NORM_MAX_K, || format!("a normed row has at most {NORM_MAX_K} columns, got {}", w.cols))?;
        let xl = x.len();
        let (m, _gm) = w.mat_args(c, stream)?;
        let (xp, _gx) = dptr(x, stream);
        c.len("x", xl, batch * w.cols)?;
        c.aligned("x", xp, 16)?;
        let (ldx, ldy) = (c.i32("cols", w.cols)?, c.i32("ldy", ldy)?);
        let g = GemvArgs { m, x: xp, y: yp, batch: c.i32("batch", batch)?, ldx, ldy, out_f32: y_f32 as i32, accumulate: accumulate as i32, pad: 0 };
        let (grid, smem) = if is_bulk(c.kernel) {
            let (grid, smem) = self.bulk_launch(c, w.rows, w.cols, if batch > 1 { xs } else { 0 })?;
            (grid.next_multiple_of(cluster), smem)
        } else if batch == 1 {
            // A kernel launched in clusters takes a grid of whole clusters (blocks past the rows
            // build the input row and stream nothing).
            (self.row_grid(c.kernel, w.rows).next_multiple_of(cluster), 0)
        } else {
            c.ensure(w.cols.is_multiple_of(32), || format!("cols {} not a multiple of 32 (tensor-core gemv)", w.cols))?;
            // The rows are normed once per block: no more blocks than are resident at once.
            (blocks(w.rows, 16).min(self.resident(c.kernel, 256, xs)? as u32), xs)
        };
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: smem as u32 };
        self.launch_struct(stream, c.kernel, cfg, &args(g))
    }
}
