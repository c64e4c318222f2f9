//! Launchers of kernels/experts.cu: the MoE experts of a prompt pass grouped by expert, NVFP4
//! banks on the tensor cores, and the sum of each token's slots into the residual.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;

use crate::gemv::{bank_mats, BankArgs, MatrixView};
use crate::launch::{device_args, dptr, dptr_mut, Check, Result};
use crate::loader::KernelSet;
use crate::table::Kernel;

/// The most tokens a grouped launch takes (an expert's slot list lives in shared memory).
pub const GROUPED_MAX_TOKENS: usize = 1024;
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
        c.ensure(bank.rows.is_multiple_of(32), || format!("gate_up rows {} are not 2·I with I % 16 == 0", bank.rows))?;
        c.len("ids", ids.len(), tokens * topk)?;
        let (ip, _gi) = dptr(ids, stream);
        let grid = |_, inter: usize| Ok(expert_grid(bank, shared, inter));
        self.gate_up_with(&c, stream, bank, shared, (x, ldx), (tokens, topk, [ip, 0, 0]), out, grid)
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
        let slots = self.check_shared(&c, bank, shared, tokens, topk)?;
        c.ensure(bank.rows.is_multiple_of(16), || format!("down rows {} not a multiple of 16", bank.rows))?;
        let (xl, il, wl, pl) = (inp.len(), ids.len(), route_w.len(), part.len());
        let (bm, sm, _gb) = bank_mats(&c, stream, bank, shared)?;
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
        let args = BankArgs::new(&c, (bm, sm), [xp, ip, wp, pp], (tokens, topk, shared.is_some()), bank.cols, bank.rows)?;
        let (gx, gy) = expert_grid(bank, shared, bank.rows);
        let cfg = LaunchConfig { grid_dim: (gx, gy, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch_struct(stream, c.kernel, cfg, &args)
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
        let cfg = LaunchConfig { grid_dim: (tokens as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch_struct(stream, c.kernel, cfg, &args)
    }
}

/// The grouped kernels' grid: one block per expert (and the shared one) and 16-row tile.
fn expert_grid(bank: &MatrixView, shared: Option<&MatrixView>, tile_rows: usize) -> (u32, u32) {
    ((bank.experts + shared.is_some() as usize) as u32, (tile_rows / 16) as u32)
}

/// The checks both grouped kernels add to the bank kernels' own.
fn check_grouped(c: &Check, bank: &MatrixView, tokens: usize, k: usize) -> Result<()> {
    c.ensure(matches!(bank.weights, crate::Weights::Nvfp4 { .. }), || "the grouped expert kernels take NVFP4 banks".to_string())?;
    c.ensure(tokens <= GROUPED_MAX_TOKENS, || format!("{tokens} tokens, at most {GROUPED_MAX_TOKENS} per grouped launch"))?;
    c.ensure(k.is_multiple_of(32) && k <= GROUPED_MAX_K, || format!("K = {k} must be a multiple of 32 and at most {GROUPED_MAX_K}"))
}
