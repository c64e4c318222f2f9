//! Launchers of kernels/gemv.cu: small-batch matrix-vector products over every weight encoding
//! (docs/format.md section 3), and the matrix views every product launcher takes.

use cudarc::driver::{
    CudaStream, CudaView, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, SyncOnDrop,
};
use half::{bf16, f16};

use crate::launch::{blocks, device_args, dptr, dptr_mut, Check, Result};
use crate::loader::KernelSet;
use crate::table::Kernel;

/// The device-resident parts of one encoded matrix or expert bank, in format.md's part order.
pub enum Weights<'a> {
    Bf16 {
        data: CudaView<'a, bf16>,
    },
    Q8G32 {
        q: CudaView<'a, i8>,
        scales: CudaView<'a, f16>,
    },
    Q6G64 {
        ql: CudaView<'a, u8>,
        qh: CudaView<'a, u8>,
        scales: CudaView<'a, f16>,
    },
    Q4G32 {
        q: CudaView<'a, u8>,
        scales: CudaView<'a, f16>,
    },
    /// `global` holds `segments` f32 multipliers per expert (format.md: `P`); `codes` are in
    /// the device layout that [`crate::KernelSet::nvfp4_device_layout`] writes.
    Nvfp4 {
        codes: CudaView<'a, u8>,
        scales: CudaView<'a, u8>,
        global: CudaView<'a, f32>,
        segments: usize,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Encoding {
    Bf16,
    Q8G32,
    Q6G64,
    Q4G32,
    Nvfp4,
}

impl Encoding {
    /// What the input dimension must be a multiple of: the elements one lane decodes from one
    /// 16-byte load (the `CHUNK` of kernels/quant.cuh), and whole scale groups.
    fn col_multiple(self) -> usize {
        match self {
            Encoding::Bf16 => 8,
            Encoding::Q8G32 | Encoding::Q4G32 | Encoding::Nvfp4 => 32,
            Encoding::Q6G64 => 64,
        }
    }
}

/// A matrix `[rows, cols]` (experts = 1) or a bank `[experts, rows, cols]`; cols is the input
/// dimension, as stored.
pub struct MatrixView<'a> {
    pub weights: Weights<'a>,
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
}

/// Mirror of `Mat` in kernels/quant.cuh.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MatArgs {
    pub(crate) p0: u64,
    pub(crate) p1: u64,
    pub(crate) p2: u64,
    pub(crate) global: u64,
    pub(crate) experts: i32,
    pub(crate) rows: i32,
    pub(crate) cols: i32,
    pub(crate) segments: i32,
}
const _: () = assert!(std::mem::size_of::<MatArgs>() == 48);

impl<'a> MatrixView<'a> {
    pub(crate) fn encoding(&self) -> Encoding {
        match self.weights {
            Weights::Bf16 { .. } => Encoding::Bf16,
            Weights::Q8G32 { .. } => Encoding::Q8G32,
            Weights::Q6G64 { .. } => Encoding::Q6G64,
            Weights::Q4G32 { .. } => Encoding::Q4G32,
            Weights::Nvfp4 { .. } => Encoding::Nvfp4,
        }
    }

    /// Checks part sizes and alignment against the shape and returns the kernel's view of it,
    /// with the guards that order the launch after earlier writes of the parts.
    pub(crate) fn mat_args<'s>(
        &'s self,
        c: &Check,
        stream: &'s CudaStream,
    ) -> Result<(MatArgs, Vec<SyncOnDrop<'s>>)> {
        let enc = self.encoding();
        let (e, n, k) = (self.experts, self.rows, self.cols);
        c.ensure(e > 0 && n > 0 && k > 0, || {
            format!("empty matrix {e}x{n}x{k}")
        })?;
        c.ensure(k.is_multiple_of(enc.col_multiple()), || {
            format!(
                "cols {k} must be a multiple of {} for {enc:?}",
                enc.col_multiple()
            )
        })?;
        let elems = e * n * k;
        let mut guards = Vec::new();
        let mut part =
            |what: &str, len: usize, need: usize, p: (u64, SyncOnDrop<'s>), align: u64| {
                c.len(what, len, need)?;
                c.aligned(what, p.0, align)?;
                guards.push(p.1);
                Ok::<u64, crate::KernelError>(p.0)
            };
        let mut m = MatArgs {
            experts: c.i32("experts", e)?,
            rows: c.i32("rows", n)?,
            cols: c.i32("cols", k)?,
            segments: 1,
            ..MatArgs::default()
        };
        match &self.weights {
            Weights::Bf16 { data } => {
                m.p0 = part("data", data.len(), elems, data.device_ptr(stream), 16)?;
            }
            Weights::Q8G32 { q, scales } => {
                m.p0 = part("q", q.len(), elems, q.device_ptr(stream), 16)?;
                m.p1 = part(
                    "scales",
                    scales.len(),
                    elems / 32,
                    scales.device_ptr(stream),
                    2,
                )?;
            }
            Weights::Q6G64 { ql, qh, scales } => {
                m.p0 = part("ql", ql.len(), elems / 2, ql.device_ptr(stream), 16)?;
                m.p1 = part("qh", qh.len(), elems / 4, qh.device_ptr(stream), 8)?;
                m.p2 = part(
                    "scales",
                    scales.len(),
                    elems / 64,
                    scales.device_ptr(stream),
                    2,
                )?;
            }
            Weights::Q4G32 { q, scales } => {
                m.p0 = part("q", q.len(), elems / 2, q.device_ptr(stream), 16)?;
                m.p1 = part(
                    "scales",
                    scales.len(),
                    elems / 32,
                    scales.device_ptr(stream),
                    2,
                )?;
            }
            Weights::Nvfp4 {
                codes,
                scales,
                global,
                segments,
            } => {
                let p = *segments;
                c.ensure(p > 0 && n % p == 0, || {
                    format!("{n} rows do not split into {p} segments")
                })?;
                m.p0 = part(
                    "codes",
                    codes.len(),
                    elems / 2,
                    codes.device_ptr(stream),
                    16,
                )?;
                m.p1 = part(
                    "scales",
                    scales.len(),
                    elems / 16,
                    scales.device_ptr(stream),
                    2,
                )?;
                m.global = part("global", global.len(), e * p, global.device_ptr(stream), 4)?;
                m.segments = c.i32("segments", p)?;
            }
        }
        Ok((m, guards))
    }
}

/// Output element types of the matrix-vector kernels (bf16 rounded once, or f32).
pub trait GemvOut: DeviceRepr + sealed::Sealed {
    const IS_F32: bool;
}
impl GemvOut for bf16 {
    const IS_F32: bool = false;
}
impl GemvOut for f32 {
    const IS_F32: bool = true;
}
mod sealed {
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for f32 {}
}

#[repr(C)]
pub(crate) struct GemvArgs {
    pub(crate) m: MatArgs,
    pub(crate) x: u64,
    pub(crate) y: u64,
    pub(crate) batch: i32,
    pub(crate) ldx: i32,
    pub(crate) ldy: i32,
    pub(crate) out_f32: i32,
    pub(crate) accumulate: i32,
    pub(crate) pad: i32,
}
device_args!(GemvArgs, 88);


/// What K must be a multiple of for the bulk-copy products (a row's q8_g32 scales, K / 16
/// bytes, whole 16-byte lines).
const BULK_COL_MULTIPLE: usize = 256;
/// Rows per stage of the bulk-copy products (BULK_ROWS in gemv_bulk.cuh: one MMA tile).
const BULK_ROWS: usize = 16;
/// The most rows a bulk-copy product's block owns (one per thread stores them).
const BULK_MAX_BLOCK_ROWS: usize = 256;
/// The longest row a bulk-copy product holds (BULK_MAX_K in gemv_bulk.cuh).
const BULK_MAX_K: usize = 8192;
/// The shared memory a bulk-copy product's block gives its stages: two blocks an SM with their
/// static memory, and 2 stages in flight at K = 2048 (1 at 4096).
const BULK_STAGE_MEM: usize = 72 << 10;
/// The most stages a bulk-copy product keeps (BULK_MAX_STAGES in gemv_bulk.cuh).
const BULK_MAX_STAGES: usize = 8;

/// Whether `k` runs one of the bulk-copy products (kernels/gemv_bulk.cuh).
pub(crate) fn is_bulk(k: Kernel) -> bool {
    use Kernel::*;
    matches!(
        k,
        GemvQ8BulkB1
            | GemvQ8NormBulkB1
            | GemvQ8NormConvBulkB1
            | GemvQ8GnormBulkB1
            | GemvQ8GnormBulkB8
            | GemvQ8GnormBulkRouteB1
            | GemvQ8BulkRouteB1
            | GemvQ8BulkB8
            | GemvQ8BulkB16
            | GemvQ8NormBulkB8
            | GemvQ8NormConvBulkB8
    )
}

/// Row stride (elements) of a batch's x rows in a bulk-copy or normed product's shared memory
/// (NORM_LD in gemv_bulk.cuh).
pub(crate) fn rows_ld(k: usize) -> usize {
    k.div_ceil(64) * 64 + 32
}

/// The longest rows a bulk-copy product of 2-16 rows takes: 16 of them and a stage fit a
/// block's shared memory (202 KiB; normed, at most NORM_BATCH_X elements, 160 KiB).
const BULK_BATCH_MAX_K: usize = 4096;

/// Whether `batch` rows of `w` take a bulk-copy product: q8_g32 whose scale rows are whole
/// 16-byte lines, and no longer than a block holds with the batch.
pub(crate) fn bulk_cols(w: &MatrixView, batch: usize) -> bool {
    let max_k = if batch == 1 { BULK_MAX_K } else { BULK_BATCH_MAX_K };
    w.encoding() == Encoding::Q8G32 && w.cols.is_multiple_of(BULK_COL_MULTIPLE) && w.cols <= max_k
}

impl KernelSet {
    /// A bulk-copy product's grid (the blocks resident at its shared memory, no more than take
    /// a stage of rows) and its dynamic shared memory: `xs` bytes of x rows (a batch's, rounded
    /// up to 128 here; 0 for one row, which sits in static memory), then its stages' padded
    /// rows (gemv_bulk.cuh).
    pub(crate) fn bulk_launch(&self, c: &Check, rows: usize, cols: usize, xs: usize) -> Result<(u32, usize)> {
        let stage = BULK_ROWS * (cols + 32 + cols / 16 + 16);
        let smem = xs.next_multiple_of(128) + stage * (BULK_STAGE_MEM / stage).clamp(1, BULK_MAX_STAGES);
        let per_sm = self.function(c.kernel).occupancy_max_active_blocks_per_multiprocessor(256, smem, None)? as usize;
        c.ensure(per_sm > 0, || format!("{xs} bytes of x rows of {cols} columns and a stage do not fit a block's shared memory"))?;
        let grid = rows.div_ceil(BULK_ROWS).min(per_sm * self.num_sms());
        // One row's product stores a block's row i by its thread i; a batch's, by stages.
        let per_block = rows.div_ceil(grid).next_multiple_of(BULK_ROWS);
        c.ensure(xs > 0 || per_block <= BULK_MAX_BLOCK_ROWS, || format!("{rows} rows take {per_block} a block on this card, more than the bulk product's {BULK_MAX_BLOCK_ROWS}"))?;
        Ok((grid as u32, smem))
    }
}

/// The most batch rows one gemv launch takes.
pub const GEMV_MAX_BATCH: usize = 16;

fn gemv_kernel(enc: Encoding, batch: usize) -> Kernel {
    use Kernel::*;
    let bucket = match batch {
        1 => 0,
        2 => 1,
        3..=4 => 2,
        5..=8 => 3,
        _ => 4,
    };
    let row: [Kernel; 5] = match enc {
        Encoding::Bf16 => [GemvBf16B1, GemvBf16MmaB8, GemvBf16MmaB8, GemvBf16MmaB8, GemvBf16MmaB16],
        Encoding::Q8G32 => [GemvQ8B1, GemvQ8MmaB8, GemvQ8MmaB8, GemvQ8MmaB8, GemvQ8MmaB16],
        Encoding::Q6G64 => [GemvQ6MmaB2, GemvQ6MmaB2, GemvQ6MmaB4, GemvQ6MmaB8, GemvQ6MmaB16],
        Encoding::Q4G32 => [GemvQ4B1, GemvQ4B2, GemvQ4B4, GemvQ4B8, GemvQ4B16],
        Encoding::Nvfp4 => [
            GemvNvfp4B1,
            GemvNvfp4B2,
            GemvNvfp4B4,
            GemvNvfp4B8,
            GemvNvfp4B16,
        ],
    };
    row[bucket]
}

/// Elements spanned by `rows` rows of `dim` with row stride `ld`.
pub(crate) fn span(rows: usize, dim: usize, ld: usize) -> usize {
    if rows == 0 {
        0
    } else {
        (rows - 1) * ld + dim
    }
}

pub(crate) const ROWS_PER_BLOCK: usize = 8;

/// The most x elements (batch slots of the kernel times K) the q6_g64 kernels of 2 and 4 rows
/// hold in shared memory: 64 KiB of bf16, 4 rows of 8,192 or 2 of 16,384.
const Q6_X_ELEMENTS: usize = 32_768;

impl KernelSet {
    /// The grid of a one-warp-per-row product (block 256, 8 rows per block) over `rows`: one
    /// block per 8 rows, but no more blocks than the device holds at once, so that a long
    /// matrix is streamed by resident warps that take several rows each (gemv.cuh's
    /// `RowStream`) instead of by waves of blocks that each wait out their loads and exit.
    pub(crate) fn row_grid(&self, kernel: Kernel, rows: usize) -> u32 {
        blocks(rows, ROWS_PER_BLOCK).min(self.resident_256(kernel))
    }
}

impl KernelSet {
    /// `y[b, n] = x[b, :] . W[n, :]` for `b < batch` (1..=16): x is bf16 `[batch, ldx]`, y is
    /// `[batch, ldy]` in bf16 or f32. W must be a single matrix (experts = 1).
    pub fn gemv<O: GemvOut>(
        &self,
        stream: &CudaStream,
        w: &MatrixView,
        x: &impl DevicePtr<bf16>,
        batch: usize,
        ldx: usize,
        y: &mut impl DevicePtrMut<O>,
        ldy: usize,
    ) -> Result<()> {
        self.gemv_with(stream, w, x, batch, ldx, y, ldy, false)
    }

    /// As [`KernelSet::gemv`], storing `y` or, with `accumulate` (bf16 `y`), adding the
    /// product to it: `y = bf16(y + bf16(x·Wᵀ))`.
    pub(crate) fn gemv_with<O: GemvOut>(
        &self,
        stream: &CudaStream,
        w: &MatrixView,
        x: &impl DevicePtr<bf16>,
        batch: usize,
        ldx: usize,
        y: &mut impl DevicePtrMut<O>,
        ldy: usize,
        accumulate: bool,
    ) -> Result<()> {
        let enc = w.encoding();
        let kernel = match (batch, bulk_cols(w, batch)) {
            (1, true) => Kernel::GemvQ8BulkB1,
            (2..=8, true) => Kernel::GemvQ8BulkB8,
            (9..=GEMV_MAX_BATCH, true) => Kernel::GemvQ8BulkB16,
            _ => gemv_kernel(enc, batch.clamp(1, GEMV_MAX_BATCH)),
        };
        let c = Check::new(kernel);
        c.ensure((1..=GEMV_MAX_BATCH).contains(&batch), || {
            format!("batch {batch} outside 1..={GEMV_MAX_BATCH}")
        })?;
        c.ensure(w.experts == 1, || {
            format!("gemv takes one matrix, got a bank of {}", w.experts)
        })?;
        c.ensure(ldx >= w.cols && ldx.is_multiple_of(8), || {
            format!("ldx {ldx} (cols {})", w.cols)
        })?;
        c.ensure(ldy >= w.rows, || format!("ldy {ldy} < rows {}", w.rows))?;
        let (xl, yl) = (x.len(), y.len());
        let (m, _gm) = w.mat_args(&c, stream)?;
        let (xp, _gx) = dptr(x, stream);
        let (yp, _gy) = dptr_mut(y, stream);
        c.len("x", xl, span(batch, w.cols, ldx))?;
        c.len("y", yl, span(batch, w.rows, ldy))?;
        c.aligned("x", xp, 16)?;
        let args = GemvArgs {
            m,
            x: xp,
            y: yp,
            batch: batch as i32,
            ldx: c.i32("ldx", ldx)?,
            ldy: c.i32("ldy", ldy)?,
            out_f32: O::IS_F32 as i32,
            accumulate: accumulate as i32,
            pad: 0,
        };
        // The bf16 and q8_g32 tensor-core kernels take 16 rows per block (K in 32-column
        // groups); q6_g64's take a 16-row tile per warp, with the batch's x in shared memory.
        use Kernel::*;
        let mma = matches!(c.kernel, GemvQ8MmaB8 | GemvQ8MmaB16 | GemvBf16MmaB8 | GemvBf16MmaB16);
        c.ensure(!mma || w.cols.is_multiple_of(32), || format!("cols {} not a multiple of 32 (tensor-core gemv)", w.cols))?;
        let q6 = matches!(c.kernel, GemvQ6MmaB2 | GemvQ6MmaB4 | GemvQ6MmaB8 | GemvQ6MmaB16);
        let q6_rows = match c.kernel {
            GemvQ6MmaB2 => 2,
            GemvQ6MmaB4 => 4,
            _ => 0,
        };
        c.ensure(q6_rows * w.cols <= Q6_X_ELEMENTS, || {
            format!("{q6_rows} rows of {} columns past the {Q6_X_ELEMENTS} x elements of the q6_g64 kernels", w.cols)
        })?;
        // b2 and b4: x rows in 256-column blocks of 16-byte units, after 8 zero units (gemv.cu).
        let smem = if q6_rows > 0 { (8 + q6_rows * w.cols.div_ceil(256) * 32) * 16 } else { 0 };
        let (grid, smem) = match () {
            _ if is_bulk(c.kernel) => self.bulk_launch(&c, w.rows, w.cols, if batch > 1 { batch * rows_ld(w.cols) * 2 } else { 0 })?,
            _ if mma => (blocks(w.rows, 16), smem),
            _ if q6 => (blocks(w.rows.div_ceil(16), ROWS_PER_BLOCK), smem),
            _ => (self.row_grid(c.kernel, w.rows), smem),
        };
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        self.launch_struct(stream, c.kernel, cfg, &args)
    }
}
