//! Launchers of the fused projections of kernels/gemv.cu: a row normed inside its product
//! (`gemv_norm`), and a product added into the residual stream (`gemv_add`).

use cudarc::driver::{CudaStream, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig};
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
        c.ensure(w.experts == 1, || format!("gemv takes one matrix, got a bank of {}", w.experts))?;
        let (xl, nl, yl) = (x.len(), norm_w.len(), y.len());
        let (m, _gm) = w.mat_args(&c, stream)?;
        let (xp, _gx) = dptr(x, stream);
        let (np, _gn) = dptr(norm_w, stream);
        let (yp, _gy) = dptr_mut(y, stream);
        c.len("x", xl, w.cols)?;
        c.len("norm_w", nl, w.cols)?;
        c.len("y", yl, w.rows)?;
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
        let args = GemvNormArgs {
            g: GemvArgs { m, x: xp, y: yp, batch: 1, ldx: c.i32("cols", w.cols)?, ldy: c.i32("rows", w.rows)?, out_f32: O::IS_F32 as i32, accumulate: 0, pad: 0 },
            norm_w: np,
            a_out: ap,
            eps,
            pad: 0,
        };
        let cfg = LaunchConfig { grid_dim: (blocks(w.rows, ROWS_PER_BLOCK), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch_struct(stream, c.kernel, cfg, &args)
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
