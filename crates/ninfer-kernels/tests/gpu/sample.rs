//! sample.cu: argmax and filtered sampling against the contract in the kernel's header.

use std::sync::Arc;

use ninfer_kernels::cudarc::driver::{CudaSlice, CudaStream};
use ninfer_kernels::SamplingRow;

use crate::common::*;

/// Scratch for `rows` rows, filled with garbage: the kernel must not rely on its contents.
fn workspace(g: &Gpu, s: &Arc<CudaStream>, rows: usize) -> CudaSlice<u32> {
    up(
        s,
        &vec![0xdead_beefu32; g.ks.sample_workspace_len(rows).unwrap()],
    )
}

fn ref_argmax(l: &[f32]) -> i32 {
    let mut best = 0usize;
    let mut found = false;
    for (i, &v) in l.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if !found || v > l[best] {
            best = i;
            found = true;
        }
    }
    best as i32
}

fn ref_sample(l: &[f32], p: &SamplingRow) -> i32 {
    let amax = ref_argmax(l);
    let top = l[amax as usize] as f64;
    if p.temperature.is_nan() || p.temperature <= 0.0 || top == f64::NEG_INFINITY {
        return amax;
    }
    let t = p.temperature as f64;
    let e = |v: f32| ((v as f64 - top) / t).exp();
    let mut vals: Vec<f32> = l.iter().cloned().filter(|v| !v.is_nan()).collect();
    vals.sort_by(|a, b| b.partial_cmp(a).unwrap());
    let mut thr = f32::NEG_INFINITY;
    if p.top_k > 0 && (p.top_k as usize) < l.len() {
        thr = vals[(p.top_k as usize - 1).min(vals.len() - 1)];
    }
    if p.top_p < 1.0 {
        let cand: Vec<f32> = vals.iter().cloned().filter(|&v| v >= thr).collect();
        let z: f64 = cand.iter().map(|&v| e(v)).sum();
        let target = (p.top_p.max(0.0) as f64) * z;
        let mut cum = 0.0;
        let mut tau = *cand.last().unwrap();
        let mut i = 0;
        while i < cand.len() {
            let v = cand[i];
            while i < cand.len() && cand[i] == v {
                cum += e(cand[i]);
                i += 1;
            }
            if cum >= target {
                tau = v;
                break;
            }
        }
        thr = thr.max(tau);
    }
    let kept = |v: f32| !v.is_nan() && v >= thr && !(p.min_p > 0.0 && e(v) < p.min_p as f64);
    let total: f64 = l.iter().filter(|&&v| kept(v)).map(|&v| e(v)).sum();
    let target = p.u as f64 * total;
    let mut run = 0.0;
    let mut last = amax;
    for (i, &v) in l.iter().enumerate() {
        if !kept(v) {
            continue;
        }
        run += e(v);
        last = i as i32;
        if run > target {
            return i as i32;
        }
    }
    last
}

fn row(temperature: f32, top_k: i32, top_p: f32, min_p: f32, u: f32) -> SamplingRow {
    SamplingRow {
        temperature,
        top_p,
        min_p,
        u,
        top_k,
        pad: [0; 3],
    }
}

#[test]
fn argmax_ties_and_nan() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(900);
    let vocab = 248_320;
    let ld = vocab + 4;
    let rows = 3;
    let mut l = rng.f32s(rows * ld, 3.0);
    l[7] = 50.0; // row 0: tie between 7 and 200000, lowest wins
    l[200_000] = 50.0;
    for i in 0..vocab {
        if i % 3 == 0 {
            l[ld + i] = f32::NAN; // row 1: many NaNs, the max is still found
        }
    }
    l[ld + 123_457] = 40.0;
    for v in &mut l[2 * ld..3 * ld] {
        *v = f32::NAN; // row 2: all NaN -> 0
    }
    l[ld - 1] = 1e9; // padding past vocab is never read
    let dl = up(&s, &l);
    let mut out = up(&s, &[-1i32; 3]);
    g.ks.argmax(&s, &dl, rows, vocab, ld, &mut out).unwrap();
    assert_eq!(down(&s, &out), vec![7, 123_457, 0]);
}

/// The cluster argmax against the reference and against the sampling kernel's greedy rows, on
/// vocabularies that leave its eight slices uneven or empty, with the best logit at a slice's
/// edges, repeated values, signed zeros and NaN; launched twice on one output (the kernel keeps
/// no state between launches).
#[test]
fn argmax_matches_reference_and_sampler() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(903);
    for (vocab, rows) in [(1usize, 2usize), (5, 3), (4093, 4), (31_041, 2), (248_320, 3)] {
        let ld = vocab + 3;
        let mut l = rng.f32s(rows * ld, 3.0);
        let per = vocab.div_ceil(8);
        for r in 0..rows {
            let lr = &mut l[r * ld..r * ld + vocab];
            match r % 4 {
                0 => lr[(per * 3).min(vocab - 1)] = 40.0, // the first id of a slice
                1 => lr[(per * 5).min(vocab) - 1] = 40.0, // the last id of a slice
                2 => lr.iter_mut().step_by(2).for_each(|v| *v = 7.0), // many equal maxima
                _ => lr.iter_mut().for_each(|v| *v = if v.is_sign_negative() { -0.0 } else { 0.0 }),
            }
            if vocab > 2 {
                lr[vocab / 2] = f32::NAN;
            }
            l[r * ld + vocab] = 1e9; // past vocab: never read
        }
        let want: Vec<i32> = (0..rows).map(|r| ref_argmax(&l[r * ld..r * ld + vocab])).collect();
        let dl = up(&s, &l);
        let greedy = vec![row(0.0, 0, 1.0, 0.0, 0.5); rows];
        let (dp, mut ws) = (up(&s, &greedy), workspace(g, &s, rows));
        let mut sampled = up(&s, &vec![-1i32; rows]);
        g.ks.sample(&s, &dl, rows, vocab, ld, &dp, &mut sampled, &mut ws).unwrap();
        assert_eq!(down(&s, &sampled), want, "sampler, vocab {vocab}");
        let mut out = up(&s, &vec![-1i32; rows]);
        for launch in 0..2 {
            g.ks.argmax(&s, &dl, rows, vocab, ld, &mut out).unwrap();
            assert_eq!(down(&s, &out), want, "vocab {vocab}, launch {launch}");
        }
    }
}

#[test]
fn sample_matches_reference_definition() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(901);
    let vocab = 5000;
    let params = [
        row(0.7, 0, 1.0, 0.0, 0.5),
        row(1.0, 50, 1.0, 0.0, 0.3),
        row(1.0, 0, 0.9, 0.0, 0.7),
        row(0.8, 40, 0.95, 0.05, 0.99),
        row(0.0, 0, 1.0, 0.0, 0.5),
        row(1.3, 1, 1.0, 0.0, 0.8),
        row(0.6, 0, 0.0, 0.0, 0.2),
        row(1.0, 4999, 0.5, 0.0, 0.01),
        row(2.0, 0, 1.0, 0.2, 0.6),
    ];
    let mut cases = Vec::new();
    for round in 0..6 {
        for p in &params {
            let mut p = *p;
            if round > 0 {
                p.u = rng.uniform() as f32;
            }
            cases.push(p);
        }
    }
    let rows = cases.len();
    let mut l = rng.f32s(rows * vocab, 3.0);
    for i in 0..50 {
        l[(i * 7919) % (rows * vocab)] = f32::NAN;
    }
    let dl = up(&s, &l);
    let dp = up(&s, &cases);
    let mut out = up(&s, &vec![-1i32; rows]);
    let mut ws = workspace(g, &s, rows);
    g.ks.sample(&s, &dl, rows, vocab, vocab, &dp, &mut out, &mut ws)
        .unwrap();
    let got = down(&s, &out);
    for r in 0..rows {
        let want = ref_sample(&l[r * vocab..(r + 1) * vocab], &cases[r]);
        assert_eq!(got[r], want, "row {r} params {:?}", cases[r]);
    }
}

#[test]
fn sample_full_vocab_rows() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(902);
    let vocab = 248_320;
    let cases = [
        row(0.7, 20, 0.8, 0.0, 0.4),
        row(1.0, 0, 0.95, 0.0, 0.9),
        row(0.9, 0, 1.0, 0.0, 0.123),
    ];
    let l = rng.f32s(cases.len() * vocab, 4.0);
    let (dl, dp) = (up(&s, &l), up(&s, &cases));
    let mut out = up(&s, &vec![-1i32; cases.len()]);
    let mut ws = workspace(g, &s, cases.len());
    g.ks.sample(&s, &dl, cases.len(), vocab, vocab, &dp, &mut out, &mut ws)
        .unwrap();
    let got = down(&s, &out);
    for (r, p) in cases.iter().enumerate() {
        assert_eq!(
            got[r],
            ref_sample(&l[r * vocab..(r + 1) * vocab], p),
            "row {r}"
        );
    }
}

#[test]
fn sample_known_distribution() {
    // p = (1/6, 2/6, 3/6, 0): u picks the token whose cumulative mass (in id order) passes u.
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let base = [0.0f32, 2f32.ln(), 3f32.ln(), f32::NEG_INFINITY];
    let us = [0.0f32, 0.1, 0.17, 0.3, 0.49, 0.51, 0.9, 0.999];
    let want = [0, 0, 1, 1, 1, 2, 2, 2];
    let l: Vec<f32> = us.iter().flat_map(|_| base).collect();
    let cases: Vec<SamplingRow> = us.iter().map(|&u| row(1.0, 0, 1.0, 0.0, u)).collect();
    let (dl, dp) = (up(&s, &l), up(&s, &cases));
    let mut out = up(&s, &vec![-1i32; us.len()]);
    let mut ws = workspace(g, &s, us.len());
    g.ks.sample(&s, &dl, us.len(), 4, 4, &dp, &mut out, &mut ws)
        .unwrap();
    assert_eq!(down(&s, &out), want.to_vec());
}

#[test]
fn sample_many_rows_in_several_launches() {
    // 1500 rows exceed what one cooperative launch holds on any current GPU (a few blocks per
    // multiprocessor), so the launcher splits them; each row still matches the reference.
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(903);
    let (rows, vocab) = (1500, 300);
    let l = rng.f32s(rows * vocab, 2.0);
    let cases: Vec<SamplingRow> = (0..rows)
        .map(|i| match i % 3 {
            0 => row(0.0, 0, 1.0, 0.0, 0.5),
            1 => row(0.9, 10, 1.0, 0.0, rng.uniform() as f32),
            _ => row(1.1, 0, 0.8, 0.01, rng.uniform() as f32),
        })
        .collect();
    let (dl, dp) = (up(&s, &l), up(&s, &cases));
    let mut out = up(&s, &vec![-1i32; rows]);
    let mut ws = workspace(g, &s, rows);
    g.ks.sample(&s, &dl, rows, vocab, vocab, &dp, &mut out, &mut ws)
        .unwrap();
    let got = down(&s, &out);
    for r in 0..rows {
        assert_eq!(
            got[r],
            ref_sample(&l[r * vocab..(r + 1) * vocab], &cases[r]),
            "row {r}"
        );
    }
}
