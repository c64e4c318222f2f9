//! Launchers of the fused projections (kernels/fused.cu, and `gemv_add` of kernels/gemv.cu):
//! a row normed inside its product (`gemv_norm`), the same with the GDN conv in its epilogue
//! (`gemv_norm_conv`), a row gated-normed inside its product (`gemv_gnorm`), a product added
//! into the residual stream (`gemv_add`).

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};
use half::bf16;

use crate::gdn::GDN_CONV_WIDTH;
use crate::gemv::{Encoding, GemvArgs, GemvOut, MatrixView, ROWS_PER_BLOCK};
use crate::launch::{device_args, dptr, dptr_mut, Check, Result};
use crate::loader::KernelSet;
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
}
device_args!(GatedArgs, 112);

/// The GDN conv a normed product runs on its rows `lo..lo + w.len() / 4` ([`KernelSet::gemv_norm_conv`]).
pub struct ConvTail<'a, 'b> {
    /// `[C, 4]` conv weights.
    pub w: CudaView<'a, bf16>,
    /// `[num_slots, 3, C]` conv states.
    pub state: &'b mut CudaSlice<bf16>,
    /// The one sequence's state slot (one i32 on the device).
    pub slot: CudaView<'a, i32>,
    /// `[C]` conv outputs.
    pub y: &'b mut CudaViewMut<'a, bf16>,
    /// The first conv row of the product.
    pub lo: usize,
}

/// Blocks per cluster of the gated-norm products (GNORM_CLUSTER in fused.cu).
const GNORM_CLUSTER: u32 = 8;

impl KernelSet {
    /// One row normed and multiplied in one launch: `a = bf16(x / rms(x) · (1 + norm_w))` (the
    /// zero-centred RMSNorm of [`KernelSet::rms_norm`]) and `y = a · Wᵀ`, bit for bit what the
    /// two launches give; with `a_out`, `a` is stored there too. bf16 and q8_g32 matrices.
    pub fn gemv_norm<O: GemvOut>(
        &self,
        stream: &CudaStream,
        w: &MatrixView,
        x: &impl DevicePtr<bf16>,
        norm_w: &impl DevicePtr<bf16>,
        eps: f32,
        y: &mut impl DevicePtrMut<O>,
        a_out: Option<&mut CudaViewMut<'_, bf16>>,
    ) -> Result<()> {
        let c = fused_check(w, (Kernel::GemvBf16NormB1, Kernel::GemvQ8NormB1), "normed")?;
        let (yl, (yp, _gy)) = (y.len(), dptr_mut(y, stream));
        c.len("y", yl, w.rows)?;
        self.launch_normed(&c, stream, w, (x, norm_w, eps), (yp, O::IS_F32), a_out, |args| args)
    }

    /// [`KernelSet::gemv_norm`] into bf16 `y`, then [`KernelSet::gdn_conv`] of that one token
    /// on the rows `conv.lo..conv.lo + C`: bit for bit what the three launches give.
    pub fn gemv_norm_conv(
        &self,
        stream: &CudaStream,
        w: &MatrixView,
        x: &impl DevicePtr<bf16>,
        norm_w: &impl DevicePtr<bf16>,
        eps: f32,
        y: &mut impl DevicePtrMut<bf16>,
        a_out: Option<&mut CudaViewMut<'_, bf16>>,
        conv: ConvTail,
    ) -> Result<()> {
        let c = fused_check(w, (Kernel::GemvBf16NormConvB1, Kernel::GemvQ8NormConvB1), "normed")?;
        let ch = conv.w.len() / GDN_CONV_WIDTH;
        c.ensure(ch > 0 && conv.lo + ch <= w.rows, || format!("conv rows {}..{} of {} rows", conv.lo, conv.lo + ch, w.rows))?;
        c.ensure(conv.state.len().is_multiple_of((GDN_CONV_WIDTH - 1) * ch), || format!("conv state of {} for {ch} channels", conv.state.len()))?;
        // Lane k of a warp convolves the warp's k-th row (fused.cu).
        let per_warp = w.rows.div_ceil(self.row_grid(c.kernel, w.rows) as usize * ROWS_PER_BLOCK);
        c.ensure(per_warp <= 32, || format!("{} rows take {per_warp} per warp on this card, more than the conv epilogue's 32", w.rows))?;
        let (yl, sl, (yp, _gy)) = (y.len(), conv.slot.len(), dptr_mut(y, stream));
        c.len("y", yl, w.rows)?;
        c.len("slot", sl, 1)?;
        c.len("conv y", conv.y.len(), ch)?;
        let (cwp, _gw) = conv.w.device_ptr(stream);
        c.aligned("conv w", cwp, 8)?;
        let (slp, _gsl) = conv.slot.device_ptr(stream);
        let (stp, _gst) = conv.state.device_ptr_mut(stream);
        let (cyp, _gcy) = conv.y.device_ptr_mut(stream);
        let (lo, channels) = (c.i32("lo", conv.lo)?, c.i32("channels", ch)?);
        self.launch_normed(&c, stream, w, (x, norm_w, eps), (yp, false), a_out, |n| NormConvArgs { n, conv_w: cwp, state: stp, conv_y: cyp, slot: slp, lo, channels })
    }

    /// `y (+)= a·Wᵀ` for one row, `a` the gated RMSNorm of [`KernelSet::gated_rms_norm`] of `x`
    /// (`w.cols / dim` heads of `dim`) with one token's gates `z` (`[w.cols]`) and weight
    /// `norm_w` (`[dim]`); with `accumulate`, `y = bf16(y + bf16(a·Wᵀ))` as [`KernelSet::gemv_add`].
    /// Bit for bit the two launches. bf16 and q8_g32 matrices.
    pub fn gemv_gnorm(
        &self,
        stream: &CudaStream,
        w: &MatrixView,
        x: &impl DevicePtr<bf16>,
        z: &impl DevicePtr<bf16>,
        (norm_w, dim, eps): (&impl DevicePtr<bf16>, usize, f32),
        y: &mut impl DevicePtrMut<bf16>,
        accumulate: bool,
    ) -> Result<()> {
        let c = fused_check(w, (Kernel::GemvBf16GnormB1, Kernel::GemvQ8GnormB1), "gated-norm")?;
        c.ensure(dim > 0 && dim.is_multiple_of(8) && w.cols.is_multiple_of(dim), || format!("{} columns are not heads of {dim} (a multiple of 8)", w.cols))?;
        let (zl, nl, yl) = (z.len(), norm_w.len(), y.len());
        c.len("z", zl, w.cols)?;
        c.len("norm_w", nl, dim)?;
        c.len("y", yl, w.rows)?;
        let (zp, _gz) = dptr(z, stream);
        let (np, _gn) = dptr(norm_w, stream);
        let (yp, _gy) = dptr_mut(y, stream);
        c.aligned("z", zp, 16)?;
        c.aligned("norm_w", np, 16)?;
        let dim = c.i32("dim", dim)?;
        self.launch_row(&c, stream, w, x, (yp, false, accumulate), GNORM_CLUSTER, |g| GatedArgs { g, z: zp, norm_w: np, dim, eps })
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

/// The check of a fused product over `w`: its bf16 or its q8_g32 kernel, the only encodings
/// fused.cu has.
fn fused_check(w: &MatrixView, (bf16, q8): (Kernel, Kernel), what: &str) -> Result<Check> {
    match w.encoding() {
        Encoding::Bf16 => Ok(Check::new(bf16)),
        Encoding::Q8G32 => Ok(Check::new(q8)),
        other => Err(Check::new(q8).fail(format!("no {what} gemv for {other:?}"))),
    }
}

/// The longest row a normed product takes (its copy in shared memory, kernels/fused.cu).
const NORM_MAX_K: usize = 8192;

impl KernelSet {
    /// Checks and launches a normed one-row product writing `y` (its device address, and whether
    /// it is f32); `args` wraps the product's arguments into the kernel's.
    fn launch_normed<'s, A: DeviceRepr>(
        &self,
        c: &Check,
        stream: &'s CudaStream,
        w: &'s MatrixView,
        (x, norm_w, eps): (&'s impl DevicePtr<bf16>, &'s impl DevicePtr<bf16>, f32),
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
                c.len("a_out", a.len(), w.cols)?;
                let (p, g) = dptr_mut(a, stream);
                c.aligned("a_out", p, 16)?;
                (p, Some(g))
            }
            None => (0, None),
        };
        self.launch_row(c, stream, w, x, (yp, y_f32, false), 1, |g| args(GemvNormArgs { g, norm_w: np, a_out: ap, eps, pad: 0 }))
    }

    /// The checks and launch every fused.cu kernel shares: one matrix of at most NORM_MAX_K
    /// columns, one input row `x`, output `y` (its device address, whether it is f32, whether
    /// the product is added into it), one warp per row on `row_grid`; `args` wraps the
    /// product's arguments into the kernel's.
    fn launch_row<A: DeviceRepr>(
        &self,
        c: &Check,
        stream: &CudaStream,
        w: &MatrixView,
        x: &impl DevicePtr<bf16>,
        (yp, y_f32, accumulate): (u64, bool, bool),
        cluster: u32,
        args: impl FnOnce(GemvArgs) -> A,
    ) -> Result<()> {
        c.ensure(w.experts == 1, || format!("gemv takes one matrix, got a bank of {}", w.experts))?;
        c.ensure(w.cols <= NORM_MAX_K, || format!("a normed row has at most {NORM_MAX_K} columns, got {}", w.cols))?;
        let xl = x.len();
        let (m, _gm) = w.mat_args(c, stream)?;
        let (xp, _gx) = dptr(x, stream);
        c.len("x", xl, w.cols)?;
        c.aligned("x", xp, 16)?;
        let g = GemvArgs { m, x: xp, y: yp, batch: 1, ldx: c.i32("cols", w.cols)?, ldy: c.i32("rows", w.rows)?, out_f32: y_f32 as i32, accumulate: accumulate as i32, pad: 0 };
        // A kernel launched in clusters takes a grid of whole clusters (blocks past the rows
        // build the input row and stream nothing).
        let grid = self.row_grid(c.kernel, w.rows).next_multiple_of(cluster);
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch_struct(stream, c.kernel, cfg, &args(g))
    }
}
