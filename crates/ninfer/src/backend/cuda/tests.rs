//! The CUDA backend on the tiny test model, on a real GPU: against the CPU reference, and
//! against itself across pass splits, batching and slot reuse. Each test returns early, passing,
//! on a machine without a supported GPU; scripts/gpu_test.sh runs them where there is one.
//!
//! The GPU keeps activations in bf16 and the reference in f32, so the two differ by bf16 noise:
//! around 1% of the logit norm on a typical row, more on a row where two experts' router logits
//! are closer than a bf16 step and the top-k choice flips. Reference comparisons therefore bound
//! the median and the 90th percentile of the row errors. Splitting a prompt into passes or
//! batching rows does not change any row's arithmetic, so those comparisons are tight.

use super::*;
use ninfer_kernels::GDN_CHUNK;
use crate::backend::cpu::{CpuBackend, CpuOptions};
use crate::model::testutil::{tokens, write_tiny, TinyOpts, VOCAB};

/// Median and 90th-percentile row errors against the CPU reference.
const MEDIAN_TOL: f32 = 5e-2;
const P90_TOL: f32 = 0.2;
/// Same-backend comparisons (pass splits, batching).
const SELF_TOL: f32 = 1e-2;

/// ‖got − want‖ / ‖want‖ of every row of `VOCAB` logits.
fn row_errs(got: &[f32], want: &[f32]) -> Vec<f32> {
    errs_of(got, want, VOCAB)
}

/// ‖got − want‖ / ‖want‖ of every row of `width` values.
fn errs_of(got: &[f32], want: &[f32], width: usize) -> Vec<f32> {
    assert_eq!(got.len(), want.len(), "value counts differ");
    got.chunks_exact(width)
        .zip(want.chunks_exact(width))
        .map(|(g, w)| {
            let num: f32 = g.iter().zip(w).map(|(a, b)| (a - b) * (a - b)).sum();
            let den: f32 = w.iter().map(|b| b * b).sum();
            (num / den).sqrt()
        })
        .collect()
}

fn quantile(errs: &[f32], q: f64) -> f32 {
    let mut e = errs.to_vec();
    e.sort_by(f32::total_cmp);
    e[((e.len() - 1) as f64 * q).round() as usize]
}

fn worst(errs: &[f32]) -> f32 {
    errs.iter().copied().fold(0.0, f32::max)
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as u32).unwrap_or(0)
}

fn gpu_present() -> bool {
    let ok = supported_gpu().is_some();
    if !ok {
        println!("no supported GPU: skipping");
    }
    ok
}

fn artifact(tag: &str, shared: usize) -> Artifact {
    let path = write_tiny(tag, &TinyOpts { shared, mtp: false, ..TinyOpts::default() });
    let art = Artifact::open(&path).unwrap();
    // The mapping stays valid after the name is removed.
    std::fs::remove_file(&path).unwrap();
    art
}

fn row<'a>(slot: SlotId, tokens: &'a [u32], all_logits: bool) -> StepInput<'a> {
    StepInput { slot, tokens, all_logits, pick: Pick::Logits }
}

#[test]
fn follows_the_cpu_reference() {
    if !gpu_present() {
        return;
    }
    // Shared expert fused with the banks (same width), none, and one of another width.
    for shared in [32, 0, 16] {
        let art = artifact(&format!("cuda-ref{shared}"), shared);
        let mut cpu = CpuBackend::open(&art, CpuOptions { max_slots: 1, max_context: 256, mtp: false, kv_capacity: None }).unwrap();
        let opts = CudaOptions { max_slots: 1, max_context: 256, max_step_tokens: 16, ..CudaOptions::default() };
        let mut gpu = CudaBackend::open(&art, opts).unwrap();
        assert!(gpu.name().starts_with("cuda:0 "), "{}", gpu.name());
        let (c, g) = (cpu.alloc_slot().unwrap(), gpu.alloc_slot().unwrap());
        // 40 tokens run as three passes of at most 16, logits at every position; then decode
        // steps on the reference's greedy tokens.
        let prompt = tokens(21, 40);
        let want = cpu.step(&[row(c, &prompt, true)]).unwrap().remove(0);
        let got = gpu.step(&[row(g, &prompt, true)]).unwrap().remove(0);
        assert_eq!((got.rows, want.rows), (40, 40));
        let mut errs = row_errs(&got.values, &want.values);
        let mut next = argmax(&want.values[39 * VOCAB..]);
        for _ in 0..8 {
            let want = cpu.step(&[row(c, &[next], false)]).unwrap().remove(0);
            let got = gpu.step(&[row(g, &[next], false)]).unwrap().remove(0);
            errs.extend(row_errs(&got.values, &want.values));
            next = argmax(&want.values);
        }
        let (med, p90) = (quantile(&errs, 0.5), quantile(&errs, 0.9));
        println!("shared {shared}: row errors median {med:.2e}, p90 {p90:.2e}, max {:.2e}", worst(&errs));
        assert!(med < MEDIAN_TOL && p90 < P90_TOL, "shared {shared}: median {med:.2e}, p90 {p90:.2e}");
        assert_eq!(gpu.slot_len(g).unwrap(), 48);
    }
}

#[test]
fn passes_and_batching_leave_rows_unchanged() {
    if !gpu_present() {
        return;
    }
    let art = artifact("cuda-self", 32);
    // Passes cut at multiples of the GDN chunk (32 tokens), so that the chunked recurrence sums
    // the same tokens together on both sides (kernels/gdn.cu).
    let small = CudaOptions { max_slots: 3, max_context: 300, max_step_tokens: GDN_CHUNK, ..CudaOptions::default() };
    let mut a = CudaBackend::open(&art, small).unwrap();
    let mut b = CudaBackend::open(&art, CudaOptions { max_step_tokens: 256, ..small }).unwrap();
    let (pa, pb, pc) = (tokens(31, 70), tokens(32, 9), tokens(33, 30));

    // One 70-token prompt: three passes on `a`, one pass on `b`.
    let (sa, sb) = (a.alloc_slot().unwrap(), b.alloc_slot().unwrap());
    let split = a.step(&[row(sa, &pa, true)]).unwrap().remove(0);
    let whole = b.step(&[row(sb, &pa, true)]).unwrap().remove(0);
    let e = worst(&row_errs(&split.values, &whole.values));
    assert!(e < SELF_TOL, "prompt in passes vs one pass: {e:.2e}");

    // A step mixing a decode row, a new prompt and another decode row on `a` equals the same
    // rows run one by one on `b`.
    let (ta, tb2) = (a.alloc_slot().unwrap(), b.alloc_slot().unwrap());
    a.step(&[row(ta, &pb, false)]).unwrap();
    b.step(&[row(tb2, &pb, false)]).unwrap();
    let (ua, ub) = (a.alloc_slot().unwrap(), b.alloc_slot().unwrap());
    let (d1, d2) = ([argmax(&split.values[69 * VOCAB..])], [5u32]);
    let mixed = a.step(&[row(sa, &d1, false), row(ua, &pc, true), row(ta, &d2, false)]).unwrap();
    assert_eq!(mixed.iter().map(|r| r.rows).collect::<Vec<_>>(), vec![1, 30, 1]);
    let alone = [
        b.step(&[row(sb, &d1, false)]).unwrap().remove(0),
        b.step(&[row(ub, &pc, true)]).unwrap().remove(0),
        b.step(&[row(tb2, &d2, false)]).unwrap().remove(0),
    ];
    for (i, (m, s)) in mixed.iter().zip(&alone).enumerate() {
        let e = worst(&row_errs(&m.values, &s.values));
        assert!(e < SELF_TOL, "row {i} of the mixed step vs alone: {e:.2e}");
    }
    assert_eq!((a.slot_len(sa).unwrap(), a.slot_len(ua).unwrap(), a.slot_len(ta).unwrap()), (71, 30, 10));

    // A decode step equals the last row of the longer prefill (in a freed and reused slot).
    b.free_slot(ub);
    let v = b.alloc_slot().unwrap();
    let longer: Vec<u32> = pa.iter().copied().chain(d1).collect();
    let full = b.step(&[row(v, &longer, false)]).unwrap().remove(0);
    let e = worst(&row_errs(&mixed[0].values, &full.values));
    assert!(e < SELF_TOL, "decode vs longer prefill: {e:.2e}");
}

#[test]
fn decode_batches_equal_their_rows_alone() {
    if !gpu_present() {
        return;
    }
    // Decode steps of 2-16 sequences norm their rows inside the products and run the GDN conv
    // in the input projection's epilogue (forward.rs); each row must match the same sequence
    // decoded alone, step after step (the conv and recurrent states moved on per row).
    let art = artifact("cuda-decode-batch", 32);
    let opts = CudaOptions { max_slots: 16, max_context: 64, max_step_tokens: 64, ..CudaOptions::default() };
    let mut a = CudaBackend::open(&art, opts).unwrap();
    let mut b = CudaBackend::open(&art, opts).unwrap();
    for n in [2usize, 5, 16] {
        let mut seqs = Vec::new();
        for i in 0..n {
            let prompt = tokens(50 + i as u64, 3 + i % 7);
            let (sa, sb) = (a.alloc_slot().unwrap(), b.alloc_slot().unwrap());
            let la = a.step(&[row(sa, &prompt, false)]).unwrap().remove(0);
            b.step(&[row(sb, &prompt, false)]).unwrap();
            seqs.push((sa, sb, argmax(&la.values)));
        }
        for step in 0..3 {
            let rows: Vec<_> = seqs.iter().map(|(sa, _, t)| (*sa, [*t])).collect();
            let together = a.step(&rows.iter().map(|(sa, t)| row(*sa, t, false)).collect::<Vec<_>>()).unwrap();
            assert_eq!(together.len(), n);
            for (i, (sq, got)) in seqs.iter_mut().zip(&together).enumerate() {
                let alone = b.step(&[row(sq.1, &[sq.2], false)]).unwrap().remove(0);
                let e = worst(&row_errs(&got.values, &alone.values));
                assert!(e < SELF_TOL, "{n} sequences, step {step}, row {i}: batch vs alone {e:.2e}");
                sq.2 = argmax(&alone.values);
            }
        }
        for (sa, sb, _) in seqs {
            a.free_slot(sa);
            b.free_slot(sb);
        }
    }
}

#[test]
fn slots_reset_and_bad_rows_fail_first() {
    if !gpu_present() {
        return;
    }
    let art = artifact("cuda-slots", 32);
    let opts = CudaOptions { max_slots: 2, max_context: 20, max_step_tokens: 8, ..CudaOptions::default() };
    let mut gpu = CudaBackend::open(&art, opts).unwrap();
    assert_eq!(gpu.max_context(), 20);
    let a = gpu.alloc_slot().unwrap();
    let b = gpu.alloc_slot().unwrap();
    assert!(matches!(gpu.alloc_slot(), Err(BackendError::NoFreeSlot(2))));
    let toks = tokens(41, 12);
    let first = gpu.step(&[row(a, &toks, false)]).unwrap();
    // A reused slot starts from zero state: the same prompt gives the same logits.
    gpu.free_slot(a);
    assert!(matches!(gpu.slot_len(a), Err(BackendError::BadSlot(_))));
    let c = gpu.alloc_slot().unwrap();
    let again = gpu.step(&[row(c, &toks, false)]).unwrap();
    assert_eq!(again[0].values, first[0].values);
    // Nothing runs when any row is bad.
    let bad = [3, VOCAB as u32];
    assert!(matches!(gpu.step(&[row(b, &toks, false), row(c, &bad, false)]), Err(BackendError::BadToken { .. })));
    assert!(matches!(gpu.step(&[row(b, &toks, false), row(b, &toks, false)]), Err(BackendError::Model(_))));
    assert!(matches!(gpu.step(&[row(c, &tokens(42, 9), false)]), Err(BackendError::ContextFull { max: 20, needed: 21 })));
    assert_eq!((gpu.slot_len(b).unwrap(), gpu.slot_len(c).unwrap()), (0, 12));
    let empty = gpu.step(&[row(b, &[], true)]).unwrap();
    assert_eq!((empty[0].rows, empty[0].values.len()), (0, 0));
}

#[test]
fn kv_pool_pages_follow_the_sequences() {
    if !gpu_present() {
        return;
    }
    // Pages of 64 positions; a pool of 5 pages (320 positions) shared by 3 slots of 256.
    let art = artifact("cuda-pool", 32);
    let opts = CudaOptions { max_slots: 3, max_context: 256, max_step_tokens: 64, kv_capacity: Some(300), ..CudaOptions::default() };
    let mut gpu = CudaBackend::open(&art, opts).unwrap();
    assert_eq!(gpu.kv_pool(), KvPool { page_size: 64, pages: 5, used: 0 });
    let mut alone = CudaBackend::open(&art, CudaOptions { max_slots: 1, kv_capacity: None, ..opts }).unwrap();
    // Two sequences grow in turns, so each one's pages are scattered through the pool.
    let (a, b) = (gpu.alloc_slot().unwrap(), gpu.alloc_slot().unwrap());
    let (pa, pb) = (tokens(51, 100), tokens(52, 70));
    gpu.step(&[row(a, &pa[..50], false)]).unwrap();
    gpu.step(&[row(b, &pb, false)]).unwrap();
    let got = gpu.step(&[row(a, &pa[50..], true)]).unwrap().remove(0);
    assert_eq!(gpu.kv_pool().used, 4);
    let s = alone.alloc_slot().unwrap();
    alone.step(&[row(s, &pa[..50], false)]).unwrap();
    let want = alone.step(&[row(s, &pa[50..], true)]).unwrap().remove(0);
    let e = worst(&row_errs(&got.values, &want.values));
    assert!(e < SELF_TOL, "scattered pages vs contiguous: {e:.2e}");
    // 2 more pages for slot c do not fit next to 4 used: refused before anything changes.
    let c = gpu.alloc_slot().unwrap();
    let err = gpu.step(&[row(c, &tokens(53, 65), false)]).unwrap_err();
    assert!(matches!(err, BackendError::KvFull { needed: 2, free: 1, total: 5 }), "{err}");
    assert_eq!((gpu.slot_len(c).unwrap(), gpu.kv_pool().used), (0, 4));
    // Freeing a slot gives its pages back.
    gpu.free_slot(b);
    assert_eq!(gpu.kv_pool().used, 2);
    gpu.step(&[row(c, &tokens(53, 65), false)]).unwrap();
    assert_eq!(gpu.kv_pool().used, 4);
    // A pool smaller than one full-context sequence opens (the runtime refuses what cannot fit);
    // one larger than the card cannot.
    let small = CudaBackend::open(&art, CudaOptions { kv_capacity: Some(100), ..opts }).unwrap();
    assert_eq!(small.kv_pool().pages, 2);
    let huge = CudaOptions { kv_capacity: Some(1 << 40), ..opts };
    assert!(matches!(CudaBackend::open(&art, huge), Err(BackendError::Model(m)) if m.contains("are free")));
}

#[test]
fn copy_bandwidth_is_measured() {
    if !gpu_present() {
        return;
    }
    let bw = copy_bandwidth().unwrap();
    // Any GPU this build supports copies faster than 100 GB/s and slower than 100 TB/s.
    assert!((1e11..1e14).contains(&bw), "{bw}");
}

fn assert_near(what: &str, errs: &[f32]) {
    let (med, p90) = (quantile(errs, 0.5), quantile(errs, 0.9));
    println!("{what}: row errors median {med:.2e}, p90 {p90:.2e}, max {:.2e}", worst(errs));
    assert!(med < MEDIAN_TOL && p90 < P90_TOL, "{what}: median {med:.2e}, p90 {p90:.2e}");
}

#[test]
fn mtp_follows_the_cpu_reference() {
    use crate::model::testutil::HIDDEN;
    if !gpu_present() {
        return;
    }
    let path = write_tiny("cuda-mtp", &TinyOpts::default());
    let art = Artifact::open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let mut cpu = CpuBackend::open(&art, CpuOptions { max_slots: 1, max_context: 256, mtp: true, kv_capacity: None }).unwrap();
    // Passes of 16: the 40 MTP rows of the prompt run as three.
    let opts = CudaOptions { max_slots: 1, max_context: 256, max_step_tokens: 16, mtp: true, ..CudaOptions::default() };
    let mut gpu = CudaBackend::open(&art, opts).unwrap();
    assert!(gpu.has_mtp());
    let (c, g) = (cpu.alloc_slot().unwrap(), gpu.alloc_slot().unwrap());
    let prompt = tokens(21, 40);
    let want = cpu.step_with_hidden(&[row(c, &prompt, true)]).unwrap().remove(0);
    let got = gpu.step_with_hidden(&[row(g, &prompt, true)]).unwrap().remove(0);
    assert_eq!((got.hidden.len(), got.logits.rows), (40 * HIDDEN, 40));
    assert_near("target hidden", &errs_of(&got.hidden, &want.hidden, HIDDEN));
    // The MTP block changes nothing of the target: the same logits to the bit without it.
    let mut plain = CudaBackend::open(&art, CudaOptions { mtp: false, ..opts }).unwrap();
    let p = plain.alloc_slot().unwrap();
    assert!(!plain.has_mtp());
    assert_eq!(plain.step(&[row(p, &prompt, true)]).unwrap().remove(0).values, got.logits.values);

    // MTP rows pair token p+1 with the target hidden of p (model-spec.md §3.2); both backends
    // get the reference's hidden states, so only the MTP block itself is compared.
    let x40 = argmax(&want.logits.values[39 * VOCAB..]);
    let mut ids = prompt[1..].to_vec();
    ids.push(x40);
    let d_want = cpu.mtp_step(c, &ids, &want.hidden, true).unwrap();
    let d_got = gpu.mtp_step(g, &ids, &want.hidden, true).unwrap();
    assert_eq!((d_got.logits.rows, d_got.hidden.len(), gpu.mtp_len(g).unwrap()), (40, 40 * HIDDEN, 40));
    assert_near("mtp logits", &row_errs(&d_got.logits.values, &d_want.logits.values));
    assert_near("mtp hidden", &errs_of(&d_got.hidden, &d_want.hidden, HIDDEN));

    // A further draft (one row: the decode kernels) from the MTP's own last output.
    let draft = argmax(&d_want.logits.values[39 * VOCAB..]);
    let last = &d_want.hidden[39 * HIDDEN..];
    let e_want = cpu.mtp_step(c, &[draft], last, false).unwrap();
    let e_got = gpu.mtp_step(g, &[draft], last, false).unwrap();
    assert_near("mtp draft logits", &row_errs(&e_got.logits.values, &e_want.logits.values));
    // Rolled back and redone, the draft row is the same to the bit.
    gpu.mtp_truncate(g, 40).unwrap();
    let again = gpu.mtp_step(g, &[draft], last, false).unwrap();
    assert_eq!(again.logits.values, e_got.logits.values);
    assert_eq!(gpu.mtp_len(g).unwrap(), 41);

    // The MTP cache is its own: the target's next steps still follow the reference.
    let mut errs = Vec::new();
    let mut next = x40;
    for _ in 0..4 {
        let want = cpu.step(&[row(c, &[next], false)]).unwrap().remove(0);
        let got = gpu.step(&[row(g, &[next], false)]).unwrap().remove(0);
        errs.extend(row_errs(&got.values, &want.values));
        next = argmax(&want.values);
    }
    assert_near("target after drafts", &errs);

    assert!(matches!(gpu.mtp_step(g, &[draft], &last[..HIDDEN - 1], false), Err(BackendError::Model(_))));
    assert!(matches!(gpu.mtp_step(g, &[VOCAB as u32], last, false), Err(BackendError::BadToken { .. })));
    assert!(matches!(plain.mtp_step(p, &[1], &vec![0.0; HIDDEN], false), Err(BackendError::Model(_))));
}
