//! The MTP block on the GPU (model-spec.md §3): the target's final-normed hidden states that it
//! reads, and its own passes over (token, hidden) rows, with the same inherent methods as the
//! CPU backend so that a speculation loop drives either.
//!
//! The MTP layer's KV cache is one more attention layer in the shared pool (memory.rs), in the
//! same pages as the slot's target sequence: MTP row p sits at position p, so a slot holds pages
//! for the longer of its sequence and its MTP rows (drafts run ahead of the target by a few).

use half::bf16;
use ninfer_kernels::cudarc::driver::CudaSlice;
use ninfer_kernels::Rows;

use super::forward::{final_norm, heads, layer, linear, upload_tables, Ctx, Fetch, Tables};
use super::memory::{States, Workspace, PAGE};
use super::plan::{pass_meta, split_passes, PassMeta};
use super::weights::MtpW;
use super::{drv, kern, BackendError, CudaBackend, RowLogits, RowOutput, SlotId, StepInput};

/// The final-normed hidden states of a pass's `t` rows (left in `ws.a` by its final norm), as
/// f32 on the host.
pub(super) fn fetch_hidden(cx: &Ctx, ws: &Workspace, t: usize) -> Result<Vec<f32>, BackendError> {
    let mut host = vec![bf16::ZERO; t * cx.dims.h];
    cx.s.memcpy_dtoh(&ws.a.slice(..t * cx.dims.h), &mut host).map_err(drv("copying hidden states back"))?;
    cx.s.synchronize().map_err(drv("copying hidden states back"))?;
    Ok(host.into_iter().map(f32::from).collect())
}

/// Every launch of an MTP pass over `meta`'s rows, whose target hidden states (bf16 `[T, H]`)
/// are already in `ws.delta`, up to `mtp.final_norm` into `ws.a`.
fn mtp_body(cx: &Ctx, w: &MtpW, st: &mut States, ws: &mut Workspace, tables: &CudaSlice<i32>, meta: &PassMeta) -> Result<(), BackendError> {
    let (t, h) = (meta.tokens, cx.dims.h);
    let eps = cx.cfg.rms_norm_eps;
    let tb = Tables::of(tables, meta);
    let (dense, half) = (Rows::dense(t, h), Rows { rows: t, dim: h, ld: 2 * h });
    // 1. [e ‖ g] with e = RMSNorm_emb(Embed[x]) and g = RMSNorm_hid(hidden), side by side in proj.
    cx.ks.embed(cx.s, &cx.arena.mat(&cx.model.embed), &tb.ids, t, &mut ws.h, h).map_err(kern)?;
    cx.ks.rms_norm(cx.s, &ws.h, dense, &cx.arena.bf16(w.norm_emb), &mut ws.proj, half, eps).map_err(kern)?;
    cx.ks.rms_norm(cx.s, &ws.delta, dense, &cx.arena.bf16(w.norm_hidden), &mut ws.proj.slice_mut(h..), half, eps).map_err(kern)?;
    cx.mark("mtp.norms", 0);
    // 2. u = fc([e ‖ g]), the residual stream of the MTP layer.
    linear(cx, "mtp.fc", &w.fc, ws.proj.as_view(), t, 2 * h, ws.h.as_view_mut(), h)?;
    // 3. One full-attention decoder layer on the KV cache after the model's.
    layer(cx, &w.layer, st, ws, &tb, cx.dims.attn_layers)?;
    // 4. The draft's hidden state, read by the shared head.
    final_norm(cx, ws, t, w.final_norm)
}

impl CudaBackend {
    /// Whether [`mtp_step`](Self::mtp_step) is available.
    pub fn has_mtp(&self) -> bool {
        self.model.mtp.is_some()
    }

    /// Like [`Backend::step`](crate::backend::Backend::step), and also returns each row's
    /// final-normed hidden states (the MTP input), as bf16 values in f32.
    pub fn step_with_hidden(&mut self, rows: &[StepInput<'_>]) -> Result<Vec<RowOutput>, BackendError> {
        let mut hidden = vec![Vec::new(); rows.len()];
        let logits = self.run_step(rows, None, Some(&mut hidden))?;
        Ok(logits.into_iter().zip(hidden).map(|(logits, hidden)| RowOutput { logits, hidden }).collect())
    }

    /// Rows in the slot's MTP cache.
    pub fn mtp_len(&self, slot: SlotId) -> Result<usize, BackendError> {
        self.len_of(slot)?;
        if self.model.mtp.is_none() {
            return Err(BackendError::Model("the MTP block is not loaded".into()));
        }
        Ok(self.mtp_lens[slot.0 as usize])
    }

    /// Drops the slot's MTP rows from `len` on (rejected drafts); their pages stay with the slot.
    pub fn mtp_truncate(&mut self, slot: SlotId, len: usize) -> Result<(), BackendError> {
        let have = self.mtp_len(slot)?;
        self.mtp_lens[slot.0 as usize] = have.min(len);
        Ok(())
    }

    /// MTP rows (tokens[i], hiddens[i]) continuing the slot's MTP cache at positions
    /// `mtp_len(slot)..` (model-spec.md §3.2: token p+1 with the target hidden of p at position
    /// p). `hiddens` is `tokens × H`. Returns the draft logits (last row, or all rows) and the
    /// post-`mtp.final_norm` vector of every row (the hidden input of a further draft).
    pub fn mtp_step(&mut self, slot: SlotId, tokens: &[u32], hiddens: &[f32], all_logits: bool) -> Result<RowOutput, BackendError> {
        let have = self.mtp_len(slot)?;
        let (h, v, n) = (self.dims.h, self.config.vocab_size, tokens.len());
        if hiddens.len() != n * h {
            return Err(BackendError::Model(format!("{} hidden values for {n} MTP rows of {h}", hiddens.len())));
        }
        let spec = self.row_spec(slot, have, tokens, all_logits)?;
        self.check_pages(&[spec])?;
        self.take_pages(&[spec]);
        let w = self.model.mtp.as_ref().expect("mtp_len checked the block");
        let cx = Ctx { ks: &self.ks, s: &self.stream, cfg: &self.config, dims: &self.dims, model: &self.model, arena: &self.arena, prof: None };
        let cap = self.dims.meta();
        let mut out = RowOutput { logits: RowLogits { rows: 0, values: Vec::new(), token: None }, hidden: Vec::with_capacity(n * h) };
        for pass in split_passes(&[spec], self.dims.t_cap) {
            let seg = &pass.segs[0];
            let meta = pass_meta(&cap, PAGE, &pass, None, |s| &tokens[s.tok0..s.tok0 + s.n], |s| &self.slot_pages[s as usize]);
            let rows: Vec<bf16> = hiddens[seg.tok0 * h..(seg.tok0 + seg.n) * h].iter().map(|&x| bf16::from_f32(x)).collect();
            cx.s.memcpy_htod(&rows, &mut self.ws.delta.slice_mut(..rows.len())).map_err(drv("uploading MTP hidden states"))?;
            upload_tables(&cx, &mut self.tables, &meta)?;
            mtp_body(&cx, w, &mut self.states, &mut self.ws, &self.tables, &meta)?;
            let k = meta.logit_rows.len();
            let mut logits = vec![0f32; k * v];
            heads(&cx, &mut self.ws, &self.tables, &meta, &mut Fetch::Logits(&mut logits))?;
            out.hidden.extend(fetch_hidden(&cx, &self.ws, meta.tokens)?);
            out.logits.values.extend(logits);
            out.logits.rows += k;
        }
        self.mtp_lens[slot.0 as usize] = have + n;
        Ok(out)
    }
}
