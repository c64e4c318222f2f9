//! Launchers of kernels/gemv.cu: small-batch matrix-vector products over every weight encoding
//! (docs/format.md section 3) and the MoE expert-bank kernels (model-spec.md 2.5).

use cudarc::driver::{
    CudaStream, CudaView, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, SyncOnDrop,
};
use half::{bf16, f16};

use crate::launch::{blocks, device_args, dptr, dptr_mut, Check, Result};
use crate::loader::KernelSet;
use crate::moe::Routing;
use crate::table::Kernel;

/// Routing table rows a down block keeps: top-32 and the shared slot (DOWN_MAX_SLOTS in gemv.cu).
const DOWN_MAX_SLOTS: usize = 33;

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
    /// `global` holds `segments` f32 multipliers per expert (format.md: `P`).
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


#[repr(C)]
pub(crate) struct BankArgs {
    bank: MatArgs,
    shared: MatArgs,
    x: u64,
    ids: u64,
    route_w: u64,
    y: u64,
    tokens: i32,
    topk: i32,
    has_shared: i32,
    ldx: i32,
    ldy: i32,
    out_f32: i32,
    accumulate: i32,
    pad: i32,
    logits: u64,
}
device_args!(BankArgs, 168);

impl BankArgs {
    /// The arguments of an expert-bank kernel, storing bf16 (no f32 flag, no accumulate);
    /// sizes past i32 fail the check `c`.
    pub(crate) fn new(c: &Check, (bank, shared): (MatArgs, MatArgs), [x, ids, route_w, y]: [u64; 4], (tokens, topk, has_shared): (usize, usize, bool), ldx: usize, ldy: usize) -> Result<Self> {
        Ok(BankArgs {
            bank,
            shared,
            x,
            ids,
            route_w,
            y,
            tokens: c.i32("tokens", tokens)?,
            topk: c.i32("topk", topk)?,
            has_shared: has_shared as i32,
            ldx: c.i32("ldx", ldx)?,
            ldy: c.i32("ldy", ldy)?,
            out_f32: 0,
            accumulate: 0,
            pad: 0,
            logits: 0,
        })
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
        Encoding::Q6G64 => [GemvQ6MmaB1, GemvQ6B2, GemvQ6B4, GemvQ6B8, GemvQ6B16],
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

fn bank_kernels(enc: Encoding) -> (Kernel, Kernel) {
    use Kernel::*;
    match enc {
        Encoding::Bf16 => (MoeGateUpBf16, MoeDownBf16),
        Encoding::Q8G32 => (MoeGateUpQ8, MoeDownQ8),
        Encoding::Q6G64 => (MoeGateUpQ6, MoeDownQ6),
        Encoding::Q4G32 => (MoeGateUpQ4, MoeDownQ4),
        Encoding::Nvfp4 => (MoeGateUpNvfp4, MoeDownNvfp4),
    }
}

/// The kernel views of a bank and its optional shared expert, with their guards.
pub(crate) fn bank_mats<'s>(c: &Check, stream: &'s CudaStream, bank: &'s MatrixView, shared: Option<&'s MatrixView>) -> Result<(MatArgs, MatArgs, Vec<SyncOnDrop<'s>>)> {
    let (bm, mut guards) = bank.mat_args(c, stream)?;
    let sm = match shared {
        Some(s) => {
            let (sm, g) = s.mat_args(c, stream)?;
            guards.extend(g);
            sm
        }
        None => MatArgs::default(),
    };
    Ok((bm, sm, guards))
}

/// Elements spanned by `rows` rows of `dim` with row stride `ld`.
fn span(rows: usize, dim: usize, ld: usize) -> usize {
    if rows == 0 {
        0
    } else {
        (rows - 1) * ld + dim
    }
}

pub(crate) const ROWS_PER_BLOCK: usize = 8;

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
        let c = Check::new(gemv_kernel(enc, batch.clamp(1, GEMV_MAX_BATCH)));
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
        // The tensor-core kernels take 16 rows per block (K in 32-column groups); q6_g64's one
        // row streams 16-row tiles per warp, with x in shared memory (K <= 8192).
        let mma = matches!(c.kernel, Kernel::GemvQ8MmaB8 | Kernel::GemvQ8MmaB16 | Kernel::GemvBf16MmaB8 | Kernel::GemvBf16MmaB16);
        c.ensure(!mma || w.cols.is_multiple_of(32), || format!("cols {} not a multiple of 32 (tensor-core gemv)", w.cols))?;
        let q6 = c.kernel == Kernel::GemvQ6MmaB1;
        c.ensure(!q6 || w.cols <= 8192, || format!("cols {} past the 8192 of the q6_g64 one-row kernel", w.cols))?;
        let grid = match () {
            _ if mma => blocks(w.rows, 16),
            _ if q6 => self.row_grid(c.kernel, w.rows.div_ceil(16)),
            _ => self.row_grid(c.kernel, w.rows),
        };
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch_struct(stream, c.kernel, cfg, &args)
    }

    /// MoE gate/up for the selected experts: slot `s = t*topk + j` uses the expert `routing`
    /// gives it on token `t`; with `shared`, slots `tokens*topk + t` use the shared expert. The
    /// bank is `[E, 2I, H]` (gate rows then up rows); `out` is dense bf16 `[slots, I]` holding
    /// `silu(gate) * up`. `shared` must have the bank's encoding and `[2I, H]` shape.
    pub fn moe_gate_up(
        &self,
        stream: &CudaStream,
        bank: &MatrixView,
        shared: Option<&MatrixView>,
        x: &impl DevicePtr<bf16>,
        ldx: usize,
        (tokens, topk): (usize, usize),
        routing: &Routing,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let c = Check::new(bank_kernels(bank.encoding()).0);
        let (route, _gr) = routing.pointers(&c, stream, (tokens, topk, bank.experts, shared.is_some()))?;
        // Slots on x: a prompt pass has tokens × (topk + 1) of them, past y's 65,535.
        let grid = |slots, inter| Ok((c.i32("slots", slots)? as u32, blocks(inter, ROWS_PER_BLOCK)));
        self.gate_up_with(&c, stream, bank, shared, (x, ldx), (tokens, topk, route), out, grid)
    }

    /// The checks and launch of a gate_up kernel (this one or the grouped one of experts.rs),
    /// whose grid `grid(slots, I)` gives; `route` the routing's addresses (checked).
    pub(crate) fn gate_up_with(
        &self,
        c: &Check,
        stream: &CudaStream,
        bank: &MatrixView,
        shared: Option<&MatrixView>,
        (x, ldx): (&impl DevicePtr<bf16>, usize),
        (tokens, topk, route): (usize, usize, [u64; 3]),
        out: &mut impl DevicePtrMut<bf16>,
        grid: impl FnOnce(usize, usize) -> Result<(u32, u32)>,
    ) -> Result<()> {
        c.ensure(bank.rows.is_multiple_of(2), || {
            format!("gate_up rows {} are not even", bank.rows)
        })?;
        let inter = bank.rows / 2;
        let slots = self.check_shared(c, bank, shared, tokens, topk)?;
        c.ensure(ldx >= bank.cols && ldx.is_multiple_of(8), || {
            format!("ldx {ldx} (cols {})", bank.cols)
        })?;
        let (xl, ol) = (x.len(), out.len());
        let (bm, sm, _gw) = bank_mats(c, stream, bank, shared)?;
        let (xp, _gx) = dptr(x, stream);
        let (op, _go) = dptr_mut(out, stream);
        c.len("x", xl, span(tokens, bank.cols, ldx))?;
        c.len("out", ol, slots * inter)?;
        c.aligned("x", xp, 16)?;
        if slots == 0 {
            return Ok(());
        }
        let args = BankArgs { logits: route[2], ..BankArgs::new(c, (bm, sm), [xp, route[0], 0, op], (tokens, topk, shared.is_some()), ldx, inter)? };
        let (gx, gy) = grid(slots, inter)?;
        let cfg = LaunchConfig { grid_dim: (gx, gy, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch_struct(stream, c.kernel, cfg, &args)
    }

    /// MoE down projection with the routing weights applied and the slots of each token summed:
    /// `y[t] (+)= sum_j w[t*topk+j] * down[e_j] . inp[t*topk+j]` over the experts `e_j` and
    /// weights `w` that `routing` gives, plus the shared slot `tokens*topk + t` when `shared` is
    /// given. `inp` is the dense `[slots, I]` output of [`KernelSet::moe_gate_up`], the bank
    /// `[E, H, I]`, y `[tokens, ldy]`.
    pub fn moe_down<O: GemvOut>(
        &self,
        stream: &CudaStream,
        bank: &MatrixView,
        shared: Option<&MatrixView>,
        inp: &impl DevicePtr<bf16>,
        (tokens, topk): (usize, usize),
        routing: &Routing,
        y: &mut impl DevicePtrMut<O>,
        ldy: usize,
        accumulate: bool,
    ) -> Result<()> {
        let c = Check::new(bank_kernels(bank.encoding()).1);
        let slots = self.check_shared(&c, bank, shared, tokens, topk)?;
        c.ensure(topk < DOWN_MAX_SLOTS, || format!("top-{topk}: down keeps at most {} slots a token", DOWN_MAX_SLOTS - 1))?;
        c.ensure(bank.cols.is_multiple_of(8), || {
            format!("cols {} not a multiple of 8", bank.cols)
        })?;
        c.ensure(ldy >= bank.rows, || {
            format!("ldy {ldy} < rows {}", bank.rows)
        })?;
        let (route, _gr) = routing.pointers(&c, stream, (tokens, topk, bank.experts, shared.is_some()))?;
        let (xl, yl) = (inp.len(), y.len());
        let (bm, sm, _gw) = bank_mats(&c, stream, bank, shared)?;
        let (xp, _gx) = dptr(inp, stream);
        let (yp, _gy) = dptr_mut(y, stream);
        c.len("inp", xl, slots * bank.cols)?;
        c.len("y", yl, span(tokens, bank.rows, ldy))?;
        c.aligned("inp", xp, 16)?;
        if tokens == 0 {
            return Ok(());
        }
        let args = BankArgs {
            out_f32: O::IS_F32 as i32,
            accumulate: accumulate as i32,
            logits: route[2],
            ..BankArgs::new(&c, (bm, sm), [xp, route[0], route[1], yp], (tokens, topk, shared.is_some()), bank.cols, ldy)?
        };
        let cfg = LaunchConfig {
            grid_dim: (
                c.i32("tokens", tokens)? as u32,
                blocks(bank.rows, ROWS_PER_BLOCK),
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch_struct(stream, c.kernel, cfg, &args)
    }

    /// Checks the shared expert against the bank; returns the number of slots.
    pub(crate) fn check_shared(
        &self,
        c: &Check,
        bank: &MatrixView,
        shared: Option<&MatrixView>,
        tokens: usize,
        topk: usize,
    ) -> Result<usize> {
        c.ensure(topk > 0, || "topk is 0".to_string())?;
        if let Some(s) = shared {
            c.ensure(s.encoding() == bank.encoding(), || {
                format!(
                    "shared expert is {:?}, bank is {:?}",
                    s.encoding(),
                    bank.encoding()
                )
            })?;
            c.ensure(
                s.experts == 1 && s.rows == bank.rows && s.cols == bank.cols,
                || {
                    format!(
                        "shared expert is {}x{}x{}, bank rows/cols are {}x{}",
                        s.experts, s.rows, s.cols, bank.rows, bank.cols
                    )
                },
            )?;
        }
        Ok(tokens * topk + if shared.is_some() { tokens } else { 0 })
    }
}
