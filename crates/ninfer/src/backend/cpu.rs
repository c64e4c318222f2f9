//! The CPU reference backend (DESIGN.md §5): the f32 [`Model`] plus sequence slots. Each row of
//! a step continues its slot's sequence; rows are processed one after the other. MTP drafting
//! (model-spec.md §3) goes through the inherent [`CpuBackend::mtp_step`].
//!
//! KV accounting: the CPU backend's KV is per-slot growable vectors; pages are its unit of
//! accounting so that the runtime treats both backends alike. A slot of `len` tokens holds
//! `ceil(len / PAGE)` pages of a pool of `ceil(kv_capacity / PAGE)`; a step that would need more
//! pages than are free fails with `KvFull` before anything changes.

use crate::artifact::Artifact;
use crate::model::{ForwardOut, LogitRows, Model, ModelConfig, ModelError, MtpState, SeqState};

use super::{Backend, BackendError, KvPool, RowLogits, RowOutput, SlotId, StepInput};

/// Positions per KV page. Only an accounting unit here (see the module comment); small so that
/// rounding wastes little of a small pool in tests.
pub const PAGE: usize = 16;

#[derive(Debug, Clone)]
pub struct CpuOptions {
    /// Sequences that can be alive at once.
    pub max_slots: usize,
    /// Tokens per sequence (also capped by the model's `max_position_embeddings`).
    pub max_context: usize,
    /// Load the MTP block, if the artifact has the `mtp` component.
    pub mtp: bool,
    /// Positions of KV all slots share (rounded up to pages); None: every slot can reach
    /// `max_context` (`max_slots × max_context`).
    pub kv_capacity: Option<usize>,
}

impl Default for CpuOptions {
    fn default() -> Self {
        CpuOptions { max_slots: 4, max_context: 4096, mtp: false, kv_capacity: None }
    }
}

struct Slot {
    seq: SeqState,
    mtp: Option<MtpState>,
}

pub struct CpuBackend {
    model: Model,
    slots: Vec<Option<Slot>>,
    max_context: usize,
    kv_pages: usize,
}

fn model_err(e: ModelError) -> BackendError {
    match e {
        ModelError::Artifact(a) => BackendError::Artifact(a),
        other => BackendError::Model(other.to_string()),
    }
}

fn row_logits(out: &ForwardOut) -> RowLogits {
    RowLogits { rows: out.logit_rows, values: out.logits.clone(), token: None }
}

impl CpuBackend {
    pub fn open(art: &Artifact, opts: CpuOptions) -> Result<Self, BackendError> {
        let model = Model::load(art, opts.mtp).map_err(model_err)?;
        let max_context = opts.max_context.min(model.config().max_position_embeddings);
        let kv_pages = opts.kv_capacity.unwrap_or(opts.max_slots * max_context).div_ceil(PAGE);
        if kv_pages == 0 {
            return Err(BackendError::Model("the KV capacity must be at least one token".into()));
        }
        Ok(CpuBackend { model, slots: (0..opts.max_slots).map(|_| None).collect(), max_context, kv_pages })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Whether [`mtp_step`](Self::mtp_step) is available.
    pub fn has_mtp(&self) -> bool {
        self.model.has_mtp()
    }

    pub fn max_context(&self) -> usize {
        self.max_context
    }

    fn slot(&self, id: SlotId) -> Result<&Slot, BackendError> {
        self.slots.get(id.0 as usize).and_then(|s| s.as_ref()).ok_or(BackendError::BadSlot(id))
    }

    fn slot_mut(&mut self, id: SlotId) -> Result<&mut Slot, BackendError> {
        self.slots.get_mut(id.0 as usize).and_then(|s| s.as_mut()).ok_or(BackendError::BadSlot(id))
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<(), BackendError> {
        let vocab = self.model.config().vocab_size;
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(&id) => Err(BackendError::BadToken { id, vocab }),
            None => Ok(()),
        }
    }

    /// Pages held by the live slots (the target sequences; the MTP cache of a slot follows its
    /// sequence, so it is not counted separately).
    fn used_pages(&self) -> usize {
        self.slots.iter().flatten().map(|s| s.seq.len().div_ceil(PAGE)).sum()
    }

    fn check_room(&self, have: usize, add: usize) -> Result<(), BackendError> {
        if have + add > self.max_context {
            return Err(BackendError::ContextFull { max: self.max_context, needed: have + add });
        }
        Ok(())
    }

    /// Like [`Backend::step`], and also returns each row's final-normed hidden states (the MTP
    /// input). Every row is validated before any state changes.
    pub fn step_with_hidden(&mut self, rows: &[StepInput<'_>]) -> Result<Vec<RowOutput>, BackendError> {
        self.step_rows(rows, true)
    }

    fn step_rows(&mut self, rows: &[StepInput<'_>], want_hidden: bool) -> Result<Vec<RowOutput>, BackendError> {
        // Pages the rows add; a slot appears once per step, so the rows' growth simply adds up.
        let mut needed = 0;
        for (i, r) in rows.iter().enumerate() {
            let have = self.slot(r.slot)?.seq.len();
            if rows[..i].iter().any(|o| o.slot == r.slot) {
                return Err(BackendError::Model(format!("slot {:?} appears twice in one step", r.slot)));
            }
            self.check_tokens(r.tokens)?;
            self.check_room(have, r.tokens.len())?;
            needed += (have + r.tokens.len()).div_ceil(PAGE) - have.div_ceil(PAGE);
        }
        let free = self.kv_pages - self.used_pages();
        if needed > free {
            return Err(BackendError::KvFull { needed, free, total: self.kv_pages });
        }
        let mut outs = Vec::with_capacity(rows.len());
        for r in rows {
            let which = if r.all_logits { LogitRows::All } else { LogitRows::Last };
            let slot = self.slots[r.slot.0 as usize].as_mut().ok_or(BackendError::BadSlot(r.slot))?;
            let out = self.model.forward(&mut slot.seq, r.tokens, which, want_hidden).map_err(model_err)?;
            outs.push(RowOutput { logits: row_logits(&out), hidden: out.hidden });
        }
        Ok(outs)
    }

    /// MTP rows (tokens[i], hiddens[i]) continuing the slot's MTP cache at positions
    /// `mtp_len(slot)..` (model-spec.md §3.2 pairing: token p+1 with the target hidden of p at
    /// position p). `hiddens` is `tokens × H`. Returns the draft logits (last row, or all rows)
    /// and the post-`mtp.final_norm` vector of every row (the hidden input of a further draft).
    pub fn mtp_step(&mut self, slot: SlotId, tokens: &[u32], hiddens: &[f32], all_logits: bool) -> Result<RowOutput, BackendError> {
        if !self.model.has_mtp() {
            return Err(BackendError::Model("the MTP block is not loaded".into()));
        }
        self.check_tokens(tokens)?;
        let have = self.mtp_len(slot)?;
        self.check_room(have, tokens.len())?;
        let which = if all_logits { LogitRows::All } else { LogitRows::Last };
        let model = &self.model;
        let st = self.slots[slot.0 as usize].as_mut().and_then(|s| s.mtp.as_mut()).ok_or(BackendError::BadSlot(slot))?;
        let out = model.mtp_forward(st, tokens, hiddens, which).map_err(model_err)?;
        Ok(RowOutput { logits: row_logits(&out), hidden: out.hidden })
    }

    /// Rows in the slot's MTP cache.
    pub fn mtp_len(&self, slot: SlotId) -> Result<usize, BackendError> {
        let s = self.slot(slot)?;
        s.mtp.as_ref().map(|m| m.len()).ok_or_else(|| BackendError::Model("the MTP block is not loaded".into()))
    }

    /// Drops the slot's MTP rows from `len` on (rejected drafts).
    pub fn mtp_truncate(&mut self, slot: SlotId, len: usize) -> Result<(), BackendError> {
        let s = self.slot_mut(slot)?;
        s.mtp.as_mut().ok_or_else(|| BackendError::Model("the MTP block is not loaded".into()))?.truncate(len);
        Ok(())
    }
}

impl Backend for CpuBackend {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn name(&self) -> String {
        "cpu".into()
    }

    fn alloc_slot(&mut self) -> Result<SlotId, BackendError> {
        let free = self.slots.iter().position(|s| s.is_none()).ok_or(BackendError::NoFreeSlot(self.slots.len()))?;
        self.slots[free] = Some(Slot { seq: self.model.new_state(), mtp: self.model.new_mtp_state() });
        Ok(SlotId(free as u32))
    }

    fn free_slot(&mut self, slot: SlotId) {
        if let Some(s) = self.slots.get_mut(slot.0 as usize) {
            *s = None;
        }
    }

    fn slot_len(&self, slot: SlotId) -> Result<usize, BackendError> {
        Ok(self.slot(slot)?.seq.len())
    }

    fn kv_pool(&self) -> KvPool {
        KvPool { page_size: PAGE, pages: self.kv_pages, used: self.used_pages() }
    }

    fn step(&mut self, rows: &[StepInput<'_>]) -> Result<Vec<RowLogits>, BackendError> {
        Ok(self.step_rows(rows, false)?.into_iter().map(|r| r.logits).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Pick;
    use crate::model::testutil::{tokens, write_tiny, TinyOpts, HIDDEN, VOCAB};

    fn open(tag: &str, opts: CpuOptions, tiny: TinyOpts) -> CpuBackend {
        let path = write_tiny(tag, &tiny);
        let be = CpuBackend::open(&Artifact::open(&path).unwrap(), opts).unwrap();
        std::fs::remove_file(&path).unwrap();
        be
    }

    fn row<'a>(slot: SlotId, tokens: &'a [u32], all_logits: bool) -> StepInput<'a> {
        StepInput { slot, tokens, all_logits, pick: Pick::Logits }
    }

    #[test]
    fn slots_are_allocated_freed_and_reset() {
        let mut be = open("slots", CpuOptions { max_slots: 2, ..CpuOptions::default() }, TinyOpts::default());
        assert_eq!(be.name(), "cpu");
        let a = be.alloc_slot().unwrap();
        let b = be.alloc_slot().unwrap();
        assert_ne!(a, b);
        assert!(matches!(be.alloc_slot(), Err(BackendError::NoFreeSlot(2))));
        let toks = tokens(3, 12);
        let first = be.step(&[row(a, &toks, false)]).unwrap();
        assert_eq!(be.slot_len(a).unwrap(), 12);
        be.free_slot(a);
        assert!(matches!(be.slot_len(a), Err(BackendError::BadSlot(_))));
        assert!(matches!(be.step(&[row(a, &toks, false)]), Err(BackendError::BadSlot(_))));
        // A reused slot starts empty: the same prompt gives the same logits.
        let c = be.alloc_slot().unwrap();
        assert_eq!(be.slot_len(c).unwrap(), 0);
        let again = be.step(&[row(c, &toks, false)]).unwrap();
        assert_eq!(again[0].values, first[0].values);
    }

    #[test]
    fn rows_of_one_step_equal_separate_steps() {
        let mut be = open("rows", CpuOptions::default(), TinyOpts::default());
        let (a, b) = (be.alloc_slot().unwrap(), be.alloc_slot().unwrap());
        let (ta, tb) = (tokens(5, 30), tokens(6, 17));
        let both = be.step(&[row(a, &ta, true), row(b, &tb, false)]).unwrap();
        assert_eq!((both[0].rows, both[0].values.len(), both[1].rows), (30, 30 * VOCAB, 1));
        let (c, d) = (be.alloc_slot().unwrap(), be.alloc_slot().unwrap());
        let sa = be.step(&[row(c, &ta, true)]).unwrap();
        let sb = be.step(&[row(d, &tb, false)]).unwrap();
        assert_eq!(both[0].values, sa[0].values);
        assert_eq!(both[1].values, sb[0].values);
        // A decode round over both slots continues each sequence.
        let next = be.step(&[row(a, &ta[..1], false), row(b, &tb[..1], false)]).unwrap();
        assert_eq!((be.slot_len(a).unwrap(), be.slot_len(b).unwrap()), (31, 18));
        assert_ne!(next[0].values, next[1].values);
        // An empty row is a no-op with no logits.
        let empty = be.step(&[row(a, &[], true)]).unwrap();
        assert_eq!((empty[0].rows, empty[0].values.len(), be.slot_len(a).unwrap()), (0, 0, 31));
    }

    #[test]
    fn bad_rows_fail_before_any_state_changes() {
        let mut be = open("errors", CpuOptions { max_context: 20, ..CpuOptions::default() }, TinyOpts::default());
        assert_eq!(be.max_context(), 20);
        let a = be.alloc_slot().unwrap();
        let b = be.alloc_slot().unwrap();
        let good = tokens(8, 10);
        let bad = [3, VOCAB as u32];
        assert!(matches!(be.step(&[row(a, &good, false), row(b, &bad, false)]), Err(BackendError::BadToken { id, vocab }) if id == VOCAB as u32 && vocab == VOCAB));
        assert_eq!(be.slot_len(a).unwrap(), 0, "the valid row before the bad one did not run");
        assert!(matches!(be.step(&[row(a, &good, false), row(a, &good, false)]), Err(BackendError::Model(_))));
        be.step(&[row(a, &good, false)]).unwrap();
        let long = tokens(9, 11);
        assert!(matches!(be.step(&[row(a, &long, false)]), Err(BackendError::ContextFull { max: 20, needed: 21 })));
        assert_eq!(be.slot_len(a).unwrap(), 10);
        be.step(&[row(a, &long[..10], false)]).unwrap();
        assert_eq!(be.slot_len(a).unwrap(), 20);
    }

    #[test]
    fn kv_pages_follow_the_sequences_and_bound_the_steps() {
        // Auto: every slot can reach the full context.
        let auto = open("kv-auto", CpuOptions { max_slots: 3, max_context: 100, ..CpuOptions::default() }, TinyOpts::default());
        assert_eq!(auto.kv_pool(), KvPool { page_size: PAGE, pages: 300usize.div_ceil(PAGE), used: 0 });
        // 40 positions round up to 3 pages of 16.
        let mut be = open("kv-pool", CpuOptions { kv_capacity: Some(40), ..CpuOptions::default() }, TinyOpts::default());
        assert_eq!((be.kv_pool().pages, be.kv_pool().capacity()), (3, 48));
        let (a, b) = (be.alloc_slot().unwrap(), be.alloc_slot().unwrap());
        be.step(&[row(a, &tokens(1, 20), false)]).unwrap();
        assert_eq!(be.kv_pool().used, 2);
        // 17 tokens need 2 pages, 1 is free: refused, and the valid row next to it did not run.
        let (tb, ta) = (tokens(2, 17), tokens(3, 4));
        let err = be.step(&[row(a, &ta, false), row(b, &tb, false)]).unwrap_err();
        assert!(matches!(err, BackendError::KvFull { needed: 2, free: 1, total: 3 }), "{err}");
        assert_eq!((be.slot_len(a).unwrap(), be.slot_len(b).unwrap(), be.kv_pool().used), (20, 0, 2));
        // Growing within a held page takes nothing more; crossing into the last page takes it.
        be.step(&[row(a, &ta, false)]).unwrap();
        assert_eq!(be.kv_pool().used, 2);
        be.step(&[row(b, &tb[..9], false)]).unwrap();
        assert_eq!(be.kv_pool().used, 3);
        assert!(matches!(be.step(&[row(b, &tb[9..], false)]), Err(BackendError::KvFull { needed: 1, free: 0, total: 3 })));
        // Freeing a slot gives its pages back.
        be.free_slot(a);
        assert_eq!(be.kv_pool().used, 1);
        be.step(&[row(b, &tb[9..], false)]).unwrap();
        assert_eq!((be.slot_len(b).unwrap(), be.kv_pool().used), (17, 2));
        be.free_slot(b);
        assert_eq!(be.kv_pool().used, 0);
        let zero = write_tiny("kv-zero", &TinyOpts::default());
        let refused = CpuBackend::open(&Artifact::open(&zero).unwrap(), CpuOptions { kv_capacity: Some(0), ..CpuOptions::default() });
        std::fs::remove_file(&zero).unwrap();
        assert!(matches!(refused, Err(BackendError::Model(_))));
    }

    #[test]
    fn mtp_step_drafts_from_target_hidden_states() {
        let mut be = open("mtpstep", CpuOptions { mtp: true, ..CpuOptions::default() }, TinyOpts::default());
        assert!(be.has_mtp());
        let s = be.alloc_slot().unwrap();
        let toks = tokens(10, 40);
        let out = be.step_with_hidden(&[row(s, &toks, false)]).unwrap().remove(0);
        assert_eq!(out.hidden.len(), 40 * HIDDEN);
        // Sampled token x_40 = argmax; MTP rows pair token p+1 with hidden p (model-spec.md §3.2).
        let x40 = out.logits.values.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
        let mut ids = toks[1..].to_vec();
        ids.push(x40);
        let d1 = be.mtp_step(s, &ids, &out.hidden, false).unwrap();
        assert_eq!((d1.logits.rows, d1.hidden.len(), be.mtp_len(s).unwrap()), (1, 40 * HIDDEN, 40));
        // A further draft feeds the MTP's own last output back at the next position.
        let draft = d1.logits.values.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
        let d2 = be.mtp_step(s, &[draft], &d1.hidden[39 * HIDDEN..], false).unwrap();
        assert_eq!(be.mtp_len(s).unwrap(), 41);
        // Rolling the draft row back and redoing it reproduces it exactly.
        be.mtp_truncate(s, 40).unwrap();
        let again = be.mtp_step(s, &[draft], &d1.hidden[39 * HIDDEN..], false).unwrap();
        assert_eq!(again.logits.values, d2.logits.values);
        assert!(matches!(be.mtp_step(s, &[draft], &d1.hidden[..HIDDEN - 1], false), Err(BackendError::Model(_))));

        let mut plain = open("nomtpstep", CpuOptions::default(), TinyOpts::default());
        let p = plain.alloc_slot().unwrap();
        assert!(!plain.has_mtp());
        assert!(matches!(plain.mtp_step(p, &[1], &vec![0.0; HIDDEN], false), Err(BackendError::Model(_))));
    }
}
