//! Launcher of kernels/moe.cu: router softmax, top-k and renormalisation (model-spec.md 2.5),
//! and [`Routing`], where the per-slot expert kernels (experts.rs) find each slot's expert.

use cudarc::driver::{CudaStream, CudaView, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop};
use half::bf16;

use crate::launch::{blocks, device_args, dptr, dptr_mut, Check, Result};
use crate::loader::KernelSet;
use crate::table::Kernel;

#[repr(C)]
struct RouteArgs {
    logits: u64,
    ids: u64,
    w: u64,
    tokens: i32,
    ld: i32,
    experts: i32,
    topk: i32,
    has_shared: i32,
    pad: i32,
}
device_args!(RouteArgs, 48);

/// Most experts the router kernel handles (16 per lane of one warp).
pub const ROUTE_MAX_EXPERTS: usize = 512;

/// Where the per-slot expert kernels ([`KernelSet::moe_gate_up`], [`KernelSet::moe_down`])
/// find each slot's expert and routing weight.
pub enum Routing<'a> {
    /// `ids` `[tokens·topk]` and `w` `[slots]` as [`KernelSet::moe_route`] writes them (the
    /// shared slots' weights after the routed ones); gate_up reads only the ids.
    Table { ids: CudaView<'a, i32>, w: CudaView<'a, f32> },
    /// One token's router logits `[E]` (`[E + 1]` with the shared expert, its gate logit
    /// last): every block of both kernels routes them as [`KernelSet::moe_route`] does, so no
    /// routing launch runs between the router product and the experts.
    Logits(CudaView<'a, bf16>),
}

impl Routing<'_> {
    /// The kernels' `ids`, `route_w` and `logits` addresses (0 where unused) after the checks
    /// against `tokens` tokens of `topk` picks among `experts`, with or without a shared slot.
    pub(crate) fn pointers<'s>(&'s self, c: &Check, stream: &'s CudaStream, (tokens, topk, experts, shared): (usize, usize, usize, bool)) -> Result<([u64; 3], Vec<SyncOnDrop<'s>>)> {
        match self {
            Routing::Table { ids, w } => {
                c.len("ids", ids.len(), tokens * topk)?;
                c.len("route_w", w.len(), tokens * (topk + shared as usize))?;
                let ((ip, gi), (wp, gw)) = (dptr(ids, stream), dptr(w, stream));
                Ok(([ip, wp, 0], vec![gi, gw]))
            }
            Routing::Logits(l) => {
                c.ensure(tokens == 1, || format!("logits route one token, not {tokens}"))?;
                c.ensure(experts <= ROUTE_MAX_EXPERTS && topk <= experts.min(32), || format!("top-{topk} of {experts} experts"))?;
                c.len("logits", l.len(), experts + shared as usize)?;
                let (lp, gl) = dptr(l, stream);
                Ok(([0, 0, lp], vec![gl]))
            }
        }
    }
}

impl KernelSet {
    /// Routes `tokens` rows of bf16 router logits `[tokens, ld]`: `ids[t*topk + j]` and
    /// `w[t*topk + j]` get the j-th selected expert and its renormalised weight (a bf16 value in
    /// f32). With `has_shared`, column `experts` of each row is the shared-expert gate logit and
    /// `w[tokens*topk + t] = sigmoid` of it, so `w` holds `tokens*topk + tokens` values.
    pub fn moe_route(
        &self,
        stream: &CudaStream,
        logits: &impl DevicePtr<bf16>,
        ld: usize,
        tokens: usize,
        experts: usize,
        topk: usize,
        has_shared: bool,
        ids: &mut impl DevicePtrMut<i32>,
        w: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let c = Check::new(Kernel::MoeRoute);
        let cols = experts + has_shared as usize;
        c.ensure((1..=ROUTE_MAX_EXPERTS).contains(&experts), || {
            format!("{experts} experts outside 1..={ROUTE_MAX_EXPERTS}")
        })?;
        c.ensure(topk >= 1 && topk <= experts.min(32), || {
            format!("topk {topk} for {experts} experts")
        })?;
        c.ensure(ld >= cols, || format!("ld {ld} < {cols} columns"))?;
        let (ll, il, wl) = (logits.len(), ids.len(), w.len());
        c.len(
            "logits",
            ll,
            if tokens == 0 {
                0
            } else {
                (tokens - 1) * ld + cols
            },
        )?;
        c.len("ids", il, tokens * topk)?;
        c.len("w", wl, tokens * topk + if has_shared { tokens } else { 0 })?;
        if tokens == 0 {
            return Ok(());
        }
        let (lp, _gl) = dptr(logits, stream);
        let (ip, _gi) = dptr_mut(ids, stream);
        let (wp, _gw) = dptr_mut(w, stream);
        let args = RouteArgs {
            logits: lp,
            ids: ip,
            w: wp,
            tokens: c.i32("tokens", tokens)?,
            ld: c.i32("ld", ld)?,
            experts: experts as i32,
            topk: topk as i32,
            has_shared: has_shared as i32,
            pad: 0,
        };
        let cfg = LaunchConfig {
            grid_dim: (blocks(tokens, 4), 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch_struct(stream, c.kernel, cfg, &args)
    }
}
