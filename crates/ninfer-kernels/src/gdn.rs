//! Launchers of kernels/gdn.cu: the causal conv with state and the gated delta-rule
//! recurrence of the linear-attention layers (model-spec.md 2.4).

use cudarc::driver::{CudaStream, CudaView, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;

use crate::launch::{blocks, device_args, dptr, dptr_mut, Check, Result};
use crate::loader::KernelSet;
use crate::table::Kernel;

/// Sequences of a batch, back to back: sequence s owns tokens `cu[s]..cu[s+1]` (cu has
/// `seqs + 1` entries, cu[seqs] = `tokens`) and the state slot `slots[s]` (each below the
/// pool's slot count and distinct; the kernels trust these device-side values).
pub struct SeqSlots<'a> {
    pub seqs: usize,
    pub tokens: usize,
    pub cu: CudaView<'a, i32>,
    pub slots: CudaView<'a, i32>,
}

/// Head counts and dims of a GDN layer: `hk` q/k heads of `dk`, `hv` value heads of `dv`.
#[derive(Clone, Copy, Debug)]
pub struct GdnDims {
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

impl GdnDims {
    /// Channels of the conv and of the qkv projection: q, k and v.
    pub fn conv_channels(&self) -> usize {
        2 * self.hk * self.dk + self.hv * self.dv
    }
}

#[repr(C)]
struct ConvArgs {
    x: u64,
    w: u64,
    state: u64,
    y: u64,
    cu: u64,
    slot: u64,
    seqs: i32,
    channels: i32,
    ldx: i32,
    ldy: i32,
}
device_args!(ConvArgs, 64);

#[repr(C)]
struct RecArgs {
    qkv: u64,
    b: u64,
    a: u64,
    a_log: u64,
    dt_bias: u64,
    state: u64,
    out: u64,
    cu: u64,
    slot: u64,
    seqs: i32,
    hk: i32,
    hv: i32,
    dk: i32,
    dv: i32,
    ld_qkv: i32,
    ld_ba: i32,
    pad: i32,
}
device_args!(RecArgs, 104);

/// How [`KernelSet::gdn_delta`] walks a sequence's tokens; both give the recurrence's result
/// up to f32 rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaForm {
    /// One token after the other (`ninfer_gdn_recurrent`): decode and short rows.
    Recurrent,
    /// 32 tokens at a time through one triangular solve and matrix products
    /// (`ninfer_gdn_chunked`): prompts. Chunks of fewer than [`GDN_CHUNK_MIN`] tokens are
    /// walked as `Recurrent` walks them, to the bit.
    Chunked,
}

/// Tokens per chunk of the chunked form (`GDN_CHUNK` in kernels/gdn.cu); chunks start at each
/// sequence's first token of the launch.
pub const GDN_CHUNK: usize = 32;
/// The shortest chunk the chunked form computes as a chunk (`GDN_CHUNK_MIN`).
pub const GDN_CHUNK_MIN: usize = 12;

/// Dynamic shared memory of `ninfer_gdn_chunked` (`ChunkSmem` in kernels/gdn.cu): keys and
/// queries `[32][dk + 4]`, the state tile `[dk][36]`, the delta and A tiles `[32][36]`, the M
/// tile `[32][33]` and three vectors of 32, all f32.
fn chunk_smem_bytes(dk: usize) -> u32 {
    let floats =
        2 * GDN_CHUNK * (dk + 4) + dk * 36 + 2 * GDN_CHUNK * 36 + GDN_CHUNK * 33 + 3 * GDN_CHUNK;
    (floats * 4) as u32
}

/// Width of the conv kernel the GDN kernels implement (`linear_conv_kernel`).
pub const GDN_CONV_WIDTH: usize = 4;
/// Largest key head dim of the recurrence kernel.
pub const GDN_MAX_DK: usize = 128;

fn span(rows: usize, dim: usize, ld: usize) -> usize {
    if rows == 0 {
        0
    } else {
        (rows - 1) * ld + dim
    }
}

impl SeqSlots<'_> {
    fn check(&self, c: &Check) -> Result<()> {
        c.ensure(self.seqs > 0, || "no sequences".to_string())?;
        c.len("cu", self.cu.len(), self.seqs + 1)?;
        c.len("slots", self.slots.len(), self.seqs)
    }
}

impl KernelSet {
    /// Causal depthwise conv (width 4) + SiLU over `channels` channels, continuing each
    /// sequence from its conv state (bf16 `[slots, 3, channels]`, zeroed at sequence start)
    /// and leaving the last three inputs there. x and y are bf16 `[tokens, ld]`; w is `[C, 4]`.
    pub fn gdn_conv(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<bf16>,
        ldx: usize,
        w: &impl DevicePtr<bf16>,
        channels: usize,
        state: &mut impl DevicePtrMut<bf16>,
        num_slots: usize,
        batch: &SeqSlots,
        y: &mut impl DevicePtrMut<bf16>,
        ldy: usize,
    ) -> Result<()> {
        let c = Check::new(Kernel::GdnConv);
        batch.check(&c)?;
        c.ensure(ldx >= channels && ldy >= channels, || {
            format!("ldx {ldx} / ldy {ldy} < channels {channels}")
        })?;
        let (xl, wl, sl, yl) = (x.len(), w.len(), state.len(), y.len());
        c.len("x", xl, span(batch.tokens, channels, ldx))?;
        c.len("w", wl, channels * GDN_CONV_WIDTH)?;
        c.len("state", sl, num_slots * (GDN_CONV_WIDTH - 1) * channels)?;
        c.len("y", yl, span(batch.tokens, channels, ldy))?;
        let (xp, _gx) = dptr(x, stream);
        let (wp, _gw) = dptr(w, stream);
        let (cup, _gc) = batch.cu.device_ptr(stream);
        let (slp, _gs) = batch.slots.device_ptr(stream);
        let (stp, _gst) = dptr_mut(state, stream);
        let (yp, _gy) = dptr_mut(y, stream);
        c.aligned("w", wp, 8)?;
        let args = ConvArgs {
            x: xp,
            w: wp,
            state: stp,
            y: yp,
            cu: cup,
            slot: slp,
            seqs: c.i32("seqs", batch.seqs)?,
            channels: c.i32("channels", channels)?,
            ldx: c.i32("ldx", ldx)?,
            ldy: c.i32("ldy", ldy)?,
        };
        let cfg = LaunchConfig {
            grid_dim: (blocks(channels, 128), c.i32("seqs", batch.seqs)? as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch_struct(stream, c.kernel, cfg, &args)
    }

    /// Gates, q/k L2 norm and the delta-rule recurrence (see kernels/gdn.cu) for every token of
    /// every sequence, continuing from and updating the f32 state `[slots, Hv, dk, dv]`, in the
    /// given `form`. `qkv` is the conv output `[tokens, ld_qkv]`, `b` and `a` the raw
    /// per-value-head logits `[tokens, ld_ba]`, `a_log` and `dt_bias` f32 `[Hv]`; `out` is dense
    /// bf16 `[tokens, Hv, dv]`.
    pub fn gdn_delta(
        &self,
        form: DeltaForm,
        stream: &CudaStream,
        qkv: &impl DevicePtr<bf16>,
        ld_qkv: usize,
        b: &impl DevicePtr<bf16>,
        a: &impl DevicePtr<bf16>,
        ld_ba: usize,
        a_log: &impl DevicePtr<f32>,
        dt_bias: &impl DevicePtr<f32>,
        state: &mut impl DevicePtrMut<f32>,
        num_slots: usize,
        batch: &SeqSlots,
        dims: GdnDims,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let c = Check::new(match form {
            DeltaForm::Recurrent => Kernel::GdnRecurrent,
            DeltaForm::Chunked => Kernel::GdnChunked,
        });
        batch.check(&c)?;
        let GdnDims { hk, hv, dk, dv } = dims;
        c.ensure(dk.is_multiple_of(8) && dk > 0 && dk <= GDN_MAX_DK, || {
            format!("key dim {dk} must be a multiple of 8 in 8..={GDN_MAX_DK}")
        })?;
        c.ensure(dv > 0 && hk > 0 && hv % hk == 0, || {
            format!("{hv} value heads over {hk} key heads, dv {dv}")
        })?;
        c.ensure(ld_qkv >= dims.conv_channels() && ld_ba >= hv, || {
            format!("ld_qkv {ld_qkv} / ld_ba {ld_ba} too small")
        })?;
        let t = batch.tokens;
        let lens = [
            ("qkv", qkv.len(), span(t, dims.conv_channels(), ld_qkv)),
            ("b", b.len(), span(t, hv, ld_ba)),
            ("a", a.len(), span(t, hv, ld_ba)),
            ("a_log", a_log.len(), hv),
            ("dt_bias", dt_bias.len(), hv),
            ("state", state.len(), num_slots * hv * dk * dv),
            ("out", out.len(), t * hv * dv),
        ];
        for (what, have, need) in lens {
            c.len(what, have, need)?;
        }
        let (qp, _gq) = dptr(qkv, stream);
        let (bp, _gb) = dptr(b, stream);
        let (ap, _ga) = dptr(a, stream);
        let (alp, _gal) = dptr(a_log, stream);
        let (dtp, _gdt) = dptr(dt_bias, stream);
        let (cup, _gc) = batch.cu.device_ptr(stream);
        let (slp, _gs) = batch.slots.device_ptr(stream);
        let (stp, _gst) = dptr_mut(state, stream);
        let (op, _go) = dptr_mut(out, stream);
        let args = RecArgs {
            qkv: qp,
            b: bp,
            a: ap,
            a_log: alp,
            dt_bias: dtp,
            state: stp,
            out: op,
            cu: cup,
            slot: slp,
            seqs: c.i32("seqs", batch.seqs)?,
            hk: c.i32("hk", hk)?,
            hv: c.i32("hv", hv)?,
            dk: dk as i32,
            dv: c.i32("dv", dv)?,
            ld_qkv: c.i32("ld_qkv", ld_qkv)?,
            ld_ba: c.i32("ld_ba", ld_ba)?,
            pad: 0,
        };
        let cfg = LaunchConfig {
            grid_dim: (blocks(dv, 32), hv as u32, batch.seqs as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: match form {
                DeltaForm::Recurrent => 0,
                DeltaForm::Chunked => chunk_smem_bytes(dk),
            },
        };
        self.launch_struct(stream, c.kernel, cfg, &args)
    }
}
