//! The resolved text-model config (docs/format.md §4): read once from the artifact's `text`
//! component, validated, then immutable. Derived sizes are methods, not stored copies.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// Gated DeltaNet (model-spec.md §2.4).
    LinearAttention,
    /// Gated full attention (model-spec.md §2.3).
    FullAttention,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub layer_types: Vec<LayerKind>,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub num_attention_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// 0 when the model has no shared expert.
    pub shared_expert_intermediate_size: usize,
    #[serde(default)]
    pub eos_token_ids: Vec<u32>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
}

fn default_max_pos() -> usize {
    262_144
}

impl ModelConfig {
    pub fn from_json(v: &serde_json::Value) -> Result<Self, String> {
        let c: ModelConfig = serde_json::from_value(v.clone()).map_err(|e| format!("text config: {e}"))?;
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), String> {
        let bad = |m: String| Err(format!("text config: {m}"));
        if self.layer_types.len() != self.num_layers {
            return bad(format!("{} layer_types for {} layers", self.layer_types.len(), self.num_layers));
        }
        if self.num_kv_heads == 0 || !self.num_attention_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!("{} attention heads not divisible by {} kv heads", self.num_attention_heads, self.num_kv_heads));
        }
        if self.linear_num_key_heads == 0 || !self.linear_num_value_heads.is_multiple_of(self.linear_num_key_heads) {
            return bad(format!(
                "{} GDN value heads not divisible by {} key heads",
                self.linear_num_value_heads, self.linear_num_key_heads
            ));
        }
        if self.rotary_dim > self.head_dim || !self.rotary_dim.is_multiple_of(2) {
            return bad(format!("rotary_dim {} must be even and <= head_dim {}", self.rotary_dim, self.head_dim));
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
            return bad(format!("top-{} of {} experts", self.num_experts_per_tok, self.num_experts));
        }
        if self.linear_conv_kernel < 1 {
            return bad("linear_conv_kernel must be >= 1".into());
        }
        Ok(())
    }

    /// GDN key width Kd = Hk·dk.
    pub fn gdn_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }

    /// GDN value width Vd = Hv·dv.
    pub fn gdn_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// Conv channels Cd = 2Kd + Vd.
    pub fn gdn_conv_dim(&self) -> usize {
        2 * self.gdn_key_dim() + self.gdn_value_dim()
    }

    pub fn is_full_attention(&self, layer: usize) -> bool {
        self.layer_types[layer] == LayerKind::FullAttention
    }

    pub fn full_attention_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.num_layers).filter(|l| self.is_full_attention(*l))
    }

    pub fn linear_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.num_layers).filter(|l| !self.is_full_attention(*l))
    }
}
