//! Binding the artifact's logical tensors (docs/format.md §5) to typed, dequantized f32 weights.
//! Every tensor's shape is checked against the config when it is read, so a mismatch is an error
//! at load that names the tensor, never a wrong answer later.

use crate::artifact::{Artifact, ArtifactError};

use super::config::{LayerKind, ModelConfig};
use super::ops::{MatRef, Matrix};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    #[error("tensor `{name}` has shape {found:?}, the config needs {expected:?}")]
    Shape { name: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("{0}")]
    Invalid(String),
}

/// Gated full attention (model-spec.md §2.3).
pub struct AttnWeights {
    /// [2·Hq·D, H]: per head, D query rows then D gate rows.
    pub q: Matrix,
    pub k: Matrix,
    pub v: Matrix,
    pub o: Matrix,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

/// Gated DeltaNet (model-spec.md §2.4).
pub struct GdnWeights {
    /// [2Kd+Vd, H]: rows q ‖ k ‖ v.
    pub qkv: Matrix,
    pub z: Matrix,
    pub b: Matrix,
    pub a: Matrix,
    /// Depthwise conv taps, [2Kd+Vd, kernel]; the last tap multiplies the current token.
    pub conv: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// Gated norm weight [dv], shared by every value head.
    pub norm: Vec<f32>,
    pub out: Matrix,
}

/// `n` matrices of `[rows, cols]`, contiguous (an expert bank).
pub struct Bank {
    pub n: usize,
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Bank {
    pub fn get(&self, e: usize) -> MatRef<'_> {
        let sz = self.rows * self.cols;
        MatRef { rows: self.rows, cols: self.cols, data: &self.data[e * sz..(e + 1) * sz] }
    }
}

pub struct SharedExpert {
    /// [2·Is, H]: gate rows then up rows.
    pub gate_up: Matrix,
    pub down: Matrix,
    /// The scalar sigmoid gate's weight row [H].
    pub gate: Vec<f32>,
}

/// Sparse MoE block (model-spec.md §2.5).
pub struct MoeWeights {
    pub router: Matrix,
    /// [E, 2I, H]: per expert, I gate rows then I up rows.
    pub gate_up: Bank,
    /// [E, H, I].
    pub down: Bank,
    /// None when `shared_expert_intermediate_size` is 0.
    pub shared: Option<SharedExpert>,
}

pub enum Mixer {
    Gdn(GdnWeights),
    Attn(AttnWeights),
}

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub moe_norm: Vec<f32>,
    pub mixer: Mixer,
    pub moe: MoeWeights,
}

pub struct Weights {
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    pub head: Matrix,
}

/// The MTP block (model-spec.md §3.1); embedding and head are the main model's.
pub struct MtpWeights {
    pub norm_emb: Vec<f32>,
    pub norm_hidden: Vec<f32>,
    /// [H, 2H]: input is embedding-normed ‖ hidden-normed.
    pub fc: Matrix,
    pub layer: LayerWeights,
    pub final_norm: Vec<f32>,
}

/// Reads tensors by logical name, checking shapes.
pub struct Loader<'a> {
    art: &'a Artifact,
    cfg: &'a ModelConfig,
}

impl<'a> Loader<'a> {
    pub fn new(art: &'a Artifact, cfg: &'a ModelConfig) -> Self {
        Loader { art, cfg }
    }

    /// The tensor dequantized, if its shape is one of `shapes` (several spellings of one layout).
    fn read(&self, name: &str, shapes: &[&[usize]]) -> Result<Vec<f32>, ModelError> {
        let t = self.art.tensor(name)?;
        if !shapes.contains(&t.shape) {
            return Err(ModelError::Shape { name: name.into(), expected: shapes[0].to_vec(), found: t.shape.to_vec() });
        }
        Ok(t.to_f32()?)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        self.read(name, &[&[len]])
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
        Ok(Matrix { rows, cols, data: self.read(name, &[&[rows, cols]])? })
    }

    fn bank(&self, name: &str, n: usize, rows: usize, cols: usize) -> Result<Bank, ModelError> {
        Ok(Bank { n, rows, cols, data: self.read(name, &[&[n, rows, cols]])? })
    }

    pub fn weights(&self) -> Result<Weights, ModelError> {
        let c = self.cfg;
        let layers = (0..c.num_layers)
            .map(|i| self.layer(&format!("layers.{i}"), c.layer_types[i]))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Weights {
            embed: self.matrix("embed", c.vocab_size, c.hidden_size)?,
            layers,
            final_norm: self.vector("final_norm", c.hidden_size)?,
            head: self.matrix("head", c.vocab_size, c.hidden_size)?,
        })
    }

    pub fn mtp(&self) -> Result<MtpWeights, ModelError> {
        let h = self.cfg.hidden_size;
        Ok(MtpWeights {
            norm_emb: self.vector("mtp.norm_emb", h)?,
            norm_hidden: self.vector("mtp.norm_hidden", h)?,
            fc: self.matrix("mtp.fc", h, 2 * h)?,
            layer: self.layer("mtp.layers.0", LayerKind::FullAttention)?,
            final_norm: self.vector("mtp.final_norm", h)?,
        })
    }

    /// One decoder layer under prefix `p` (`layers.i` or `mtp.layers.0`).
    fn layer(&self, p: &str, kind: LayerKind) -> Result<LayerWeights, ModelError> {
        let h = self.cfg.hidden_size;
        let mixer = match kind {
            LayerKind::FullAttention => Mixer::Attn(self.attn(p)?),
            LayerKind::LinearAttention => Mixer::Gdn(self.gdn(p)?),
        };
        Ok(LayerWeights {
            attn_norm: self.vector(&format!("{p}.attn_norm"), h)?,
            moe_norm: self.vector(&format!("{p}.moe_norm"), h)?,
            mixer,
            moe: self.moe(p)?,
        })
    }

    fn attn(&self, p: &str) -> Result<AttnWeights, ModelError> {
        let c = self.cfg;
        let (h, d) = (c.hidden_size, c.head_dim);
        Ok(AttnWeights {
            q: self.matrix(&format!("{p}.attn.q"), 2 * c.num_attention_heads * d, h)?,
            k: self.matrix(&format!("{p}.attn.k"), c.num_kv_heads * d, h)?,
            v: self.matrix(&format!("{p}.attn.v"), c.num_kv_heads * d, h)?,
            o: self.matrix(&format!("{p}.attn.o"), h, c.num_attention_heads * d)?,
            q_norm: self.vector(&format!("{p}.attn.q_norm"), d)?,
            k_norm: self.vector(&format!("{p}.attn.k_norm"), d)?,
        })
    }

    fn gdn(&self, p: &str) -> Result<GdnWeights, ModelError> {
        let c = self.cfg;
        let (h, hv, kern) = (c.hidden_size, c.linear_num_value_heads, c.linear_conv_kernel);
        let cd = c.gdn_conv_dim();
        Ok(GdnWeights {
            qkv: self.matrix(&format!("{p}.gdn.qkv"), cd, h)?,
            z: self.matrix(&format!("{p}.gdn.z"), c.gdn_value_dim(), h)?,
            b: self.matrix(&format!("{p}.gdn.b"), hv, h)?,
            a: self.matrix(&format!("{p}.gdn.a"), hv, h)?,
            conv: self.read(&format!("{p}.gdn.conv"), &[&[cd, kern], &[cd, 1, kern]])?,
            a_log: self.vector(&format!("{p}.gdn.A_log"), hv)?,
            dt_bias: self.vector(&format!("{p}.gdn.dt_bias"), hv)?,
            norm: self.vector(&format!("{p}.gdn.norm"), c.linear_value_head_dim)?,
            out: self.matrix(&format!("{p}.gdn.out"), h, c.gdn_value_dim())?,
        })
    }

    fn moe(&self, p: &str) -> Result<MoeWeights, ModelError> {
        let c = self.cfg;
        let (h, e, i, is) = (c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size);
        let shared = if is == 0 {
            None
        } else {
            Some(SharedExpert {
                gate_up: self.matrix(&format!("{p}.moe.shared.gate_up"), 2 * is, h)?,
                down: self.matrix(&format!("{p}.moe.shared.down"), h, is)?,
                gate: self.read(&format!("{p}.moe.shared_gate"), &[&[1, h], &[h]])?,
            })
        };
        Ok(MoeWeights {
            router: self.matrix(&format!("{p}.moe.router"), e, h)?,
            gate_up: self.bank(&format!("{p}.moe.experts.gate_up"), e, 2 * i, h)?,
            down: self.bank(&format!("{p}.moe.experts.down"), e, h, i)?,
            shared,
        })
    }
}
