//! Launchers of kernels/norm.cu: zero-centred RMSNorm (optionally with the residual add fused)
//! and the gated RMSNorm of the GDN output (model-spec.md 2.1).

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;

use crate::launch::{blocks, device_args, dptr, dptr_mut, Check, Result};
use crate::loader::KernelSet;
use crate::table::Kernel;

#[repr(C)]
struct NormArgs {
    x: u64,
    w: u64,
    y: u64,
    h: u64,
    delta: u64,
    rows: i32,
    dim: i32,
    ldx: i32,
    ldy: i32,
    ldd: i32,
    eps: f32,
    group: i32,
    ldg: i32,
}
device_args!(NormArgs, 72);

/// Rows of a matrix: `rows` rows of `dim` elements, row r starting at element r * `ld`.
#[derive(Clone, Copy, Debug)]
pub struct Rows {
    pub rows: usize,
    pub dim: usize,
    pub ld: usize,
}

impl Rows {
    /// Contiguous rows (ld = dim).
    pub fn dense(rows: usize, dim: usize) -> Self {
        Self { rows, dim, ld: dim }
    }

    fn span(&self) -> usize {
        if self.rows == 0 {
            0
        } else {
            (self.rows - 1) * self.ld + self.dim
        }
    }

    fn check(&self, c: &Check, what: &str, len: usize, ptr: u64) -> Result<()> {
        c.ensure(self.dim.is_multiple_of(8) && self.dim > 0, || {
            format!("{what}: dim {} must be a positive multiple of 8", self.dim)
        })?;
        c.ensure(self.ld.is_multiple_of(8) && self.ld >= self.dim, || {
            format!(
                "{what}: ld {} must be a multiple of 8 and >= dim {}",
                self.ld, self.dim
            )
        })?;
        c.len(what, len, self.span())?;
        c.aligned(what, ptr, 16)
    }
}

const ROWS_PER_BLOCK: usize = 4;

fn norm_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks(rows, ROWS_PER_BLOCK), 1, 1),
        block_dim: (32, ROWS_PER_BLOCK as u32, 1),
        shared_mem_bytes: 0,
    }
}

impl KernelSet {
    /// `y = x / rms(x) * (1 + w)` per row (zero-centred RMSNorm, f32 math, one bf16 rounding).
    /// `x` and `y` must have the same rows and dim; `w` holds `dim` values.
    pub fn rms_norm(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<bf16>,
        x_rows: Rows,
        w: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        y_rows: Rows,
        eps: f32,
    ) -> Result<()> {
        let c = Check::new(Kernel::RmsNorm);
        let (xl, wl, yl) = (x.len(), w.len(), y.len());
        let (xp, _gx) = dptr(x, stream);
        let (wp, _gw) = dptr(w, stream);
        let (yp, _gy) = dptr_mut(y, stream);
        self.launch_rms(
            stream,
            &c,
            (xp, xl, x_rows),
            (wp, wl),
            (yp, yl, y_rows),
            eps,
        )
    }

    /// The zero-centred RMSNorm of every row of `x`, written back into `x`.
    pub fn rms_norm_in_place(
        &self,
        stream: &CudaStream,
        x: &mut impl DevicePtrMut<bf16>,
        rows: Rows,
        w: &impl DevicePtr<bf16>,
        eps: f32,
    ) -> Result<()> {
        let c = Check::new(Kernel::RmsNorm);
        let (xl, wl) = (x.len(), w.len());
        let (wp, _gw) = dptr(w, stream);
        let (xp, _gx) = dptr_mut(x, stream);
        self.launch_rms(stream, &c, (xp, xl, rows), (wp, wl), (xp, xl, rows), eps)
    }

    fn launch_rms(
        &self,
        stream: &CudaStream,
        c: &Check,
        (xp, xl, xr): (u64, usize, Rows),
        (wp, wl): (u64, usize),
        (yp, yl, yr): (u64, usize, Rows),
        eps: f32,
    ) -> Result<()> {
        xr.check(c, "x", xl, xp)?;
        yr.check(c, "y", yl, yp)?;
        c.ensure(xr.rows == yr.rows && xr.dim == yr.dim, || {
            format!("x is {}x{}, y is {}x{}", xr.rows, xr.dim, yr.rows, yr.dim)
        })?;
        c.len("w", wl, xr.dim)?;
        c.aligned("w", wp, 16)?;
        if xr.rows == 0 {
            return Ok(());
        }
        let args = NormArgs {
            x: xp,
            w: wp,
            y: yp,
            h: 0,
            delta: 0,
            rows: c.i32("rows", xr.rows)?,
            dim: c.i32("dim", xr.dim)?,
            ldx: c.i32("ldx", xr.ld)?,
            ldy: c.i32("ldy", yr.ld)?,
            ldd: 0,
            eps,
            group: 1,
            ldg: 0,
        };
        self.launch_struct(stream, c.kernel, norm_cfg(xr.rows), &args)
    }

    /// Residual add fused with the norm: `h = bf16(h + delta)`, then `y = RMSNorm(h) * (1 + w)`.
    pub fn add_rms_norm(
        &self,
        stream: &CudaStream,
        h: &mut impl DevicePtrMut<bf16>,
        delta: &impl DevicePtr<bf16>,
        rows: Rows,
        w: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        y_rows: Rows,
        eps: f32,
    ) -> Result<()> {
        let c = Check::new(Kernel::AddRmsNorm);
        let (hl, dl, wl, yl) = (h.len(), delta.len(), w.len(), y.len());
        let (dp, _gd) = dptr(delta, stream);
        let (wp, _gw) = dptr(w, stream);
        let (hp, _gh) = dptr_mut(h, stream);
        let (yp, _gy) = dptr_mut(y, stream);
        rows.check(&c, "h", hl, hp)?;
        rows.check(&c, "delta", dl, dp)?;
        y_rows.check(&c, "y", yl, yp)?;
        c.ensure(rows.rows == y_rows.rows && rows.dim == y_rows.dim, || {
            format!(
                "h is {}x{}, y is {}x{}",
                rows.rows, rows.dim, y_rows.rows, y_rows.dim
            )
        })?;
        c.len("w", wl, rows.dim)?;
        c.aligned("w", wp, 16)?;
        if rows.rows == 0 {
            return Ok(());
        }
        let args = NormArgs {
            x: 0,
            w: wp,
            y: yp,
            h: hp,
            delta: dp,
            rows: c.i32("rows", rows.rows)?,
            dim: c.i32("dim", rows.dim)?,
            ldx: c.i32("ld", rows.ld)?,
            ldy: c.i32("ldy", y_rows.ld)?,
            ldd: c.i32("ld", rows.ld)?,
            eps,
            group: 1,
            ldg: 0,
        };
        self.launch_struct(stream, c.kernel, norm_cfg(rows.rows), &args)
    }

    /// GDN output norm: `y = bf16(bf16(bf16(x / rms(x)) * w) * silu(z))` per row of `dim`
    /// (one value head); `x` and `y` are dense `[rows, dim]`, `w` is `[dim]`. z rows come in
    /// groups of `z_group` contiguous rows (a token's heads), groups `z_ld` elements apart
    /// (dense z: `z_group` = 1, `z_ld` = `dim`). y may alias x, not z.
    pub fn gated_rms_norm(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<bf16>,
        z: &impl DevicePtr<bf16>,
        z_group: usize,
        z_ld: usize,
        w: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        let c = Check::new(Kernel::GatedRmsNorm);
        let r = Rows::dense(rows, dim);
        let (xl, zl, wl, yl) = (x.len(), z.len(), w.len(), y.len());
        let (xp, _gx) = dptr(x, stream);
        let (zp, _gz) = dptr(z, stream);
        let (wp, _gw) = dptr(w, stream);
        let (yp, _gy) = dptr_mut(y, stream);
        r.check(&c, "x", xl, xp)?;
        r.check(&c, "y", yl, yp)?;
        c.ensure(z_group > 0 && rows.is_multiple_of(z_group), || format!("{rows} rows are not groups of {z_group}"))?;
        c.ensure(z_ld.is_multiple_of(8) && z_ld >= z_group * dim, || format!("z group stride {z_ld} (a multiple of 8, at least {z_group} x {dim})"))?;
        let groups = rows / z_group;
        c.len("z", zl, if groups == 0 { 0 } else { (groups - 1) * z_ld + z_group * dim })?;
        c.aligned("z", zp, 16)?;
        c.len("w", wl, dim)?;
        c.aligned("w", wp, 16)?;
        if rows == 0 {
            return Ok(());
        }
        let args = NormArgs {
            x: xp,
            w: wp,
            y: yp,
            h: 0,
            delta: zp,
            rows: c.i32("rows", rows)?,
            dim: c.i32("dim", dim)?,
            ldx: c.i32("dim", dim)?,
            ldy: c.i32("dim", dim)?,
            ldd: c.i32("dim", dim)?,
            eps,
            group: c.i32("z group", z_group)?,
            ldg: c.i32("z stride", z_ld)?,
        };
        self.launch_struct(stream, c.kernel, norm_cfg(rows), &args)
    }
}
