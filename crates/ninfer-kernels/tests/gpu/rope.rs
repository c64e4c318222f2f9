//! rope.cu: per-head q/k norm fused with partial rotate-half RoPE, and the KV cache rows it
//! writes.

use ninfer_kernels::{bf16, HeadLayout, KvCacheOut};

use crate::common::*;

const EPS: f32 = 1e-6;

/// One head through the kernel's contract: optional zero-centred norm (rounded to bf16), then
/// RoPE with bf16-rounded cos/sin and transformers' bf16 products.
fn ref_head(x: &[f32], w: Option<&[f32]>, pos: i32, rot: usize, theta: f32) -> Vec<f32> {
    let dim = x.len();
    let mut v = x.to_vec();
    if let Some(w) = w {
        let ms = x.iter().map(|&a| (a as f64).powi(2)).sum::<f64>() / dim as f64;
        let inv = 1.0 / (ms + EPS as f64).sqrt();
        for i in 0..dim {
            v[i] = bf((x[i] as f64 * inv * (1.0 + w[i] as f64)) as f32);
        }
    }
    let half = rot / 2;
    let mut out = v.clone();
    for j in 0..half {
        let inv_freq = 1.0f32 / theta.powf((2 * j) as f32 / rot as f32);
        let ang = pos as f32 * inv_freq;
        let (c, s) = (bf((ang as f64).cos() as f32), bf((ang as f64).sin() as f32));
        out[j] = bf(bf(v[j] * c) - bf(v[j + half] * s));
        out[j + half] = bf(bf(v[j + half] * c) + bf(v[j] * s));
    }
    out
}

fn case(
    stacked: bool,
    tokens: usize,
    hq: usize,
    hk: usize,
    dim: usize,
    rot: usize,
    norm: bool,
    max_pos: usize,
    seed: u64,
    slots: Option<&[i32]>,
) {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(seed);
    let theta = 1e7f32;
    // q as the q_proj output: per head `dim` query values then `dim` gate values. Stacked: q,
    // k and v heads of a token in one row (then 8 values of another tensor), as the stacked
    // q/k/v projection writes them; else every q row, then every k row, then every v row.
    let q_row = hq * 2 * dim;
    let (ld, k_at, k_ld, v_at) = match stacked {
        true => (q_row + 2 * hk * dim + 8, q_row, q_row + 2 * hk * dim + 8, q_row + hk * dim),
        false => (q_row, tokens * q_row, hk * dim, tokens * (q_row + hk * dim)),
    };
    let (q_ld, q_hs, k_hs) = (ld, 2 * dim, dim);
    let buf = rng.bf16s(v_at + tokens * k_ld, 2.0);
    let (q, k) = (&buf[..], &buf[k_at..]);
    // The caches start poisoned (NaN) and end a row past the last slot: rows no token writes.
    let rows = slots.map_or(0, |sl| (*sl.iter().max().unwrap() + 2) as usize);
    let mut dcache = slots.map(|sl| {
        let n = rows * hk * dim;
        (up(&s, sl), nan_bf16(&s, n), nan_bf16(&s, n))
    });
    let qw = rng.bf16s(dim, 0.4);
    let kw = rng.bf16s(dim, 0.4);
    let pos: Vec<i32> = (0..tokens).map(|_| rng.below(max_pos + 1) as i32).collect();
    let mut dbuf = up(&s, &buf);
    let (dqw, dkw, dpos) = (up(&s, &qw), up(&s, &kw), up(&s, &pos));
    let (qwv, kwv) = (dqw.slice(..), dkw.slice(..));
    let v_layout = HeadLayout {
        heads: hk,
        ld: k_ld,
        head_stride: k_hs,
    };
    let cache = dcache.as_mut().map(|(dslots, dkc, dvc)| KvCacheOut {
        v_at,
        v_layout,
        slots: dslots.slice(..),
        k_cache: dkc.slice_mut(..),
        v_cache: dvc.slice_mut(..),
        cache_rows: rows,
    });
    g.ks.qk_norm_rope(
        &s,
        &mut dbuf,
        HeadLayout {
            heads: hq,
            ld: q_ld,
            head_stride: q_hs,
        },
        k_at,
        HeadLayout {
            heads: hk,
            ld: k_ld,
            head_stride: k_hs,
        },
        tokens,
        dim,
        rot,
        norm.then_some(&qwv),
        norm.then_some(&kwv),
        &dpos,
        theta,
        EPS,
        cache,
    )
    .unwrap();
    let gbuf = down(&s, &dbuf);
    let (gq, gk) = (&gbuf[..], &gbuf[k_at..]);
    let (qwf, kwf) = (to_f32(&qw), to_f32(&kw));
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for t in 0..tokens {
        for h in 0..hq {
            let o = t * q_ld + h * q_hs;
            want.extend(ref_head(
                &to_f32(&q[o..o + dim]),
                norm.then_some(&qwf[..]),
                pos[t],
                rot,
                theta,
            ));
            got.extend(to_f32(&gq[o..o + dim]));
            assert_eq!(
                &gq[o + dim..o + 2 * dim],
                &q[o + dim..o + 2 * dim],
                "gate half changed"
            );
        }
        for h in 0..hk {
            let o = t * k_ld + h * k_hs;
            want.extend(ref_head(
                &to_f32(&k[o..o + dim]),
                norm.then_some(&kwf[..]),
                pos[t],
                rot,
                theta,
            ));
            got.extend(to_f32(&gk[o..o + dim]));
        }
    }
    let name = format!(
        "qk_norm_rope T={tokens} hq={hq} hk={hk} dim={dim} rot={rot} norm={norm} pos<={max_pos} stacked={stacked}"
    );
    // Values outside the heads (gate halves, v heads, the row's tail) are untouched.
    if stacked {
        for t in 0..tokens {
            let tail = t * ld + q_row + 2 * hk * dim;
            assert_eq!(&gbuf[tail..tail + 8], &buf[tail..tail + 8], "row tail changed");
        }
    }
    for t in 0..tokens {
        for h in 0..hk {
            let o = v_at + t * k_ld + h * k_hs;
            assert_eq!(&gbuf[o..o + dim], &buf[o..o + dim], "v head changed");
        }
    }
    assert_close(&name, &got, &want, 1e-2);
    // Dims past the rotary part only see the norm: without it they are untouched.
    if !norm {
        for t in 0..tokens {
            let o = t * k_ld;
            assert_eq!(
                &gk[o + rot..o + dim],
                &k[o + rot..o + dim],
                "pass-through dims changed"
            );
        }
    }
    if let (Some(slots), Some((_, dkc, dvc))) = (slots, &dcache) {
        // Row slots[t] of each cache holds token t's final k heads (as left in place) and its
        // v heads, bit for bit; every other row keeps its poison.
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let (mut wk, mut wv) = (bits(&down(&s, dkc)), bits(&down(&s, dvc)));
        let (gkc, gvc) = (wk.clone(), wv.clone());
        wk.fill(bf16::NAN.to_bits());
        wv.fill(bf16::NAN.to_bits());
        for (t, &sl) in slots.iter().enumerate() {
            if sl < 0 {
                continue;
            }
            for h in 0..hk {
                let (dst, o) = ((sl as usize * hk + h) * dim, t * k_ld + h * k_hs);
                wk[dst..dst + dim].copy_from_slice(&bits(&gk[o..o + dim]));
                wv[dst..dst + dim].copy_from_slice(&bits(&buf[v_at + o..v_at + o + dim]));
            }
        }
        assert_eq!(gkc, wk, "{name}: k cache");
        assert_eq!(gvc, wv, "{name}: v cache");
    }
}

#[test]
fn rope_model_shapes() {
    case(false, 5, 16, 2, 256, 64, true, 50, 600, None);
    case(false, 3, 16, 2, 256, 64, true, 200_000, 601, None);
    case(false, 4, 16, 2, 256, 64, false, 1000, 602, None);
    case(true, 5, 16, 2, 256, 64, true, 500, 606, None);
}

#[test]
fn rope_small_heads() {
    case(false, 7, 4, 2, 64, 16, true, 300, 603, None);
    case(false, 2, 3, 1, 32, 32, false, 10, 604, None);
    case(true, 3, 3, 1, 32, 32, false, 10, 607, None);
}

#[test]
fn rope_position_zero_is_identity_without_norm() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(605);
    let k = rng.bf16s(2 * 64, 1.0);
    let mut dk = up(&s, &k);
    let pos = up(&s, &[0i32]);
    g.ks.qk_norm_rope(
        &s,
        &mut dk,
        HeadLayout {
            heads: 0,
            ld: 8,
            head_stride: 8,
        },
        0,
        HeadLayout {
            heads: 2,
            ld: 128,
            head_stride: 64,
        },
        1,
        64,
        64,
        None,
        None,
        &pos,
        1e7,
        EPS,
        None,
    )
    .unwrap();
    assert_eq!(down(&s, &dk), k, "cos 0 = 1, sin 0 = 0");
}

#[test]
fn rope_writes_kv_cache_rows() {
    // Token 2 skipped (slot -1), rows 1, 2, 4-6, 8-10 and 12 left alone; then the model's heads
    // in the stacked projection output with the slots out of order.
    case(false, 5, 4, 2, 64, 16, true, 300, 608, Some(&[7, 0, -1, 11, 3]));
    case(true, 5, 16, 2, 256, 64, true, 500, 609, Some(&[2, -1, 9, 4, 5]));
    case(true, 3, 3, 1, 32, 32, false, 10, 610, Some(&[-1, 1, 0]));
}

#[test]
fn rope_cache_refuses_bad_v() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    // One token: q head 0..64, k head 64..128, room for two v heads in 128..256 (stacked).
    let mut dbuf = up(&s, &vec![bf16::ZERO; 256]);
    let (pos, slots) = (up(&s, &[3i32]), up(&s, &[0i32]));
    let (mut kc, mut vc) = (nan_bf16(&s, 64), nan_bf16(&s, 64));
    let l = |heads| HeadLayout {
        heads,
        ld: 256,
        head_stride: 64,
    };
    let mut run = |v_at, heads| {
        let cache = KvCacheOut {
            v_at,
            v_layout: l(heads),
            slots: slots.slice(..),
            k_cache: kc.slice_mut(..),
            v_cache: vc.slice_mut(..),
            cache_rows: 1,
        };
        g.ks.qk_norm_rope(
            &s, &mut dbuf, l(1), 64, l(1), 1, 64, 64, None, None, &pos, 1e7, EPS, Some(cache),
        )
    };
    assert!(run(64, 1).is_err(), "v on the k head");
    assert!(run(128, 2).is_err(), "two v heads for one k head");
    assert!(run(132, 1).is_err(), "v not 16-byte aligned");
    run(128, 1).expect("v after the k head");
}
