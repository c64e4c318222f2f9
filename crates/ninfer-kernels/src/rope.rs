//! Launcher of kernels/rope.cu: per-head zero-centred q/k norm fused with partial rotate-half
//! RoPE, in place (model-spec.md 2.3 steps 3-4), optionally writing the KV cache rows.

use cudarc::driver::{
    CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop,
};
use half::bf16;

use crate::launch::{blocks, device_args, dptr, dptr_mut, Check, Result};
use crate::loader::KernelSet;
use crate::table::Kernel;

#[repr(C)]
struct RopeArgs {
    q: u64,
    k: u64,
    q_norm: u64,
    k_norm: u64,
    pos: u64,
    v: u64,
    k_cache: u64,
    v_cache: u64,
    slot: u64,
    tokens: i32,
    q_heads: i32,
    k_heads: i32,
    q_ld: i32,
    q_hs: i32,
    k_ld: i32,
    k_hs: i32,
    v_ld: i32,
    v_hs: i32,
    dim: i32,
    rot: i32,
    theta: f32,
    eps: f32,
    pad: i32,
}
device_args!(RopeArgs, 128);

/// Where the heads of a projection output live: head h of token t starts at element
/// `t * ld + h * head_stride` and holds `dim` contiguous values.
#[derive(Clone, Copy, Debug)]
pub struct HeadLayout {
    pub heads: usize,
    pub ld: usize,
    pub head_stride: usize,
}

impl HeadLayout {
    pub(crate) fn check(
        &self,
        c: &Check,
        what: &str,
        len: usize,
        ptr: u64,
        tokens: usize,
        dim: usize,
    ) -> Result<()> {
        c.ensure(
            self.ld.is_multiple_of(8) && self.head_stride.is_multiple_of(8),
            || {
                format!(
                    "{what}: ld {} and head stride {} must be multiples of 8",
                    self.ld, self.head_stride
                )
            },
        )?;
        c.ensure(self.head_stride >= dim || self.heads <= 1, || {
            format!("{what}: head stride {} < dim {dim}", self.head_stride)
        })?;
        if tokens > 0 && self.heads > 0 {
            c.len(
                what,
                len,
                (tokens - 1) * self.ld + (self.heads - 1) * self.head_stride + dim,
            )?;
        }
        c.aligned(what, ptr, 16)
    }
}

/// One layer's KV cache rows that [`KernelSet::qk_norm_rope`] writes besides its in-place
/// work: bf16 caches `[cache_rows, kv_heads, dim]` (kv_heads = the k heads), token t's row at
/// `slots[t]` (page * page_size + offset; negative slots skip the token). The k rows get the
/// final (normed, rotated) k heads; the v heads, `v_layout` from element `v_at` of the q/k
/// buffer on (they share it: the projection output), are copied unchanged.
pub struct KvCacheOut<'a> {
    pub v_at: usize,
    pub v_layout: HeadLayout,
    pub slots: CudaView<'a, i32>,
    pub k_cache: CudaViewMut<'a, bf16>,
    pub v_cache: CudaViewMut<'a, bf16>,
    pub cache_rows: usize,
}

/// Whether the heads of two regions of one buffer, `lo` starting at or before `hi`, are apart:
/// `hi`'s heads sit between `lo`'s in every row (one ld), or after `lo`'s last row.
fn apart(lo: (usize, &HeadLayout), hi: (usize, &HeadLayout), tokens: usize, dim: usize) -> bool {
    let row = |l: &HeadLayout| match l.heads {
        0 => 0,
        n => (n - 1) * l.head_stride + dim,
    };
    let ((la, l), (ha, h)) = (lo, hi);
    let same_rows = l.ld == h.ld && la + row(l) <= ha && ha + row(h) <= la + l.ld;
    same_rows || tokens == 0 || ha >= la + (tokens - 1) * l.ld + row(l)
}

/// Address of an optional norm weight of `dim` values (0 when absent).
fn norm_weight<'a>(
    c: &Check,
    w: Option<&'a CudaView<'_, bf16>>,
    dim: usize,
    stream: &'a CudaStream,
) -> Result<(u64, Option<SyncOnDrop<'a>>)> {
    match w {
        None => Ok((0, None)),
        Some(w) => {
            c.len("norm weight", w.len(), dim)?;
            let (p, g) = w.device_ptr(stream);
            c.aligned("norm weight", p, 16)?;
            Ok((p, Some(g)))
        }
    }
}

/// Most head dim the rope kernel takes (its per-warp shared row).
pub const ROPE_MAX_DIM: usize = 512;

impl KernelSet {
    /// In place on q and k heads: optional zero-centred RMSNorm per head (`q_norm`/`k_norm`,
    /// weight `[dim]`), then rotate-half RoPE on the first `rot` dims at `pos[t]` with base
    /// `theta`, rounding as transformers does in bf16 (see kernels/rope.cu). Both live in `qk`:
    /// the q heads from its start, the k heads from element `k_at` on, either in the same rows
    /// (one ld, k after the q heads of each row: the stacked q/k/v projection) or after every
    /// q row. With `cache`, the same launch also writes each token's k and v cache rows.
    pub fn qk_norm_rope(
        &self,
        stream: &CudaStream,
        qk: &mut impl DevicePtrMut<bf16>,
        q_layout: HeadLayout,
        k_at: usize,
        k_layout: HeadLayout,
        tokens: usize,
        dim: usize,
        rot: usize,
        q_norm: Option<&CudaView<'_, bf16>>,
        k_norm: Option<&CudaView<'_, bf16>>,
        pos: &impl DevicePtr<i32>,
        theta: f32,
        eps: f32,
        mut cache: Option<KvCacheOut<'_>>,
    ) -> Result<()> {
        let c = Check::new(Kernel::QkNormRope);
        c.ensure(
            dim.is_multiple_of(8) && dim > 0 && dim <= ROPE_MAX_DIM,
            || format!("dim {dim} must be a multiple of 8 in 8..={ROPE_MAX_DIM}"),
        )?;
        c.ensure(rot.is_multiple_of(2) && rot <= dim, || {
            format!("rotary dims {rot} for head dim {dim}")
        })?;
        let (len, pl) = (qk.len(), pos.len());
        c.ensure(k_at <= len, || format!("k offset {k_at} past the buffer of {len}"))?;
        // Disjoint heads: a warp rewrites each head while other warps do the rest.
        c.ensure(apart((0, &q_layout), (k_at, &k_layout), tokens, dim), || {
            let (ql, kl) = (q_layout.ld, k_layout.ld);
            format!("k heads at {k_at} overlap the q heads (ld {ql} / {kl})")
        })?;
        if let Some(kv) = &cache {
            let (v_at, vl) = (kv.v_at, &kv.v_layout);
            c.ensure(v_at <= len, || format!("v offset {v_at} past the buffer of {len}"))?;
            c.ensure(vl.heads == k_layout.heads, || {
                format!("k has {} heads, v {}", k_layout.heads, vl.heads)
            })?;
            // The v heads are read while warps rewrite q and k.
            for (at, l, what) in [(0, &q_layout, "q"), (k_at, &k_layout, "k")] {
                let (lo, hi) = if at <= v_at { ((at, l), (v_at, vl)) } else { ((v_at, vl), (at, l)) };
                c.ensure(apart(lo, hi, tokens, dim), || {
                    format!("v heads at {v_at} overlap the {what} heads at {at}")
                })?;
            }
            let cache_len = kv.cache_rows * k_layout.heads * dim;
            c.len("slots", kv.slots.len(), tokens)?;
            c.len("k_cache", kv.k_cache.len(), cache_len)?;
            c.len("v_cache", kv.v_cache.len(), cache_len)?;
        }
        let (pp, _gp) = dptr(pos, stream);
        let (qn, _gqn) = norm_weight(&c, q_norm, dim, stream)?;
        let (kn, _gkn) = norm_weight(&c, k_norm, dim, stream)?;
        let (qp, _gq) = dptr_mut(qk, stream);
        let kp = qp + (k_at * std::mem::size_of::<bf16>()) as u64;
        q_layout.check(&c, "q", len, qp, tokens, dim)?;
        k_layout.check(&c, "k", len - k_at, kp, tokens, dim)?;
        c.len("pos", pl, tokens)?;
        let items = q_layout.heads + k_layout.heads * if cache.is_some() { 2 } else { 1 };
        // Without caches the kernel reads none of v, slot and the caches: all 0 then.
        let (mut vp, mut sp, mut kcp, mut vcp, mut _gc) = (0, 0, 0, 0, None);
        let v_layout = match cache.as_mut() {
            None => HeadLayout { heads: 0, ld: 0, head_stride: 0 },
            Some(kv) => {
                vp = qp + (kv.v_at * std::mem::size_of::<bf16>()) as u64;
                kv.v_layout.check(&c, "v", len - kv.v_at, vp, tokens, dim)?;
                let (p, gs) = dptr(&kv.slots, stream);
                let (kc, gk) = dptr_mut(&mut kv.k_cache, stream);
                let (vc, gv) = dptr_mut(&mut kv.v_cache, stream);
                c.aligned("k_cache", kc, 16)?;
                c.aligned("v_cache", vc, 16)?;
                (sp, kcp, vcp, _gc) = (p, kc, vc, Some((gs, gk, gv)));
                kv.v_layout
            }
        };
        let rows = tokens * items;
        if rows == 0 {
            return Ok(());
        }
        let args = RopeArgs {
            q: qp,
            k: kp,
            q_norm: qn,
            k_norm: kn,
            pos: pp,
            v: vp,
            k_cache: kcp,
            v_cache: vcp,
            slot: sp,
            tokens: c.i32("tokens", tokens)?,
            q_heads: c.i32("q heads", q_layout.heads)?,
            k_heads: c.i32("k heads", k_layout.heads)?,
            q_ld: c.i32("q ld", q_layout.ld)?,
            q_hs: c.i32("q head stride", q_layout.head_stride)?,
            k_ld: c.i32("k ld", k_layout.ld)?,
            k_hs: c.i32("k head stride", k_layout.head_stride)?,
            v_ld: c.i32("v ld", v_layout.ld)?,
            v_hs: c.i32("v head stride", v_layout.head_stride)?,
            dim: dim as i32,
            rot: rot as i32,
            theta,
            eps,
            pad: 0,
        };
        c.i32("rows", rows)?;
        let cfg = LaunchConfig {
            grid_dim: (blocks(rows, 4), 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch_struct(stream, c.kernel, cfg, &args)
    }
}
