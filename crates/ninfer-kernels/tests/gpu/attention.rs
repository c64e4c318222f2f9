//! attention.cu: causal gated GQA attention over pages, split-KV decode.

use ninfer_kernels::{
    attention_workspace_len, bf16, AttentionBatch, AttnTiles, HeadLayout, PagedKv,
    ATTN_MAX_SPLITS,
};

use crate::common::*;

struct Case {
    q_lens: Vec<usize>,
    kv_lens: Vec<usize>,
    hq: usize,
    hkv: usize,
    dim: usize,
    page: usize,
    gate: bool,
}

impl Case {
    /// Query and cache lengths per sequence, heads (query, kv) and head dim, page size, gate.
    fn new(q_lens: &[usize], kv_lens: &[usize], (hq, hkv, dim): (usize, usize, usize), page: usize, gate: bool) -> Case {
        Case { q_lens: q_lens.to_vec(), kv_lens: kv_lens.to_vec(), hq, hkv, dim, page, gate }
    }
}

/// Builds a shuffled paged cache, runs attention (plain and split-KV) and compares both with
/// an f64 reference computed from the same K/V.
fn run(c: &Case, seed: u64) {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(seed);
    let (hq, hkv, d, page) = (c.hq, c.hkv, c.dim, c.page);
    let seqs = c.q_lens.len();
    let tokens: usize = c.q_lens.iter().sum();
    let pages_per: Vec<usize> = c.kv_lens.iter().map(|&l| l.div_ceil(page)).collect();
    let bt_stride = *pages_per.iter().max().unwrap() + 1;
    let total_pages: usize = pages_per.iter().sum::<usize>() + 3;
    let perm = rng.distinct(total_pages, total_pages);
    let mut block_table = vec![0i32; seqs * bt_stride];
    let mut next = 0;
    for sq in 0..seqs {
        for p in 0..pages_per[sq] {
            block_table[sq * bt_stride + p] = perm[next] as i32;
            next += 1;
        }
    }
    let row = hkv * d;
    let kc = rng.bf16s(total_pages * page * row, 1.0);
    let vc = rng.bf16s(total_pages * page * row, 1.0);
    // q_proj layout: per head d query values then d gate values.
    let (q_ld, q_hs) = (hq * 2 * d, 2 * d);
    let q = rng.bf16s(tokens * q_ld, 1.0);
    let mut cu = vec![0i32];
    for &l in &c.q_lens {
        cu.push(cu.last().unwrap() + l as i32);
    }
    let kv_len: Vec<i32> = c.kv_lens.iter().map(|&l| l as i32).collect();

    let scale = 1.0 / (d as f64).sqrt();
    let group = hq / hkv;
    let mut want = Vec::with_capacity(tokens * hq * d);
    for sq in 0..seqs {
        let (ql, kl) = (c.q_lens[sq], c.kv_lens[sq]);
        for i in 0..ql {
            let t = cu[sq] as usize + i;
            let lim = kl - ql + i;
            for h in 0..hq {
                let kh = h / group;
                let qv = to_f32(&q[t * q_ld + h * q_hs..t * q_ld + h * q_hs + d]);
                let at = |cache: &[bf16], p: usize| {
                    let pg = block_table[sq * bt_stride + p / page] as usize;
                    let r = (pg * page + p % page) * row + kh * d;
                    to_f32(&cache[r..r + d])
                };
                let sc: Vec<f64> = (0..=lim)
                    .map(|p| {
                        at(&kc, p)
                            .iter()
                            .zip(&qv)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|&x| (x - m).exp()).sum();
                let mut o = vec![0f64; d];
                for (p, &x) in sc.iter().enumerate() {
                    let w = (x - m).exp() / z;
                    for (oi, vi) in o.iter_mut().zip(at(&vc, p)) {
                        *oi += w * vi as f64;
                    }
                }
                for j in 0..d {
                    let ob = bf(o[j] as f32);
                    want.push(if c.gate {
                        let gv = q[t * q_ld + h * q_hs + d + j].to_f32();
                        bf(ob * bf(sigmoid(gv as f64) as f32))
                    } else {
                        ob
                    });
                }
            }
        }
    }

    let (dq, dkc, dvc) = (up(&s, &q), up(&s, &kc), up(&s, &vc));
    let (dbt, dcu, dkl) = (up(&s, &block_table), up(&s, &cu), up(&s, &kv_len));
    let kv = PagedKv {
        k: dkc.slice(..),
        v: dvc.slice(..),
        page_size: page,
        kv_heads: hkv,
        dim: d,
    };
    let batch = AttentionBatch {
        seqs,
        tokens,
        max_q_len: *c.q_lens.iter().max().unwrap(),
        max_kv_len: *c.kv_lens.iter().max().unwrap(),
        cu_q: dcu.slice(..),
        kv_len: dkl.slice(..),
        block_table: dbt.slice(..),
        bt_stride,
    };
    let layout = HeadLayout {
        heads: hq,
        ld: q_ld,
        head_stride: q_hs,
    };
    let gate_view = dq.slice(d..);
    let gate = c.gate.then_some(&gate_view);
    let name = format!(
        "attention q={:?} kv={:?} hq={hq} hkv={hkv} d={d} page={page} gate={}",
        c.q_lens, c.kv_lens, c.gate
    );

    // Both kernels (the tensor-core one takes head dims that are multiples of 16), each plain
    // and split-KV.
    let tiles: &[AttnTiles] = if d % 16 == 0 {
        &[AttnTiles::Simt, AttnTiles::Mma]
    } else {
        &[AttnTiles::Simt]
    };
    for &t in tiles {
        let mut out = nan_bf16(&s, tokens * hq * d);
        g.ks.attention(t, &s, &dq, layout, gate, &kv, &batch, scale as f32, &mut out)
            .unwrap();
        assert_close(&format!("{name} {t:?}"), &to_f32(&down(&s, &out)), &want, 1e-2);

        let mut ws = nan_f32(&s, attention_workspace_len(tokens, hq, d, ATTN_MAX_SPLITS));
        let mut out2 = nan_bf16(&s, tokens * hq * d);
        g.ks.attention_split_kv(
            t,
            &s,
            &dq,
            layout,
            gate,
            &kv,
            &batch,
            scale as f32,
            &mut out2,
            &mut ws,
        )
        .unwrap();
        assert_close(
            &format!("{name} {t:?} split-kv"),
            &to_f32(&down(&s, &out2)),
            &want,
            1e-2,
        );
    }
}

#[test]
fn prefill_small_heads_with_context() {
    // Second sequence continues after 45 cached positions; page size 5 splits tiles.
    run(&Case::new(&[37, 5], &[37, 50], (4, 2, 64), 5, true), 700);
}

#[test]
fn prefill_model_heads() {
    run(&Case::new(&[70], &[70], (16, 2, 256), 16, true), 701);
}

#[test]
fn long_prompt_after_context() {
    // Many query tiles and cache tiles, a prompt continuing 50 cached positions.
    run(&Case::new(&[200, 1], &[250, 33], (16, 2, 256), 64, true), 705);
}

#[test]
fn small_head_dim() {
    run(&Case::new(&[19, 40], &[19, 47], (4, 2, 16), 8, true), 706);
}

#[test]
fn odd_group_without_gate() {
    run(&Case::new(&[11, 3], &[11, 40], (6, 2, 128), 16, false), 702);
}

#[test]
fn decode_split_kv_long_context() {
    run(&Case::new(&[1, 1, 1], &[1, 300, 1000], (16, 2, 256), 64, true), 703);
}

#[test]
fn decode_kernel_small_heads() {
    // Blocks of at most 16 query rows take ninfer_attention_mma_decode: one token of a group
    // of 2 at head dim 64 without a gate, and two tokens of a group of 8 at head dim 128.
    run(&Case::new(&[1, 1], &[77, 5], (4, 2, 64), 5, false), 707);
    run(&Case::new(&[2, 2], &[40, 300], (16, 2, 128), 16, true), 708);
}

#[test]
fn decode_many_splits() {
    // 8,300 positions of one sequence: as many splits as the decode kernel's resident blocks
    // (more than 128 on an H200), merged by the combine's warps.
    run(&Case::new(&[1], &[8300], (16, 2, 256), 64, true), 709);
}

#[test]
fn verify_draft_tokens() {
    // Speculative verification shape: a few query tokens on a long context.
    run(&Case::new(&[4, 2], &[517, 90], (16, 2, 256), 32, true), 704);
}
