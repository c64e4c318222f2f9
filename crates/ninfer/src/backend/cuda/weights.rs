//! The model's weights on the GPU: every tensor the text model needs (docs/format.md §5) placed
//! in one device arena, uploaded once from the mapped artifact.
//!
//! Encoded matrices go up byte for byte in the layouts of docs/format.md §3, which the kernels
//! read directly. What the kernels cannot read (f32, f16 or fp8 matrices, or an input dimension
//! that is not a whole number of the kernel's 16-byte chunks) is dequantized once to bf16 at
//! load; norm weights and the conv taps become bf16, the GDN decay parameters f32 (the types the
//! kernels take). Every shape is checked against the config first, so a mismatch names the
//! tensor at open, never a wrong answer later.

use std::io::{IsTerminal as _, Write as _};

use half::bf16;
use ninfer_kernels::cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
use ninfer_kernels::{KernelSet, MatrixView, Weights};

use crate::artifact::codec::PartSource;
use crate::artifact::{Artifact, Encoding, TensorView};
use crate::model::{LayerKind, ModelConfig};

use super::{drv, kern, BackendError};

/// Parts start at multiples of this many bytes in the arena (the kernels need 16).
const ALIGN: usize = 256;
/// Host-to-device copies are cut into pieces of this size so progress can be reported.
const COPY_PIECE: usize = 256 << 20;
/// Weight uploads above this size report progress on stderr.
const PROGRESS_MIN: usize = 1 << 30;

/// A byte range of the arena.
#[derive(Debug, Clone, Copy)]
pub(super) struct Span {
    off: usize,
    len: usize,
}

#[derive(Debug, Clone, Copy)]
enum Parts {
    Bf16 { data: Span },
    Q8 { q: Span, scales: Span },
    Q6 { ql: Span, qh: Span, scales: Span },
    Q4 { q: Span, scales: Span },
    Nvfp4 { codes: Span, scales: Span, global: Span, segments: usize },
}

/// One matrix `[rows, cols]` or expert bank `[experts, rows, cols]` in the arena.
#[derive(Debug, Clone, Copy)]
pub(super) struct DevMat {
    parts: Parts,
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
}

impl DevMat {
    /// Bytes of every part (all experts of a bank).
    pub fn bytes(&self) -> usize {
        match self.parts {
            Parts::Bf16 { data } => data.len,
            Parts::Q8 { q, scales } | Parts::Q4 { q, scales } => q.len + scales.len,
            Parts::Q6 { ql, qh, scales } => ql.len + qh.len + scales.len,
            Parts::Nvfp4 { codes, scales, global, .. } => codes.len + scales.len + global.len,
        }
    }

    /// bf16 or q8_g32: the encodings whose single-row product can norm its own input
    /// (`KernelSet::gemv_norm`).
    pub fn takes_norm(&self) -> bool {
        matches!(self.parts, Parts::Bf16 { .. } | Parts::Q8 { .. })
    }

    /// NVFP4-encoded (the grouped expert kernels take only these).
    pub fn is_nvfp4(&self) -> bool {
        matches!(self.parts, Parts::Nvfp4 { .. })
    }

    /// Same encoding and shape: two such matrices can share one launch (bank + shared expert).
    pub fn same_layout(&self, other: &DevMat) -> bool {
        std::mem::discriminant(&self.parts) == std::mem::discriminant(&other.parts)
            && (self.rows, self.cols) == (other.rows, other.cols)
    }
}

/// The GDN input projections stacked into one matrix (`Planner::stacked`): z, qkv, b, a
/// (`[Vd + Cd + 2·Hv, H]`) when a token's output row keeps z's rows 16-byte aligned, else qkv,
/// b, a with z launched on its own.
pub(super) struct GdnStack {
    pub m: DevMat,
    pub with_z: bool,
}

pub(super) struct GdnW {
    pub stack: Option<GdnStack>,
    pub qkv: DevMat,
    pub z: DevMat,
    pub b: DevMat,
    pub a: DevMat,
    pub out: DevMat,
    /// bf16 `[C, 4]`.
    pub conv: Span,
    /// f32 `[Hv]` each.
    pub a_log: Span,
    pub dt_bias: Span,
    /// bf16 `[dv]`.
    pub norm: Span,
}

pub(super) struct AttnW {
    /// q, k and v stacked into one `[2·Hq·D + 2·Hkv·D, H]` matrix, when stored alike.
    pub stack: Option<DevMat>,
    pub q: DevMat,
    pub k: DevMat,
    pub v: DevMat,
    pub o: DevMat,
    pub q_norm: Span,
    pub k_norm: Span,
}

pub(super) struct SharedW {
    pub gate_up: DevMat,
    pub down: DevMat,
    /// `[1, H]`: the scalar gate's logit row.
    pub gate: DevMat,
}

pub(super) struct MoeW {
    /// The router and the shared expert's gate row stacked into one `[E + 1, H]` matrix.
    pub router_gate: Option<DevMat>,
    pub router: DevMat,
    pub gate_up: DevMat,
    pub down: DevMat,
    pub shared: Option<SharedW>,
    /// The shared expert has the banks' encoding and shape, so it rides in the same launches.
    pub fused: bool,
}

#[allow(clippy::large_enum_variant)] // one per layer, made once at load
pub(super) enum MixerW {
    Gdn(GdnW),
    Attn(AttnW),
}

pub(super) struct LayerW {
    pub attn_norm: Span,
    pub moe_norm: Span,
    pub mixer: MixerW,
    pub moe: MoeW,
}

pub(super) struct ModelW {
    pub embed: DevMat,
    pub layers: Vec<LayerW>,
    pub final_norm: Span,
    pub head: DevMat,
    pub mtp: Option<MtpW>,
}

/// The MTP block (model-spec.md §3.1): two input norms, fc `[H, 2H]` over [e ‖ g], one
/// full-attention decoder layer and its final norm; it shares the embedding and the head.
pub(super) struct MtpW {
    pub norm_emb: Span,
    pub norm_hidden: Span,
    pub fc: DevMat,
    pub layer: LayerW,
    pub final_norm: Span,
}

/// Where the bytes of one arena range come from.
enum Src {
    /// A stored part of the named tensor, as is.
    Part(String, &'static str),
    /// The named NVFP4 tensor's codes, rewritten on the device into the layout the kernels
    /// read (kernels/layout.cu).
    Nvfp4Codes(String),
    /// The named tensor dequantized to bf16.
    Bf16Of(String),
    /// The named tensor dequantized to f32.
    F32Of(String),
}

/// The arena layout, decided before anything is allocated.
pub(super) struct WeightPlan<'a> {
    art: &'a Artifact,
    items: Vec<(Src, Span)>,
    total: usize,
    pub model: ModelW,
}

impl WeightPlan<'_> {
    /// Bytes of the arena.
    pub fn bytes(&self) -> usize {
        self.total
    }
}

/// Inner dimension multiple each raw encoding needs (a lane's 16-byte chunk and whole groups).
fn raw_cols_multiple(enc: Encoding) -> Option<usize> {
    match enc {
        Encoding::Bf16 => Some(8),
        Encoding::Q8G32 | Encoding::Q4G32 | Encoding::Nvfp4 => Some(32),
        Encoding::Q6G64 => Some(64),
        Encoding::F32 | Encoding::F16 | Encoding::Fp8E4m3 => None,
    }
}

struct Planner<'a> {
    art: &'a Artifact,
    items: Vec<(Src, Span)>,
    total: usize,
}

impl<'a> Planner<'a> {
    fn push(&mut self, src: Src, len: usize) -> Span {
        let off = self.total.div_ceil(ALIGN) * ALIGN;
        self.total = off + len;
        let span = Span { off, len };
        self.items.push((src, span));
        span
    }

    /// The tensor, if its logical shape is one of `shapes`.
    fn tensor(&self, name: &str, shapes: &[&[usize]]) -> Result<TensorView<'a>, BackendError> {
        let t = self.art.tensor(name)?;
        if !shapes.contains(&t.shape) {
            return Err(BackendError::Model(format!(
                "tensor `{name}` has shape {:?}, the config needs {:?}",
                t.shape, shapes[0]
            )));
        }
        Ok(t)
    }

    /// A stored part of `t`, uploaded as is.
    fn raw(&mut self, t: &TensorView<'_>, part: &'static str) -> Result<Span, BackendError> {
        let len = t.part(part)?.len();
        Ok(self.push(Src::Part(t.name.to_string(), part), len))
    }

    /// A matrix or bank: raw parts when the kernels read the encoding and shape, else bf16.
    fn mat(&mut self, name: &str, experts: usize, rows: usize, cols: usize) -> Result<DevMat, BackendError> {
        let shape3 = [experts, rows, cols];
        let shape = if experts == 1 { &shape3[1..] } else { &shape3[..] };
        let t = self.tensor(name, &[shape])?;
        let raw = raw_cols_multiple(t.encoding).is_some_and(|m| cols.is_multiple_of(m));
        self.mat_from(t, raw, experts, rows, cols)
    }

    fn mat_from(&mut self, t: TensorView<'a>, raw: bool, experts: usize, rows: usize, cols: usize) -> Result<DevMat, BackendError> {
        let parts = if !raw || t.encoding == Encoding::Bf16 {
            if !cols.is_multiple_of(8) {
                return Err(BackendError::Model(format!(
                    "tensor `{}`: the CUDA kernels need an input dimension that is a multiple of 8, not {cols}",
                    t.name
                )));
            }
            let data = if t.encoding == Encoding::Bf16 {
                self.raw(&t, "data")?
            } else {
                self.push(Src::Bf16Of(t.name.to_string()), t.numel() * 2)
            };
            Parts::Bf16 { data }
        } else {
            let mut raw_part = |name: &'static str| self.raw(&t, name);
            match t.encoding {
                Encoding::Q8G32 => Parts::Q8 { q: raw_part("q")?, scales: raw_part("scales")? },
                Encoding::Q6G64 => Parts::Q6 { ql: raw_part("ql")?, qh: raw_part("qh")?, scales: raw_part("scales")? },
                Encoding::Q4G32 => Parts::Q4 { q: raw_part("q")?, scales: raw_part("scales")? },
                Encoding::Nvfp4 => {
                    let global = raw_part("global")?;
                    let segments = global.len / 4 / experts;
                    let codes = t.part("codes")?.len();
                    let codes = self.push(Src::Nvfp4Codes(t.name.to_string()), codes);
                    Parts::Nvfp4 { codes, scales: self.raw(&t, "scales")?, global, segments }
                }
                other => unreachable!("{other} is never uploaded raw"),
            }
        };
        Ok(DevMat { parts, experts, rows, cols })
    }

    /// Matrices of one input width `cols`, `(name, rows)` each, planned part by part back to
    /// back so that together they are also one matrix of their stacked rows, which one launch
    /// reads (fewer launches per decode step). That needs them stored alike, all bf16 or all
    /// q8_g32 (what the recipes give projections); otherwise each is planned alone and there is
    /// no stack.
    fn stacked(&mut self, mats: &[(String, usize)], cols: usize) -> Result<(Vec<DevMat>, Option<DevMat>), BackendError> {
        let ts = mats.iter().map(|(n, r)| self.tensor(n, &[&[*r, cols]])).collect::<Result<Vec<_>, _>>()?;
        let enc = ts[0].encoding;
        let alike = ts.iter().all(|t| t.encoding == enc)
            && match enc {
                Encoding::Bf16 => cols.is_multiple_of(8),
                Encoding::Q8G32 => cols.is_multiple_of(32),
                _ => false,
            };
        if !alike {
            let alone = mats.iter().map(|(n, r)| self.mat(n, 1, *r, cols)).collect::<Result<Vec<_>, _>>()?;
            return Ok((alone, None));
        }
        let part_names: &[&'static str] = if enc == Encoding::Bf16 { &["data"] } else { &["q", "scales"] };
        // spans[m][p]: part p of matrix m; each part kind is one contiguous run over the matrices.
        let mut spans = vec![Vec::new(); ts.len()];
        for &part in part_names {
            for (m, t) in ts.iter().enumerate() {
                let len = t.part(part)?.len();
                let span = if m == 0 { self.push(Src::Part(t.name.to_string(), part), len) } else { self.push_next(Src::Part(t.name.to_string(), part), len) };
                spans[m].push(span);
            }
        }
        let parts = |sp: &[Span]| match enc {
            Encoding::Bf16 => Parts::Bf16 { data: sp[0] },
            _ => Parts::Q8 { q: sp[0], scales: sp[1] },
        };
        let alone = ts.iter().zip(&spans).map(|(t, sp)| DevMat { parts: parts(sp), experts: 1, rows: t.shape[0], cols }).collect();
        let whole: Vec<Span> = (0..part_names.len())
            .map(|p| Span { off: spans[0][p].off, len: spans.iter().map(|sp| sp[p].len).sum() })
            .collect();
        let rows = mats.iter().map(|(_, r)| r).sum();
        Ok((alone, Some(DevMat { parts: parts(&whole), experts: 1, rows, cols })))
    }

    /// As `push`, directly after the previous range (a stack's next member; rows of bf16 and
    /// q8_g32 parts keep the kernels' 16-byte alignment when the input width allows stacking).
    fn push_next(&mut self, src: Src, len: usize) -> Span {
        let span = Span { off: self.total, len };
        self.total += len;
        self.items.push((src, span));
        span
    }

    /// A vector (or a small matrix such as the conv taps) as bf16, any stored encoding.
    fn bf16_vec(&mut self, name: &str, shapes: &[&[usize]]) -> Result<Span, BackendError> {
        let t = self.tensor(name, shapes)?;
        Ok(match t.encoding {
            Encoding::Bf16 => self.raw(&t, "data")?,
            _ => self.push(Src::Bf16Of(name.to_string()), t.numel() * 2),
        })
    }

    fn f32_vec(&mut self, name: &str, len: usize) -> Result<Span, BackendError> {
        let t = self.tensor(name, &[&[len]])?;
        Ok(match t.encoding {
            Encoding::F32 => self.raw(&t, "data")?,
            _ => self.push(Src::F32Of(name.to_string()), len * 4),
        })
    }

    /// One decoder layer under prefix `p` (`layers.i` or `mtp.layers.0`).
    fn layer(&mut self, c: &ModelConfig, p: &str, kind: LayerKind) -> Result<LayerW, BackendError> {
        let h = c.hidden_size;
        let mixer = match kind {
            LayerKind::LinearAttention => {
                let (hv, cd) = (c.linear_num_value_heads, c.gdn_conv_dim());
                let vd = c.gdn_value_dim();
                let mut names = vec![(format!("{p}.gdn.qkv"), cd), (format!("{p}.gdn.b"), hv), (format!("{p}.gdn.a"), hv)];
                let with_z = (vd + cd + 2 * hv).is_multiple_of(8);
                if with_z {
                    names.insert(0, (format!("{p}.gdn.z"), vd));
                }
                let (mut alone, stack) = self.stacked(&names, h)?;
                let (a, b, qkv) = (alone.pop().expect("a"), alone.pop().expect("b"), alone.pop().expect("qkv"));
                let z = match alone.pop() {
                    Some(z) => z,
                    None => self.mat(&format!("{p}.gdn.z"), 1, vd, h)?,
                };
                MixerW::Gdn(GdnW {
                    stack: stack.map(|m| GdnStack { m, with_z }),
                    qkv,
                    z,
                    b,
                    a,
                    out: self.mat(&format!("{p}.gdn.out"), 1, h, c.gdn_value_dim())?,
                    conv: self.bf16_vec(&format!("{p}.gdn.conv"), &[&[cd, 4], &[cd, 1, 4]])?,
                    a_log: self.f32_vec(&format!("{p}.gdn.A_log"), hv)?,
                    dt_bias: self.f32_vec(&format!("{p}.gdn.dt_bias"), hv)?,
                    norm: self.bf16_vec(&format!("{p}.gdn.norm"), &[&[c.linear_value_head_dim]])?,
                })
            }
            LayerKind::FullAttention => {
                let (hq, hkv, d) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
                let names = [(format!("{p}.attn.q"), 2 * hq * d), (format!("{p}.attn.k"), hkv * d), (format!("{p}.attn.v"), hkv * d)];
                let (mut alone, stack) = self.stacked(&names, h)?;
                let (v, k, q) = (alone.pop().expect("v"), alone.pop().expect("k"), alone.pop().expect("q"));
                MixerW::Attn(AttnW {
                    stack,
                    q,
                    k,
                    v,
                    o: self.mat(&format!("{p}.attn.o"), 1, h, hq * d)?,
                    q_norm: self.bf16_vec(&format!("{p}.attn.q_norm"), &[&[d]])?,
                    k_norm: self.bf16_vec(&format!("{p}.attn.k_norm"), &[&[d]])?,
                })
            }
        };
        let (e, inter, is) = (c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size);
        let gate_up = self.mat(&format!("{p}.moe.experts.gate_up"), e, 2 * inter, h)?;
        let down = self.mat(&format!("{p}.moe.experts.down"), e, h, inter)?;
        let router_name = format!("{p}.moe.router");
        let (router, router_gate, shared) = if is == 0 {
            (self.mat(&router_name, 1, e, h)?, None, None)
        } else {
            let gate_name = format!("{p}.moe.shared_gate");
            let gate_t = self.tensor(&gate_name, &[&[1, h], &[h]])?;
            // A gate stored as a [H] vector is not a matrix row to stack.
            let (router, gate, router_gate) = if gate_t.shape.len() == 2 {
                let (mut alone, stack) = self.stacked(&[(router_name, e), (gate_name, 1)], h)?;
                let gate = alone.pop().expect("two");
                (alone.pop().expect("two"), gate, stack)
            } else {
                let gate_raw = raw_cols_multiple(gate_t.encoding).is_some_and(|m| h.is_multiple_of(m));
                (self.mat(&router_name, 1, e, h)?, self.mat_from(gate_t, gate_raw, 1, 1, h)?, None)
            };
            let shared = SharedW {
                gate_up: self.mat(&format!("{p}.moe.shared.gate_up"), 1, 2 * is, h)?,
                down: self.mat(&format!("{p}.moe.shared.down"), 1, h, is)?,
                gate,
            };
            (router, router_gate, Some(shared))
        };
        let fused = shared.as_ref().is_some_and(|s| s.gate_up.same_layout(&gate_up) && s.down.same_layout(&down));
        Ok(LayerW {
            attn_norm: self.bf16_vec(&format!("{p}.attn_norm"), &[&[h]])?,
            moe_norm: self.bf16_vec(&format!("{p}.moe_norm"), &[&[h]])?,
            mixer,
            moe: MoeW { router_gate, router, gate_up, down, shared, fused },
        })
    }
}

/// Lays out every tensor of the text model, and with `mtp` the MTP block when the artifact
/// has one (no allocation yet).
pub(super) fn plan<'a>(art: &'a Artifact, c: &ModelConfig, mtp: bool) -> Result<WeightPlan<'a>, BackendError> {
    let mut p = Planner { art, items: Vec::new(), total: 0 };
    let (v, h) = (c.vocab_size, c.hidden_size);
    // The embedding kernel reads bf16 and q8_g32 tables; anything else becomes bf16.
    let et = p.tensor("embed", &[&[v, h]])?;
    let embed_raw = match et.encoding {
        Encoding::Bf16 => h.is_multiple_of(8),
        Encoding::Q8G32 => h.is_multiple_of(32),
        _ => false,
    };
    let embed = p.mat_from(et, embed_raw, 1, v, h)?;
    let layers = (0..c.num_layers).map(|i| p.layer(c, &format!("layers.{i}"), c.layer_types[i])).collect::<Result<Vec<_>, _>>()?;
    let final_norm = p.bf16_vec("final_norm", &[&[h]])?;
    let head = p.mat("head", 1, v, h)?;
    let mtp = if mtp && art.component("mtp").is_some() {
        Some(MtpW {
            norm_emb: p.bf16_vec("mtp.norm_emb", &[&[h]])?,
            norm_hidden: p.bf16_vec("mtp.norm_hidden", &[&[h]])?,
            fc: p.mat("mtp.fc", 1, h, 2 * h)?,
            layer: p.layer(c, "mtp.layers.0", LayerKind::FullAttention)?,
            final_norm: p.bf16_vec("mtp.final_norm", &[&[h]])?,
        })
    } else {
        None
    };
    let Planner { items, total, .. } = p;
    Ok(WeightPlan { art, items, total, model: ModelW { embed, layers, final_norm, head, mtp } })
}

/// `b` into `dst` in pieces of COPY_PIECE bytes, `report(bytes copied)` after each.
fn copy_pieces(stream: &std::sync::Arc<CudaStream>, b: &[u8], dst: &mut CudaViewMut<'_, u8>, mut report: impl FnMut(usize)) -> Result<(), BackendError> {
    for (i, piece) in b.chunks(COPY_PIECE).enumerate() {
        let o = i * COPY_PIECE;
        let mut d = dst.slice_mut(o..o + piece.len());
        stream.memcpy_htod(piece, &mut d).map_err(drv("uploading the weights"))?;
        report(o + piece.len());
    }
    Ok(())
}

/// The uploaded weights.
pub(super) struct Arena {
    buf: CudaSlice<u8>,
}

impl Arena {
    /// Allocates the arena and copies every planned range into it.
    pub fn upload(stream: &std::sync::Arc<CudaStream>, ks: &KernelSet, plan: &WeightPlan<'_>, label: &str) -> Result<Arena, BackendError> {
        let mut buf = stream.alloc_zeros::<u8>(plan.total.max(1)).map_err(drv("allocating the weights"))?;
        let loud = plan.total >= PROGRESS_MIN;
        // The running count rewrites its line on a terminal; a log gets only the last line.
        let live = loud && std::io::stderr().is_terminal();
        let mut done = 0usize;
        let mut next_report = 0usize;
        let mut report = |done: usize| {
            if live && done >= next_report {
                eprint!("\rninfer: uploading weights to {label}: {:.1} / {:.1} GB", done as f64 / 1e9, plan.total as f64 / 1e9);
                let _ = std::io::stderr().flush();
                next_report = done + (1 << 30);
            }
        };
        for (src, span) in &plan.items {
            let mut dst = buf.slice_mut(span.off..span.off + span.len);
            match src {
                Src::Part(name, part) => {
                    let t = plan.art.tensor(name)?;
                    copy_pieces(stream, t.part(part)?, &mut dst, |o| report(done + o))?;
                }
                Src::Nvfp4Codes(name) => {
                    let t = plan.art.tensor(name)?;
                    copy_pieces(stream, t.part("codes")?, &mut dst, |o| report(done + o))?;
                    ks.nvfp4_device_layout(stream, &mut dst).map_err(kern)?;
                }
                Src::Bf16Of(name) => {
                    let vals: Vec<bf16> = plan.art.tensor(name)?.to_f32()?.into_iter().map(bf16::from_f32).collect();
                    // SAFETY: the span was sized as numel·2 bytes; bf16 has no invalid bit patterns.
                    let mut d = unsafe { dst.transmute_mut::<bf16>(vals.len()) }.expect("span sized for the values");
                    stream.memcpy_htod(&vals, &mut d).map_err(drv("uploading the weights"))?;
                }
                Src::F32Of(name) => {
                    let vals = plan.art.tensor(name)?.to_f32()?;
                    // SAFETY: the span was sized as numel·4 bytes.
                    let mut d = unsafe { dst.transmute_mut::<f32>(vals.len()) }.expect("span sized for the values");
                    stream.memcpy_htod(&vals, &mut d).map_err(drv("uploading the weights"))?;
                }
            }
            done += span.len;
            report(done);
        }
        stream.synchronize().map_err(drv("uploading the weights"))?;
        if loud {
            // On a terminal the line overwrites the longer running count, so it is padded.
            let (back, pad) = if live { ("\r", "          ") } else { ("", "") };
            eprintln!("{back}ninfer: uploaded {:.2} GB of weights to {label}{pad}", plan.total as f64 / 1e9);
        }
        Ok(Arena { buf })
    }

    fn view<T>(&self, s: Span) -> CudaView<'_, T> {
        let n = s.len / std::mem::size_of::<T>();
        // SAFETY: every span holds a whole number of the element type it is read as, and the
        // arena is only ever read through the types its ranges were written with.
        unsafe { self.buf.slice(s.off..s.off + s.len).transmute::<T>(n) }.expect("span within the arena")
    }

    pub fn bf16(&self, s: Span) -> CudaView<'_, bf16> {
        self.view(s)
    }

    pub fn f32(&self, s: Span) -> CudaView<'_, f32> {
        self.view(s)
    }

    /// The kernels' view of a matrix.
    pub fn mat(&self, m: &DevMat) -> MatrixView<'_> {
        let weights = match m.parts {
            Parts::Bf16 { data } => Weights::Bf16 { data: self.view(data) },
            Parts::Q8 { q, scales } => Weights::Q8G32 { q: self.view(q), scales: self.view(scales) },
            Parts::Q6 { ql, qh, scales } => Weights::Q6G64 { ql: self.view(ql), qh: self.view(qh), scales: self.view(scales) },
            Parts::Q4 { q, scales } => Weights::Q4G32 { q: self.view(q), scales: self.view(scales) },
            Parts::Nvfp4 { codes, scales, global, segments } => {
                Weights::Nvfp4 { codes: self.view(codes), scales: self.view(scales), global: self.view(global), segments }
            }
        };
        MatrixView { weights, experts: m.experts, rows: m.rows, cols: m.cols }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::ArtifactWriter;
    use crate::model::testutil::{noise, tmp_path};

    #[test]
    fn stacked_matrices_are_one_matrix_part_by_part() {
        let path = tmp_path("stacked");
        let mut w = ArtifactWriter::create(&path, 1 << 16).unwrap();
        w.set_meta("qwen3_5_moe", "stack-test", serde_json::json!({}));
        w.set_component("text", crate::model::testutil::config_json(0));
        for (name, rows, enc) in [("a", 3, Encoding::Q8G32), ("b", 2, Encoding::Q8G32), ("c", 1, Encoding::Q8G32), ("d", 2, Encoding::Bf16)] {
            w.add_f32(name, enc, &[rows, 64], "text", &noise(rows as u64, rows * 64)).unwrap();
        }
        let art = Artifact::open(w.finish().unwrap()).unwrap();
        std::fs::remove_file(&path).unwrap();
        let mut p = Planner { art: &art, items: Vec::new(), total: 0 };
        let (alone, stack) = p.stacked(&[("a".into(), 3), ("b".into(), 2), ("c".into(), 1)], 64).unwrap();
        let stack = stack.expect("three q8_g32 matrices stack");
        assert_eq!((stack.rows, stack.cols, stack.experts), (6, 64, 1));
        let (Parts::Q8 { q, scales }, [a, b, c]) = (stack.parts, &alone[..]) else { panic!("q8 parts") };
        // Each part kind runs through the members in order, with no gap.
        let parts: Vec<(Span, Span)> = [a, b, c].iter().map(|m| match m.parts {
            Parts::Q8 { q, scales } => (q, scales),
            _ => panic!("q8 member"),
        }).collect();
        assert_eq!((q.off, q.len, scales.off, scales.len), (parts[0].0.off, 6 * 64, parts[0].1.off, 6 * 2 * 2));
        for m in 1..3 {
            assert_eq!(parts[m].0.off, parts[m - 1].0.off + parts[m - 1].0.len);
            assert_eq!(parts[m].1.off, parts[m - 1].1.off + parts[m - 1].1.len);
        }
        assert_eq!(q.off % ALIGN, 0);
        assert_eq!(stack.bytes(), alone.iter().map(DevMat::bytes).sum::<usize>());
        // Mixed encodings do not stack; each member is still planned.
        let (alone, stack) = p.stacked(&[("a".into(), 3), ("d".into(), 2)], 64).unwrap();
        assert!(stack.is_none());
        assert_eq!(alone.len(), 2);
    }
}
