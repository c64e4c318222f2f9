//! Launchers of kernels/experts.cu and experts_batch.cu: the MoE experts per slot (decode, every
//! encoding), those of a decode batch and of a prompt pass run once per chosen expert (NVFP4
//! banks on the tensor cores), and the sum of each token's slots into the residual.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop};
use half::bf16;

use crate::gemv::{span, Encoding, GemvOut, MatArgs, MatrixView, ROWS_PER_BLOCK};
use crate::launch::{blocks, device_args, dptr, dptr_mut, Check, Result};
use crate::loader::KernelSet;
use crate::moe::Routing;
use crate::table::Kernel;

/// The most tokens a grouped launch takes (an expert's slot list lives in shared memory).
pub const GROUPED_MAX_TOKENS: usize = 1024;
/// The most tokens a batch expert launch takes (MMA_EXPERT_MAX_TOKENS in experts_batch.cu).
pub const BATCH_MAX_TOKENS: usize = 16;
/// The warps of a batch expert block (MMA_EXPERT_WARPS in experts_batch.cu).
const BATCH_WARPS: usize = 4;
/// The most a grouped kernel's K (H for gate_up, I for down) may be: 8 warps × 8 groups of 32.
const GROUPED_MAX_K: usize = 2048;

#[repr(C)]
struct CombineArgs {
    part: u64,
    ids: u64,
    y: u64,
    tokens: i32,
    topk: i32,
    has_shared: i32,
    experts: i32,
    dim: i32,
    ldy: i32,
}
device_args!(CombineArgs, 48);

/// Routing table rows a down block keeps: top-32 and the shared slot (DOWN_MAX_SLOTS in experts.cu).
const DOWN_MAX_SLOTS: usize = 33;
/// The rows (warps) of a per-slot gate_up block (GATE_UP_WARPS in experts.cu).
const GATE_UP_WARPS: usize = 4;

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

impl KernelSet {
    /// [`KernelSet::moe_gate_up`]'s output for an NVFP4 bank (`[E, 2I, H]`) and shared expert
    /// (`[2I, H]`, same encoding), computed per expert over every slot that chose it: `out` is
    /// bf16 `[slots, I]`. Slots whose id is outside `[0, E)` are not written.
    pub fn moe_gate_up_grouped(
        &self,
        stream: &CudaStream,
        bank: &MatrixView,
        shared: Option<&MatrixView>,
        x: &impl DevicePtr<bf16>,
        ldx: usize,
        tokens: usize,
        topk: usize,
        ids: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let c = Check::new(Kernel::MoeGateUpGroupedNvfp4);
        check_grouped(&c, bank, tokens, bank.cols)?;
        let (gx, gy) = expert_grid(bank, shared, bank.rows / 2);
        self.gate_up_by_expert(&c, stream, (bank, shared), (x, ldx), (tokens, topk), ids, out, (gx, gy, 256))
    }

    /// The checks and launch of a gate_up kernel that runs each expert once for its slots
    /// (the grouped one or the batch one), routed by `ids`, on the grid and block threads given.
    fn gate_up_by_expert(
        &self,
        c: &Check,
        stream: &CudaStream,
        (bank, shared): (&MatrixView, Option<&MatrixView>),
        (x, ldx): (&impl DevicePtr<bf16>, usize),
        (tokens, topk): (usize, usize),
        ids: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<bf16>,
        grid: (u32, u32, u32),
    ) -> Result<()> {
        c.ensure(bank.rows.is_multiple_of(32), || format!("gate_up rows {} are not 2·I with I % 16 == 0", bank.rows))?;
        c.len("ids", ids.len(), tokens * topk)?;
        let (ip, _gi) = dptr(ids, stream);
        self.gate_up_with(c, stream, bank, shared, (x, ldx), (tokens, topk, [ip, 0, 0]), out, |_, _| Ok(grid))
    }

    /// Each slot's weighted down projection, per expert over every slot that chose it:
    /// `part[s, n] = route_w[s] · (inp[s] · W[ids[s]][n])`, f32 `[slots, H]`, for an NVFP4 bank
    /// `[E, H, I]`; `inp` is the gate_up output `[slots, I]`. [`KernelSet::moe_combine`] sums
    /// the slots into the residual.
    pub fn moe_down_grouped(
        &self,
        stream: &CudaStream,
        bank: &MatrixView,
        shared: Option<&MatrixView>,
        inp: &impl DevicePtr<bf16>,
        tokens: usize,
        topk: usize,
        ids: &impl DevicePtr<i32>,
        route_w: &impl DevicePtr<f32>,
        part: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let c = Check::new(Kernel::MoeDownGroupedNvfp4);
        check_grouped(&c, bank, tokens, bank.cols)?;
        let (gx, gy) = expert_grid(bank, shared, bank.rows);
        self.down_parts_with(&c, stream, (bank, shared), inp, (tokens, topk), (ids, route_w), part, (gx, gy, 256))
    }

    /// The checks and launch of a down kernel into per-slot rows (the grouped one or the
    /// batch one), on the grid and block threads given.
    fn down_parts_with(
        &self,
        c: &Check,
        stream: &CudaStream,
        (bank, shared): (&MatrixView, Option<&MatrixView>),
        inp: &impl DevicePtr<bf16>,
        (tokens, topk): (usize, usize),
        (ids, route_w): (&impl DevicePtr<i32>, &impl DevicePtr<f32>),
        part: &mut impl DevicePtrMut<f32>,
        (gx, gy, threads): (u32, u32, u32),
    ) -> Result<()> {
        let slots = self.check_shared(c, bank, shared, tokens, topk)?;
        c.ensure(bank.rows.is_multiple_of(16), || format!("down rows {} not a multiple of 16", bank.rows))?;
        let (xl, il, wl, pl) = (inp.len(), ids.len(), route_w.len(), part.len());
        let (bm, sm, _gb) = bank_mats(c, stream, bank, shared)?;
        let (xp, _gx) = dptr(inp, stream);
        let (ip, _gi) = dptr(ids, stream);
        let (wp, _gw) = dptr(route_w, stream);
        let (pp, _gp) = dptr_mut(part, stream);
        c.len("inp", xl, slots * bank.cols)?;
        c.len("ids", il, tokens * topk)?;
        c.len("route_w", wl, slots)?;
        c.len("part", pl, slots * bank.rows)?;
        c.aligned("inp", xp, 16)?;
        if tokens == 0 {
            return Ok(());
        }
        let args = BankArgs::new(c, (bm, sm), [xp, ip, wp, pp], (tokens, topk, shared.is_some()), bank.cols, bank.rows)?;
        let cfg = LaunchConfig { grid_dim: (gx, gy, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        self.launch_struct(stream, c.kernel, cfg, &args)
    }

    /// [`KernelSet::moe_gate_up`]'s output for a decode batch of at most
    /// [`BATCH_MAX_TOKENS`] tokens of an NVFP4 bank (`[E, 2I, H]`) routed by `ids`
    /// `[tokens·topk]`, and the shared expert (`[2I, H]`, same encoding): each chosen expert
    /// runs once on the tensor cores, for every slot that chose it. A token's ids must be
    /// distinct, as [`KernelSet::moe_route`] makes them; H must be a multiple of 128.
    pub fn moe_gate_up_batch(
        &self,
        stream: &CudaStream,
        bank: &MatrixView,
        shared: Option<&MatrixView>,
        x: &impl DevicePtr<bf16>,
        ldx: usize,
        (tokens, topk): (usize, usize),
        ids: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let c = Check::new(Kernel::MoeGateUpMmaNvfp4);
        check_batch(&c, bank, tokens)?;
        c.ensure(bank.cols.is_multiple_of(128), || format!("H = {} is not a multiple of 128", bank.cols))?;
        let gx = c.i32("slots", tokens * topk + shared.is_some() as usize)? as u32;
        let grid = (gx, (bank.rows / 32) as u32, 32 * BATCH_WARPS as u32);
        self.gate_up_by_expert(&c, stream, (bank, shared), (x, ldx), (tokens, topk), ids, out, grid)
    }

    /// [`KernelSet::moe_down_grouped`]'s output for a decode batch of at most
    /// [`BATCH_MAX_TOKENS`] tokens: `part[s, n] = route_w[s] · (inp[s] · W[ids[s]][n])`, f32
    /// `[slots, H]`, each chosen expert of an NVFP4 bank `[E, H, I]` run once on the tensor
    /// cores for every slot that chose it; slots whose id is outside `[0, E)` are not written.
    /// I must be a multiple of 512. [`KernelSet::moe_combine`] sums the slots into the residual.
    pub fn moe_down_batch(
        &self,
        stream: &CudaStream,
        bank: &MatrixView,
        shared: Option<&MatrixView>,
        inp: &impl DevicePtr<bf16>,
        (tokens, topk): (usize, usize),
        ids: &impl DevicePtr<i32>,
        route_w: &impl DevicePtr<f32>,
        part: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let c = Check::new(Kernel::MoeDownMmaNvfp4);
        check_batch(&c, bank, tokens)?;
        c.ensure(bank.cols.is_multiple_of(512), || format!("I = {} is not a multiple of 512", bank.cols))?;
        // One 16-row tile a warp at every batch size: at 16 tokens x16 read 2,147.6 tok/s against
        // 2,032.6 with four tiles a warp and 2,107.5 with two, batch 1 the same (H100,
        // 2026-12-06, docs/performance-log.md); 5-8 tokens, which had two, were not read apart.
        let gx = c.i32("slots", tokens * topk + shared.is_some() as usize)? as u32;
        let grid = (gx, blocks(bank.rows / 16, BATCH_WARPS), 32 * BATCH_WARPS as u32);
        self.down_parts_with(&c, stream, (bank, shared), inp, (tokens, topk), (ids, route_w), part, grid)
    }

    /// `y[t] = bf16(y[t] + bf16(Σ_j part[t·topk + j] + part[tokens·topk + t]))` over `dim`
    /// columns: the routed slots in order (those with an id outside `[0, experts)` skipped),
    /// then the shared slot when `has_shared`.
    pub fn moe_combine(
        &self,
        stream: &CudaStream,
        part: &impl DevicePtr<f32>,
        ids: &impl DevicePtr<i32>,
        tokens: usize,
        topk: usize,
        experts: usize,
        has_shared: bool,
        y: &mut impl DevicePtrMut<bf16>,
        dim: usize,
        ldy: usize,
    ) -> Result<()> {
        let c = Check::new(Kernel::MoeCombine);
        let slots = tokens * topk + if has_shared { tokens } else { 0 };
        c.ensure(ldy >= dim, || format!("ldy {ldy} < dim {dim}"))?;
        let (pl, il, yl) = (part.len(), ids.len(), y.len());
        let (pp, _gp) = dptr(part, stream);
        let (ip, _gi) = dptr(ids, stream);
        let (yp, _gy) = dptr_mut(y, stream);
        c.len("part", pl, slots * dim)?;
        c.len("ids", il, tokens * topk)?;
        c.len("y", yl, if tokens == 0 { 0 } else { (tokens - 1) * ldy + dim })?;
        if tokens == 0 {
            return Ok(());
        }
        let args = CombineArgs {
            part: pp,
            ids: ip,
            y: yp,
            tokens: c.i32("tokens", tokens)?,
            topk: c.i32("topk", topk)?,
            has_shared: has_shared as i32,
            experts: c.i32("experts", experts)?,
            dim: c.i32("dim", dim)?,
            ldy: c.i32("ldy", ldy)?,
        };
        let cfg = LaunchConfig { grid_dim: (tokens as u32, blocks(dim, 256), 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch_struct(stream, c.kernel, cfg, &args)
    }
}

/// Warps of a one-token down block (ONE_DOWN_WARPS in experts_batch.cu).
const ONE_DOWN_WARPS: usize = 12;

/// Whether [`KernelSet::moe_down`] takes the one-token tensor-core kernel (experts_batch.cu):
/// one token of an NVFP4 bank whose I is whole 128-column blocks and H whole 16-row tiles. With
/// it and attention's early tile rows an H100's decode step went from 2,175 to 2,101 µs, 33 of
/// them in attention's kernels (docs/performance-log.md, 2026-12-05).
fn one_token_down(bank: &MatrixView, tokens: usize) -> bool {
    tokens == 1 && bank.encoding() == Encoding::Nvfp4 && bank.cols.is_multiple_of(128) && bank.rows.is_multiple_of(16)
}

/// The grouped kernels' grid: one block per expert (and the shared one) and 16-row tile.
fn expert_grid(bank: &MatrixView, shared: Option<&MatrixView>, tile_rows: usize) -> (u32, u32) {
    ((bank.experts + shared.is_some() as usize) as u32, (tile_rows / 16) as u32)
}

/// The checks both batch kernels add to the bank kernels' own.
fn check_batch(c: &Check, bank: &MatrixView, tokens: usize) -> Result<()> {
    c.ensure(matches!(bank.weights, crate::Weights::Nvfp4 { .. }), || "the batch expert kernels take NVFP4 banks".to_string())?;
    c.ensure(tokens <= BATCH_MAX_TOKENS, || format!("{tokens} tokens, at most {BATCH_MAX_TOKENS} per batch launch"))
}

/// The checks both grouped kernels add to the bank kernels' own.
fn check_grouped(c: &Check, bank: &MatrixView, tokens: usize, k: usize) -> Result<()> {
    c.ensure(matches!(bank.weights, crate::Weights::Nvfp4 { .. }), || "the grouped expert kernels take NVFP4 banks".to_string())?;
    c.ensure(tokens <= GROUPED_MAX_TOKENS, || format!("{tokens} tokens, at most {GROUPED_MAX_TOKENS} per grouped launch"))?;
    c.ensure(k.is_multiple_of(32) && k <= GROUPED_MAX_K, || format!("K = {k} must be a multiple of 32 and at most {GROUPED_MAX_K}"))
}

impl KernelSet {
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
        let grid = |slots, inter| Ok((c.i32("slots", slots)? as u32, blocks(inter, GATE_UP_WARPS), 32 * GATE_UP_WARPS as u32));
        self.gate_up_with(&c, stream, bank, shared, (x, ldx), (tokens, topk, route), out, grid)
    }

    /// The checks and launch of a gate_up kernel (the per-slot or the grouped one),
    /// whose grid and block threads `grid(slots, I)` gives; `route` the routing's addresses (checked).
    pub(crate) fn gate_up_with(
        &self,
        c: &Check,
        stream: &CudaStream,
        bank: &MatrixView,
        shared: Option<&MatrixView>,
        (x, ldx): (&impl DevicePtr<bf16>, usize),
        (tokens, topk, route): (usize, usize, [u64; 3]),
        out: &mut impl DevicePtrMut<bf16>,
        grid: impl FnOnce(usize, usize) -> Result<(u32, u32, u32)>,
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
        let (gx, gy, threads) = grid(slots, inter)?;
        let cfg = LaunchConfig { grid_dim: (gx, gy, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        self.launch_struct(stream, c.kernel, cfg, &args)
    }

    /// MoE down projection with the routing weights applied and the slots of each token summed:
    /// `y[t] (+)= sum_j w[t*topk+j] * down[e_j] . inp[t*topk+j]` over the experts `e_j` and
    /// weights `w` that `routing` gives, plus the shared slot `tokens*topk + t` when `shared` is
    /// given. `inp` is the dense `[slots, I]` output of [`KernelSet::moe_gate_up`], the bank
    /// `[E, H, I]`, y `[tokens, ldy]`. One token of an NVFP4 bank of whole 128-column blocks
    /// runs on the tensor cores, which sum the slots in another (fixed) order.
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
        let one = one_token_down(bank, tokens);
        let c = Check::new(if one { Kernel::MoeDownOneNvfp4 } else { bank_kernels(bank.encoding()).1 });
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
        let cfg = match one {
            true => LaunchConfig { grid_dim: ((bank.rows / 16) as u32, 1, 1), block_dim: (32 * ONE_DOWN_WARPS as u32, 1, 1), shared_mem_bytes: 0 },
            false => LaunchConfig {
                grid_dim: (c.i32("tokens", tokens)? as u32, blocks(bank.rows, ROWS_PER_BLOCK), 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
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
