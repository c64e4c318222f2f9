//! Launchers of the fused projections of kernels/gemv.cu: a row normed inside its product
//! (`gemv_norm`), a product added into the residual stream (`gemv_add`), and the router
//! product of one normed row with the routing done by its last block (`moe_router`).

use cudarc::driver::{CudaStream, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};
use half::bf16;

use crate::gemv::{Encoding, GemvArgs, GemvOut, MatrixView, ROWS_PER_BLOCK};
use crate::launch::{blocks, device_args, dptr, dptr_mut, Check, Result};
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
struct RouterArgs {
    n: GemvNormArgs,
    ids: u64,
    w: u64,
    counter: u64,
    experts: i32,
    topk: i32,
    has_shared: i32,
    pad: i32,
}
device_args!(RouterArgs, 152);

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
        let kernel = match w.encoding() {
            Encoding::Bf16 => Kernel::GemvBf16NormB1,
            Encoding::Q8G32 => Kernel::GemvQ8NormB1,
            other => return Err(Check::new(Kernel::GemvQ8NormB1).fail(format!("no normed gemv for {other:?}"))),
        };
        let c = Check::new(kernel);
        let (yl, (yp, _gy)) = (y.len(), dptr_mut(y, stream));
        c.len("y", yl, w.rows)?;
        self.launch_normed(&c, stream, w, (x, norm_w, eps), (yp, O::IS_F32), a_out, |args| args)
    }

    /// The router logits of one token from its un-normed residual row, as [`KernelSet::gemv_norm`]
    /// gives them into bf16 `logits` (`[E]`, or `[E + 1]` with the shared expert's gate row last
    /// in a bf16 `w`), then the routing of [`KernelSet::moe_route`] of that row into `ids`
    /// (`[topk]`) and `route_w` (`[topk (+ 1)]`), done by the launch's last block. `counter` is
    /// one u32, zero before the launch and zero again after it.
    pub fn moe_router(
        &self,
        stream: &CudaStream,
        w: &MatrixView,
        x: &impl DevicePtr<bf16>,
        norm_w: &impl DevicePtr<bf16>,
        eps: f32,
        logits: &mut impl DevicePtrMut<bf16>,
        a_out: Option<&mut CudaViewMut<'_, bf16>>,
        (experts, topk, has_shared): (usize, usize, bool),
        ids: &mut impl DevicePtrMut<i32>,
        route_w: &mut impl DevicePtrMut<f32>,
        counter: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        let c = Check::new(Kernel::MoeRouterBf16B1);
        c.ensure(w.encoding() == Encoding::Bf16, || format!("the fused router takes a bf16 matrix, not {:?}", w.encoding()))?;
        c.ensure(w.rows == experts + has_shared as usize, || format!("{} router rows for {experts} experts (shared gate: {has_shared})", w.rows))?;
        c.ensure((1..=crate::ROUTE_MAX_EXPERTS).contains(&experts) && topk >= 1 && topk <= experts.min(32), || {
            format!("top-{topk} of {experts} experts")
        })?;
        let (ll, il, wl, cl) = (logits.len(), ids.len(), route_w.len(), counter.len());
        c.len("logits", ll, w.rows)?;
        c.len("ids", il, topk)?;
        c.len("route_w", wl, topk + has_shared as usize)?;
        c.len("counter", cl, 1)?;
        let (lp, _gl) = dptr_mut(logits, stream);
        let (ip, _gi) = dptr_mut(ids, stream);
        let (wp, _gw) = dptr_mut(route_w, stream);
        let (cp, _gc) = dptr_mut(counter, stream);
        let (experts, topk, has_shared) = (experts as i32, topk as i32, has_shared as i32);
        self.launch_normed(&c, stream, w, (x, norm_w, eps), (lp, false), a_out, |n| RouterArgs { n, ids: ip, w: wp, counter: cp, experts, topk, has_shared, pad: 0 })
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

impl KernelSet {
    /// Checks and launches a normed one-row product writing `y` (its device address, and whether
    /// it is f32), one warp per row as the b1 product; `args` wraps the product's arguments
    /// into the kernel's.
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
        c.ensure(w.experts == 1, || format!("gemv takes one matrix, got a bank of {}", w.experts))?;
        let (xl, nl) = (x.len(), norm_w.len());
        let (m, _gm) = w.mat_args(c, stream)?;
        let (xp, _gx) = dptr(x, stream);
        let (np, _gn) = dptr(norm_w, stream);
        c.len("x", xl, w.cols)?;
        c.len("norm_w", nl, w.cols)?;
        c.aligned("x", xp, 16)?;
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
        let g = GemvArgs { m, x: xp, y: yp, batch: 1, ldx: c.i32("cols", w.cols)?, ldy: c.i32("rows", w.rows)?, out_f32: y_f32 as i32, accumulate: 0, pad: 0 };
        let cfg = LaunchConfig { grid_dim: (blocks(w.rows, ROWS_PER_BLOCK), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch_struct(stream, c.kernel, cfg, &args(GemvNormArgs { g, norm_w: np, a_out: ap, eps, pad: 0 }))
    }
}
