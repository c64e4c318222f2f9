//! The CPU reference model: loading, per-sequence state and the forward pass of model-spec.md
//! §2.2, top-down. Tokens fed in any split (one prefill, chunks, single-token decode) give the
//! same result up to rounding, because every layer carries its state across calls.

use crate::artifact::Artifact;

use super::attention::{attention, KvCache};
use super::config::ModelConfig;
use super::gdn::{gated_delta_net, GdnState};
use super::moe::moe;
use super::ops::rms_norm_zc;
use super::weights::{LayerWeights, Loader, Mixer, ModelError, MtpWeights, Weights};

/// Which rows of a forward get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    None,
    Last,
    All,
}

/// What a forward returns.
#[derive(Debug, Clone, Default)]
pub struct ForwardOut {
    /// `logit_rows × vocab`, row-major.
    pub logits: Vec<f32>,
    pub logit_rows: usize,
    /// Final-normed hidden states of every row (`n × H`), the vector that goes into the head:
    /// what the MTP block consumes (model-spec.md §3.1). Empty unless asked for (main model);
    /// always filled by the MTP forward.
    pub hidden: Vec<f32>,
}

/// Per-sequence state of one decoder layer.
#[derive(Debug, Clone)]
pub enum LayerState {
    Gdn(GdnState),
    Attn(KvCache),
}

/// Everything a sequence carries between forwards.
#[derive(Debug, Clone)]
pub struct SeqState {
    layers: Vec<LayerState>,
    len: usize,
}

impl SeqState {
    /// Tokens already processed (= the position of the next one).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

pub struct Model {
    config: ModelConfig,
    weights: Weights,
    mtp: Option<MtpWeights>,
}

impl Model {
    /// Reads the `text` config and dequantizes every weight; the MTP block only when `mtp` is
    /// asked for and the artifact has the `mtp` component.
    pub fn load(art: &Artifact, mtp: bool) -> Result<Model, ModelError> {
        let text = art.component("text").ok_or_else(|| ModelError::Invalid("the artifact has no `text` component".into()))?;
        let config = ModelConfig::from_json(text).map_err(ModelError::Invalid)?;
        let loader = Loader::new(art, &config);
        let weights = loader.weights()?;
        let mtp = if mtp && art.component("mtp").is_some() { Some(loader.mtp()?) } else { None };
        Ok(Model { config, weights, mtp })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The dequantized weights (read-only; for tests and tools).
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    pub(crate) fn mtp_weights(&self) -> Option<&MtpWeights> {
        self.mtp.as_ref()
    }

    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// An empty sequence state.
    pub fn new_state(&self) -> SeqState {
        let layers = self
            .weights
            .layers
            .iter()
            .map(|l| match l.mixer {
                Mixer::Gdn(_) => LayerState::Gdn(GdnState::new(&self.config)),
                Mixer::Attn(_) => LayerState::Attn(KvCache::default()),
            })
            .collect();
        SeqState { layers, len: 0 }
    }

    /// Embedding rows of `tokens` (`n × H`).
    pub(crate) fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let v = self.config.vocab_size;
        let mut h = Vec::with_capacity(tokens.len() * self.config.hidden_size);
        for &t in tokens {
            if t as usize >= v {
                return Err(ModelError::Invalid(format!("token id {t} out of range (vocabulary {v})")));
            }
            h.extend_from_slice(self.weights.embed.row(t as usize));
        }
        Ok(h)
    }

    /// Logits of the selected rows of final-normed `hidden` (`n × H`).
    pub(crate) fn head(&self, hidden: &[f32], rows: LogitRows) -> (Vec<f32>, usize) {
        let hs = self.config.hidden_size;
        let n = hidden.len() / hs;
        let picked = match rows {
            LogitRows::None => &hidden[..0],
            LogitRows::Last if n > 0 => &hidden[(n - 1) * hs..],
            LogitRows::Last => &hidden[..0],
            LogitRows::All => hidden,
        };
        (self.weights.head.apply(picked), picked.len() / hs)
    }

    /// Runs `tokens` through the model, continuing `state` (model-spec.md §2.2).
    pub fn forward(&self, state: &mut SeqState, tokens: &[u32], rows: LogitRows, want_hidden: bool) -> Result<ForwardOut, ModelError> {
        if tokens.is_empty() {
            return Ok(ForwardOut::default());
        }
        // 1. h₀ = Embed[token].
        let mut h = self.embed(tokens)?;
        // 2. Every decoder layer, each continuing its own state.
        for (lw, ls) in self.weights.layers.iter().zip(state.layers.iter_mut()) {
            decoder_layer(&self.config, lw, ls, &mut h);
        }
        state.len += tokens.len();
        // 3. Final zero-centred norm, then the head on the requested rows.
        rms_norm_zc(&mut h, &self.weights.final_norm, self.config.rms_norm_eps);
        let (logits, logit_rows) = self.head(&h, rows);
        Ok(ForwardOut { logits, logit_rows, hidden: if want_hidden { h } else { Vec::new() } })
    }
}

/// One pre-norm decoder layer in place over `h` (`n × H`), model-spec.md §2.2:
/// h += Mixer(RMSNorm_in(h)); h += MoE(RMSNorm_post(h)). Shared with the MTP block.
pub(crate) fn decoder_layer(cfg: &ModelConfig, lw: &LayerWeights, ls: &mut LayerState, h: &mut [f32]) {
    let mut a = h.to_vec();
    rms_norm_zc(&mut a, &lw.attn_norm, cfg.rms_norm_eps);
    let mixed = match (&lw.mixer, ls) {
        (Mixer::Gdn(w), LayerState::Gdn(s)) => gated_delta_net(cfg, w, &a, s),
        (Mixer::Attn(w), LayerState::Attn(c)) => attention(cfg, w, &a, c),
        _ => unreachable!("layer states are built from the same layer list as the weights"),
    };
    for (x, m) in h.iter_mut().zip(&mixed) {
        *x += m;
    }
    let mut b = h.to_vec();
    rms_norm_zc(&mut b, &lw.moe_norm, cfg.rms_norm_eps);
    let y = moe(cfg, &lw.moe, &b);
    for (x, m) in h.iter_mut().zip(&y) {
        *x += m;
    }
}
