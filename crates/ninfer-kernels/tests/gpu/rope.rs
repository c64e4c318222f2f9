//! rope.cu: per-head q/k norm fused with partial rotate-half RoPE.

use ninfer_kernels::HeadLayout;

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
) {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(seed);
    let theta = 1e7f32;
    // q as the q_proj output: per head `dim` query values then `dim` gate values. Stacked: q
    // and k heads of a token in one row (then 8 values of another tensor), as the stacked
    // q/k/v projection writes them; else every q row, then every k row.
    let q_row = hq * 2 * dim;
    let (ld, k_at, k_ld) = match stacked {
        true => (q_row + hk * dim + 8, q_row, q_row + hk * dim + 8),
        false => (q_row, tokens * q_row, hk * dim),
    };
    let (q_ld, q_hs, k_hs) = (ld, 2 * dim, dim);
    let buf = rng.bf16s(k_at + tokens * k_ld, 2.0);
    let (q, k) = (&buf[..], &buf[k_at..]);
    let qw = rng.bf16s(dim, 0.4);
    let kw = rng.bf16s(dim, 0.4);
    let pos: Vec<i32> = (0..tokens).map(|_| rng.below(max_pos + 1) as i32).collect();
    let mut dbuf = up(&s, &buf);
    let (dqw, dkw, dpos) = (up(&s, &qw), up(&s, &kw), up(&s, &pos));
    let (qwv, kwv) = (dqw.slice(..), dkw.slice(..));
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
    // Values outside the heads (gate halves, the row's tail) are untouched.
    if stacked {
        for t in 0..tokens {
            let tail = t * ld + q_row + hk * dim;
            assert_eq!(&gbuf[tail..tail + 8], &buf[tail..tail + 8], "row tail changed");
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
}

#[test]
fn rope_model_shapes() {
    case(false, 5, 16, 2, 256, 64, true, 50, 600);
    case(false, 3, 16, 2, 256, 64, true, 200_000, 601);
    case(false, 4, 16, 2, 256, 64, false, 1000, 602);
    case(true, 5, 16, 2, 256, 64, true, 500, 606);
}

#[test]
fn rope_small_heads() {
    case(false, 7, 4, 2, 64, 16, true, 300, 603);
    case(false, 2, 3, 1, 32, 32, false, 10, 604);
    case(true, 3, 3, 1, 32, 32, false, 10, 607);
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
    )
    .unwrap();
    assert_eq!(down(&s, &dk), k, "cos 0 = 1, sin 0 = 0");
}
