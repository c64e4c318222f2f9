//! The MTP block (model-spec.md §3.1): one extra full-attention decoder layer that predicts the
//! token after next from (next token, target hidden state). It shares the main embedding and
//! head and keeps its own KV cache; row p of an MTP forward uses rotary position p.

use super::attention::KvCache;
use super::forward::{decoder_layer, ForwardOut, LayerState, LogitRows, Model};
use super::ops::rms_norm_zc;
use super::weights::ModelError;

/// The MTP layer's per-sequence state: its KV cache (one entry per MTP row so far).
#[derive(Debug, Clone)]
pub struct MtpState {
    layer: LayerState,
}

impl MtpState {
    fn cache(&self) -> &KvCache {
        match &self.layer {
            LayerState::Attn(c) => c,
            LayerState::Gdn(_) => unreachable!("the MTP layer is a full-attention layer"),
        }
    }

    /// MTP rows processed so far (= the rotary position of the next row).
    pub fn len(&self) -> usize {
        self.cache().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every row from `len` on (rows of rejected drafts, model-spec.md §3.2).
    pub fn truncate(&mut self, len: usize) {
        if let LayerState::Attn(c) = &mut self.layer {
            c.truncate(len);
        }
    }
}

impl Model {
    /// An empty MTP state, if the MTP block is loaded.
    pub fn new_mtp_state(&self) -> Option<MtpState> {
        self.mtp_weights().map(|_| MtpState { layer: LayerState::Attn(KvCache::default()) })
    }

    /// Runs the MTP block over rows (tokens[i], hiddens[i]) at positions `state.len()..`.
    /// `hiddens` is `n × H`: the target's final-normed hidden states (or the MTP's own previous
    /// output when drafting further). `hidden` of the result is the post-`mtp.final_norm` vector
    /// of every row, the input of the next draft step.
    pub fn mtp_forward(&self, state: &mut MtpState, tokens: &[u32], hiddens: &[f32], rows: LogitRows) -> Result<ForwardOut, ModelError> {
        let w = self.mtp_weights().ok_or_else(|| ModelError::Invalid("the MTP block is not loaded".into()))?;
        let cfg = self.config();
        let hs = cfg.hidden_size;
        if hiddens.len() != tokens.len() * hs {
            return Err(ModelError::Invalid(format!("{} hidden values for {} MTP rows of {hs}", hiddens.len(), tokens.len())));
        }
        let n = tokens.len();
        if n == 0 {
            return Ok(ForwardOut::default());
        }
        // 1. e = RMSNorm_emb(Embed[x]), g = RMSNorm_hid(h).
        let mut e = self.embed(tokens)?;
        rms_norm_zc(&mut e, &w.norm_emb, cfg.rms_norm_eps);
        let mut g = hiddens.to_vec();
        rms_norm_zc(&mut g, &w.norm_hidden, cfg.rms_norm_eps);
        // 2. u = fc([e ‖ g]): embedding first, hidden second.
        let mut cat = Vec::with_capacity(n * 2 * hs);
        for t in 0..n {
            cat.extend_from_slice(&e[t * hs..(t + 1) * hs]);
            cat.extend_from_slice(&g[t * hs..(t + 1) * hs]);
        }
        let mut u = w.fc.apply(&cat);
        // 3. One full-attention decoder layer with its own cache.
        decoder_layer(cfg, &w.layer, &mut state.layer, &mut u);
        // 4. y = RMSNorm_mtp(u); draft logits through the shared head.
        rms_norm_zc(&mut u, &w.final_norm, cfg.rms_norm_eps);
        let (logits, logit_rows) = self.head(&u, rows);
        Ok(ForwardOut { logits, logit_rows, hidden: u })
    }
}
