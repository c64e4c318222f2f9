//! Whole-model consistency on the tiny random model: however a sequence is fed (one prefill,
//! several chunks, token by token) the logits agree; the MTP block agrees with itself fed
//! incrementally; loading fails loudly on missing or misshapen tensors.

use crate::artifact::Artifact;

use super::testutil::{rel_err, tokens, write_tiny, TinyOpts, HIDDEN, VOCAB};
use super::{LogitRows, Model, ModelError};

const TOL: f32 = 1e-4;

struct Tiny {
    model: Model,
    path: std::path::PathBuf,
}

impl Drop for Tiny {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn tiny(tag: &str, opts: TinyOpts) -> Tiny {
    let path = write_tiny(tag, &opts);
    let art = Artifact::open(&path).expect("open tiny artifact");
    Tiny { model: Model::load(&art, true).expect("load tiny model"), path }
}

fn prefill(m: &Model, toks: &[u32]) -> Vec<f32> {
    let mut st = m.new_state();
    m.forward(&mut st, toks, LogitRows::All, false).unwrap().logits
}

#[test]
fn prefill_then_decode_equals_longer_prefill() {
    let t = tiny("decode", TinyOpts::default());
    let toks = tokens(7, 151);
    let mut st = t.model.new_state();
    let first = t.model.forward(&mut st, &toks[..150], LogitRows::All, false).unwrap();
    let next = t.model.forward(&mut st, &toks[150..], LogitRows::Last, false).unwrap();
    assert_eq!((first.logit_rows, next.logit_rows, st.len()), (150, 1, 151));
    let whole = prefill(&t.model, &toks);
    assert!(rel_err(&next.logits, &whole[150 * VOCAB..]) < TOL, "decode row {}", rel_err(&next.logits, &whole[150 * VOCAB..]));
    // Causality: the first 150 rows do not depend on token 150.
    assert!(rel_err(&first.logits, &whole[..150 * VOCAB]) < TOL);
    // The next token matters (the comparison above is not vacuous).
    let mut other = toks.clone();
    other[150] = (toks[150] + 1) % VOCAB as u32;
    let changed = prefill(&t.model, &other);
    assert!(rel_err(&changed[150 * VOCAB..], &whole[150 * VOCAB..]) > 1e-2);
}

#[test]
fn token_by_token_equals_chunked_prefill() {
    // 150 single-token steps take the GDN recurrence; one 150-token step takes the chunked
    // form across two chunk boundaries.
    let t = tiny("recur", TinyOpts::default());
    let toks = tokens(11, 150);
    let whole = prefill(&t.model, &toks);
    let mut st = t.model.new_state();
    let mut rows = Vec::with_capacity(whole.len());
    for tok in &toks {
        rows.extend(t.model.forward(&mut st, std::slice::from_ref(tok), LogitRows::Last, false).unwrap().logits);
    }
    assert!(rel_err(&rows, &whole) < TOL, "token by token vs prefill {}", rel_err(&rows, &whole));
}

#[test]
fn split_prefill_equals_one_prefill() {
    let t = tiny("split", TinyOpts::default());
    let toks = tokens(13, 150);
    let whole = prefill(&t.model, &toks);
    let mut st = t.model.new_state();
    let mut rows = Vec::new();
    for (a, b) in [(0, 70), (70, 120), (120, 121), (121, 150)] {
        rows.extend(t.model.forward(&mut st, &toks[a..b], LogitRows::All, false).unwrap().logits);
    }
    assert!(rel_err(&rows, &whole) < TOL, "split vs one prefill {}", rel_err(&rows, &whole));
}

#[test]
fn hidden_is_the_head_input() {
    let t = tiny("hidden", TinyOpts::default());
    let toks = tokens(17, 20);
    let mut st = t.model.new_state();
    let out = t.model.forward(&mut st, &toks, LogitRows::Last, true).unwrap();
    assert_eq!(out.hidden.len(), 20 * HIDDEN);
    let (head, rows) = t.model.head(&out.hidden[19 * HIDDEN..], LogitRows::All);
    assert_eq!(rows, 1);
    assert_eq!(head, out.logits);
    let mut st2 = t.model.new_state();
    assert!(t.model.forward(&mut st2, &toks, LogitRows::None, false).unwrap().hidden.is_empty());
}

#[test]
fn mtp_incremental_equals_all_rows() {
    let t = tiny("mtp", TinyOpts::default());
    let m = &t.model;
    let toks = tokens(19, 101);
    let mut st = m.new_state();
    let target = m.forward(&mut st, &toks[..100], LogitRows::None, true).unwrap();
    // Row p pairs the hidden state of position p with token p + 1 (model-spec.md §3.2).
    let draft_ids = &toks[1..101];
    let mut all = m.new_mtp_state().expect("MTP loaded");
    let once = m.mtp_forward(&mut all, draft_ids, &target.hidden, LogitRows::All).unwrap();
    assert_eq!((once.logit_rows, all.len()), (100, 100));

    let mut inc = m.new_mtp_state().unwrap();
    let mut logits = Vec::new();
    let mut hidden = Vec::new();
    for (a, b) in [(0, 64), (64, 65), (65, 66), (66, 100)] {
        let o = m.mtp_forward(&mut inc, &draft_ids[a..b], &target.hidden[a * HIDDEN..b * HIDDEN], LogitRows::All).unwrap();
        logits.extend(o.logits);
        hidden.extend(o.hidden);
    }
    assert!(rel_err(&logits, &once.logits) < TOL, "MTP logits {}", rel_err(&logits, &once.logits));
    assert!(rel_err(&hidden, &once.hidden) < TOL);

    // Rolling back rejected rows and re-running them gives the same rows again.
    inc.truncate(90);
    let redo = m.mtp_forward(&mut inc, &draft_ids[90..], &target.hidden[90 * HIDDEN..], LogitRows::All).unwrap();
    assert!(rel_err(&redo.logits, &once.logits[90 * VOCAB..]) < TOL);

    // The hidden input matters, so does the MTP's own cache (position and history).
    let mut fresh = m.new_mtp_state().unwrap();
    let alone = m.mtp_forward(&mut fresh, &draft_ids[99..], &target.hidden[99 * HIDDEN..], LogitRows::Last).unwrap();
    assert!(rel_err(&alone.logits, &once.logits[99 * VOCAB..]) > 1e-3);
    let mut fresh2 = m.new_mtp_state().unwrap();
    let zero = vec![0.0; HIDDEN];
    let no_hidden = m.mtp_forward(&mut fresh2, &draft_ids[..1], &zero, LogitRows::Last).unwrap();
    assert!(rel_err(&no_hidden.logits, &once.logits[..VOCAB]) > 1e-3);
}

#[test]
fn no_shared_expert_loads_and_runs() {
    let with = tiny("shared", TinyOpts::default());
    let without = tiny("noshared", TinyOpts { shared: 0, mtp: false, ..TinyOpts::default() });
    assert!(without.model.weights().layers.iter().all(|l| l.moe.shared.is_none()));
    assert!(with.model.weights().layers.iter().all(|l| l.moe.shared.is_some()));
    assert!(!without.model.has_mtp() && without.model.new_mtp_state().is_none());
    let toks = tokens(23, 80);
    let whole = prefill(&without.model, &toks);
    assert!(whole.iter().all(|v| v.is_finite()));
    let mut st = without.model.new_state();
    let mut rows = without.model.forward(&mut st, &toks[..79], LogitRows::All, false).unwrap().logits;
    rows.extend(without.model.forward(&mut st, &toks[79..], LogitRows::Last, false).unwrap().logits);
    assert!(rel_err(&rows, &whole) < TOL);
}

#[test]
fn mtp_is_loaded_only_when_asked() {
    let path = write_tiny("mtpopt", &TinyOpts::default());
    let art = Artifact::open(&path).unwrap();
    assert!(!Model::load(&art, false).unwrap().has_mtp());
    assert!(Model::load(&art, true).unwrap().has_mtp());
    std::fs::remove_file(&path).unwrap();
    // Without the component, asking for it loads none (and reads no mtp.* tensor).
    let path = write_tiny("nomtp", &TinyOpts { mtp: false, ..TinyOpts::default() });
    let art = Artifact::open(&path).unwrap();
    assert!(!Model::load(&art, true).unwrap().has_mtp());
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn load_errors_name_the_tensor() {
    let path = write_tiny("missing", &TinyOpts { omit: Some("layers.3.attn.k_norm"), ..TinyOpts::default() });
    let err = Model::load(&Artifact::open(&path).unwrap(), false).err().expect("missing tensor must fail");
    assert!(err.to_string().contains("layers.3.attn.k_norm"), "{err}");
    std::fs::remove_file(&path).unwrap();

    let path = write_tiny("shape", &TinyOpts { misshape: Some("layers.1.gdn.z"), ..TinyOpts::default() });
    match Model::load(&Artifact::open(&path).unwrap(), false) {
        Err(ModelError::Shape { name, expected, .. }) => assert_eq!((name.as_str(), expected), ("layers.1.gdn.z", vec![64, 64])),
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("misshapen tensor must fail"),
    }
    std::fs::remove_file(&path).unwrap();
}
