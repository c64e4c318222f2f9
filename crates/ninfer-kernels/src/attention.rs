//! Launchers of kernels/attention.cu: gated causal attention over a paged cache (prefill and
//! decode, GQA, optional split-KV) and the split combine (model-spec.md 2.3 steps 5-6). The
//! cache rows are written by [`KernelSet::qk_norm_rope`].

use cudarc::driver::{CudaStream, CudaView, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop};
use half::bf16;

use crate::launch::{device_args, dptr, dptr_mut, Check, Result};
use crate::loader::KernelSet;
use crate::rope::HeadLayout;
use crate::table::Kernel;

/// One layer's paged KV cache as read by attention: k and v are bf16
/// `[pages * page_size, kv_heads, dim]`.
pub struct PagedKv<'a> {
    pub k: CudaView<'a, bf16>,
    pub v: CudaView<'a, bf16>,
    pub page_size: usize,
    pub kv_heads: usize,
    pub dim: usize,
}

/// The sequences of one attention call. Sequence s has query tokens `cu_q[s]..cu_q[s+1]` and
/// `kv_len[s]` cache positions (its new tokens included, already written), mapped to pages by
/// row s of `block_table` (`[seqs, bt_stride]`). `max_q_len` and `max_kv_len` bound those
/// device values and size the grid; the kernels trust the page ids.
pub struct AttentionBatch<'a> {
    pub seqs: usize,
    pub tokens: usize,
    pub max_q_len: usize,
    pub max_kv_len: usize,
    pub cu_q: CudaView<'a, i32>,
    pub kv_len: CudaView<'a, i32>,
    pub block_table: CudaView<'a, i32>,
    pub bt_stride: usize,
}

#[repr(C)]
struct AttnArgs {
    q: u64,
    gate: u64,
    k_cache: u64,
    v_cache: u64,
    block_table: u64,
    cu_q: u64,
    kv_len: u64,
    out: u64,
    part_o: u64,
    part_ml: u64,
    seqs: i32,
    q_heads: i32,
    kv_heads: i32,
    dim: i32,
    page_size: i32,
    bt_stride: i32,
    q_ld: i32,
    q_hs: i32,
    splits: i32,
    split_len: i32,
    qt: i32,
    scale_log2: f32,
}
device_args!(AttnArgs, 128);

#[repr(C)]
struct CombineArgs {
    part_o: u64,
    part_ml: u64,
    gate: u64,
    out: u64,
    rows: i32,
    q_heads: i32,
    dim: i32,
    splits: i32,
    q_ld: i32,
    q_hs: i32,
}
device_args!(CombineArgs, 56);

/// Cache positions per tile and query rows per block of kernels/attention.cu.
const TILE: usize = 32;
const ROWS: usize = 32;
/// Query rows of a block of `ninfer_attention_mma` (16 per warp, 4 warps).
const MMA_ROWS: usize = 64;
/// Largest head dim of the attention kernel.
pub const ATTN_MAX_DIM: usize = 256;
/// Most KV splits one call uses (`ATT_MAX_SPLITS` in kernels/attention.cu).
pub const ATTN_MAX_SPLITS: usize = 256;

fn smem_bytes(dim: usize) -> u32 {
    ((ROWS + 2 * TILE) * (dim + 8) * 2 + (ROWS * TILE + 3 * ROWS) * 4) as u32
}

/// Query rows of a block of `ninfer_attention_mma_decode` (every warp takes all 16).
const DECODE_ROWS: usize = 16;

/// Dynamic shared memory of the tensor-core kernels: `rows` Q rows, then two K and V tile
/// pairs, bf16.
fn mma_smem_bytes(rows: usize, dim: usize) -> u32 {
    ((rows + 4 * TILE) * (dim + 8) * 2) as u32
}

/// Which kernel of kernels/attention.cu runs an attention launch; both take the same arguments
/// and give the same result up to one bf16 rounding of the probabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnTiles {
    /// `ninfer_attention`: f32 products on the CUDA cores, any head dim that is a multiple of 8.
    Simt,
    /// `ninfer_attention_mma`: bf16 products on the tensor cores, K/V tiles copied ahead by the
    /// copy engine; head dim a multiple of 16. Blocks of at most 16 query rows at a head dim
    /// that is a multiple of 64 (decode) take `ninfer_attention_mma_decode`, the same
    /// arithmetic per element.
    Mma,
}

/// f32 elements of split-KV workspace for `tokens` query tokens with `splits` splits.
pub fn attention_workspace_len(tokens: usize, q_heads: usize, dim: usize, splits: usize) -> usize {
    tokens * q_heads * splits * (dim + 2)
}

impl KernelSet {
    /// Causal GQA attention of the batch's query tokens over the paged cache, times
    /// `sigmoid(gate)` when given (gate rows share q's layout), into dense bf16
    /// `out [tokens, q_heads, dim]`. `scale` is the softmax scale (1/sqrt(dim) in the model).
    pub fn attention(
        &self,
        tiles: AttnTiles,
        stream: &CudaStream,
        q: &impl DevicePtr<bf16>,
        q_layout: HeadLayout,
        gate: Option<&CudaView<'_, bf16>>,
        kv: &PagedKv,
        batch: &AttentionBatch,
        scale: f32,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        self.attention_impl(tiles, stream, q, q_layout, gate, kv, batch, scale, out, None)
    }

    /// As [`KernelSet::attention`], but cutting each sequence's cache into up to
    /// [`ATTN_MAX_SPLITS`] ranges processed by separate blocks (split-KV, for decode with few
    /// sequences and long contexts), then merging them. `workspace` holds f32 scratch of
    /// [`attention_workspace_len`] for the splits chosen; fewer splits are used if it is short.
    pub fn attention_split_kv(
        &self,
        tiles: AttnTiles,
        stream: &CudaStream,
        q: &impl DevicePtr<bf16>,
        q_layout: HeadLayout,
        gate: Option<&CudaView<'_, bf16>>,
        kv: &PagedKv,
        batch: &AttentionBatch,
        scale: f32,
        out: &mut impl DevicePtrMut<bf16>,
        workspace: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let wl = workspace.len();
        let (wp, _gw) = dptr_mut(workspace, stream);
        self.attention_impl(
            tiles,
            stream,
            q,
            q_layout,
            gate,
            kv,
            batch,
            scale,
            out,
            Some((wp, wl)),
        )
    }

    fn attention_impl(
        &self,
        tiles: AttnTiles,
        stream: &CudaStream,
        q: &impl DevicePtr<bf16>,
        q_layout: HeadLayout,
        gate: Option<&CudaView<'_, bf16>>,
        kv: &PagedKv,
        batch: &AttentionBatch,
        scale: f32,
        out: &mut impl DevicePtrMut<bf16>,
        workspace: Option<(u64, usize)>,
    ) -> Result<()> {
        let mma = tiles == AttnTiles::Mma;
        let c = Check::new(if mma { Kernel::AttentionMma } else { Kernel::Attention });
        let (q_heads, kv_heads, dim) = (q_layout.heads, kv.kv_heads, kv.dim);
        c.ensure(!mma || dim.is_multiple_of(16), || {
            format!("head dim {dim} is not a multiple of 16 (tensor-core attention)")
        })?;
        c.ensure(
            dim.is_multiple_of(8) && dim > 0 && dim <= ATTN_MAX_DIM,
            || format!("head dim {dim} must be a multiple of 8 in 8..={ATTN_MAX_DIM}"),
        )?;
        c.ensure(
            kv_heads > 0 && q_heads % kv_heads == 0 && q_heads / kv_heads <= ROWS,
            || format!("{q_heads} query heads over {kv_heads} kv heads (group at most {ROWS})"),
        )?;
        c.ensure(kv.page_size > 0, || "page size 0".to_string())?;
        c.ensure(batch.seqs > 0, || "no sequences".to_string())?;
        let group = q_heads / kv_heads;
        let pages_needed = batch.max_kv_len.div_ceil(kv.page_size);
        c.ensure(batch.bt_stride >= pages_needed, || {
            format!(
                "block table stride {} < {pages_needed} pages",
                batch.bt_stride
            )
        })?;
        c.len("cu_q", batch.cu_q.len(), batch.seqs + 1)?;
        c.len("kv_len", batch.kv_len.len(), batch.seqs)?;
        c.len(
            "block_table",
            batch.block_table.len(),
            batch.seqs * batch.bt_stride,
        )?;
        c.ensure(
            kv.k.len() == kv.v.len() && kv.k.len() % (kv.page_size * kv_heads * dim) == 0,
            || {
                format!(
                    "k/v caches of {} / {} elements are not whole pages",
                    kv.k.len(),
                    kv.v.len()
                )
            },
        )?;
        let (ql, ol) = (q.len(), out.len());
        let (qp, _gq) = dptr(q, stream);
        q_layout.check(&c, "q", ql, qp, batch.tokens, dim)?;
        let (gp, _gg): (u64, Option<SyncOnDrop>) = match gate {
            None => (0, None),
            Some(g) => {
                let (p, guard) = g.device_ptr(stream);
                q_layout.check(&c, "gate", g.len(), p, batch.tokens, dim)?;
                (p, Some(guard))
            }
        };
        let (kp, _gk) = kv.k.device_ptr(stream);
        let (vp, _gv) = kv.v.device_ptr(stream);
        let (btp, _gbt) = batch.block_table.device_ptr(stream);
        let (cup, _gcu) = batch.cu_q.device_ptr(stream);
        let (klp, _gkl) = batch.kv_len.device_ptr(stream);
        c.aligned("k cache", kp, 16)?;
        c.aligned("v cache", vp, 16)?;
        let (op, _go) = dptr_mut(out, stream);
        c.len("out", ol, batch.tokens * q_heads * dim)?;
        c.aligned("out", op, 16)?;
        if batch.tokens == 0 || batch.max_q_len == 0 {
            return Ok(());
        }
        let rows = if mma { MMA_ROWS } else { ROWS };
        let qt = (rows / group).clamp(1, batch.max_q_len);
        // A block of at most 16 query rows (a decode step, a short draft) takes the decode
        // kernel, whose warps split the output dims instead of the rows, where they divide.
        let decode = mma && qt * group <= DECODE_ROWS && dim.is_multiple_of(64);
        let kernel = match (mma, decode) {
            (false, _) => Kernel::Attention,
            (true, false) => Kernel::AttentionMma,
            (true, true) => Kernel::AttentionMmaDecode,
        };
        let q_tiles = batch.max_q_len.div_ceil(qt);
        let base_blocks = batch.seqs * kv_heads * q_tiles;
        let per_split = attention_workspace_len(batch.tokens, q_heads, dim, 1);
        let smem = match kernel {
            Kernel::AttentionMmaDecode => mma_smem_bytes(DECODE_ROWS, dim),
            Kernel::AttentionMma => mma_smem_bytes(MMA_ROWS, dim),
            _ => smem_bytes(dim),
        };
        let threads = if mma { 128 } else { 256 };
        let mut splits = 1;
        if let Some((_, wlen)) = workspace {
            // Enough splits for the blocks the device holds at once (registers and shared
            // memory decide: 2 or 3 per multiprocessor at head dim 256), each then walking
            // fewer tiles; at 32k positions a KV head's 1,024 tiles are the work to spread.
            let resident = self.resident(kernel, threads, smem as usize)?;
            if base_blocks < resident {
                let tiles = batch.max_kv_len.div_ceil(TILE).max(1);
                splits = resident
                    .div_ceil(base_blocks)
                    .min(tiles)
                    .min(ATTN_MAX_SPLITS)
                    .min(wlen / per_split.max(1))
                    .max(1);
            }
        }
        let split_len = batch.max_kv_len.div_ceil(splits).div_ceil(TILE).max(1) * TILE;
        let splits = batch.max_kv_len.div_ceil(split_len).max(1);
        let (part_o, part_ml) = match workspace {
            Some((w, _)) if splits > 1 => {
                (w, w + (batch.tokens * q_heads * splits * dim * 4) as u64)
            }
            _ => (0, 0),
        };
        let args = AttnArgs {
            q: qp,
            gate: gp,
            k_cache: kp,
            v_cache: vp,
            block_table: btp,
            cu_q: cup,
            kv_len: klp,
            out: op,
            part_o,
            part_ml,
            seqs: c.i32("seqs", batch.seqs)?,
            q_heads: c.i32("q heads", q_heads)?,
            kv_heads: kv_heads as i32,
            dim: dim as i32,
            page_size: c.i32("page size", kv.page_size)?,
            bt_stride: c.i32("block table stride", batch.bt_stride)?,
            q_ld: c.i32("q ld", q_layout.ld)?,
            q_hs: c.i32("q head stride", q_layout.head_stride)?,
            splits: splits as i32,
            split_len: c.i32("split length", split_len)?,
            qt: qt as i32,
            scale_log2: scale * std::f32::consts::LOG2_E,
        };
        let cfg = LaunchConfig {
            grid_dim: (
                c.i32("query tiles", q_tiles)? as u32,
                c.i32("kv blocks", kv_heads * splits)? as u32,
                c.i32("seqs", batch.seqs)? as u32,
            ),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        };
        self.launch_struct(stream, kernel, cfg, &args)?;
        if splits == 1 {
            return Ok(());
        }
        let rows = batch.tokens * q_heads;
        let comb = CombineArgs {
            part_o,
            part_ml,
            gate: gp,
            out: op,
            rows: c.i32("rows", rows)?,
            q_heads: q_heads as i32,
            dim: dim as i32,
            splits: splits as i32,
            q_ld: q_layout.ld as i32,
            q_hs: q_layout.head_stride as i32,
        };
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch_struct(stream, Kernel::AttentionCombine, cfg, &comb)
    }
}
