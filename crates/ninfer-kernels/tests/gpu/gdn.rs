//! gdn.cu: causal conv with state, and the gated delta-rule recurrence.

use ninfer_kernels::{bf16, DeltaForm, GdnDims, SeqSlots};

use crate::common::*;

#[test]
fn conv_continues_from_state() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(800);
    for &(channels, ref lens) in &[
        (256usize, vec![5usize, 1, 2]),
        (8192, vec![1]),
        (200, vec![9]),
    ] {
        let tokens: usize = lens.iter().sum();
        let seqs = lens.len();
        let num_slots = seqs + 2;
        let slots: Vec<i32> = rng
            .distinct(num_slots, seqs)
            .into_iter()
            .map(|v| v as i32)
            .collect();
        let ldx = channels + 8;
        let x = rng.bf16s(tokens * ldx, 1.0);
        let w = rng.bf16s(channels * 4, 0.5);
        let state = rng.bf16s(num_slots * 3 * channels, 1.0);
        let mut cu = vec![0i32];
        for &l in lens {
            cu.push(cu.last().unwrap() + l as i32);
        }
        let (dx, dw, dcu, dsl) = (up(&s, &x), up(&s, &w), up(&s, &cu), up(&s, &slots));
        let mut dst = up(&s, &state);
        let mut dy = nan_bf16(&s, tokens * channels);
        let batch = SeqSlots {
            seqs,
            tokens,
            cu: dcu.slice(..),
            slots: dsl.slice(..),
        };
        g.ks.gdn_conv(
            &s, &dx, ldx, &dw, channels, &mut dst, num_slots, &batch, &mut dy, channels,
        )
        .unwrap();

        let mut want_state = state.clone();
        let mut want = vec![0f32; tokens * channels];
        for sq in 0..seqs {
            let base = slots[sq] as usize * 3 * channels;
            for c in 0..channels {
                let mut hist: Vec<f32> = (0..3)
                    .map(|i| state[base + i * channels + c].to_f32())
                    .collect();
                for t in cu[sq] as usize..cu[sq + 1] as usize {
                    let xt = x[t * ldx + c].to_f32();
                    let wc: Vec<f64> = (0..4).map(|i| w[c * 4 + i].to_f32() as f64).collect();
                    let acc = wc[0] * hist[0] as f64
                        + wc[1] * hist[1] as f64
                        + wc[2] * hist[2] as f64
                        + wc[3] * xt as f64;
                    want[t * channels + c] = bf(silu(bf(acc as f32) as f64) as f32);
                    hist = vec![hist[1], hist[2], xt];
                }
                for i in 0..3 {
                    want_state[base + i * channels + c] = bf16::from_f32(hist[i]);
                }
            }
        }
        assert_close(
            &format!("gdn_conv C={channels} lens={lens:?}"),
            &to_f32(&down(&s, &dy)),
            &want,
            1e-2,
        );
        assert_eq!(
            down(&s, &dst),
            want_state,
            "conv state after C={channels} lens={lens:?}"
        );
    }
}

/// The recurrence of model-spec.md 2.4 steps 4-7 in f64, updating `state` in place.
#[allow(clippy::too_many_arguments)]
fn ref_recurrent(
    d: GdnDims,
    qkv: &[f32],
    ld: usize,
    b: &[f32],
    a: &[f32],
    ld_ba: usize,
    a_log: &[f32],
    dt_bias: &[f32],
    state: &mut [f32],
    t_range: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let GdnDims { hk, hv, dk, dv } = d;
    for t in t_range {
        let row = &qkv[t * ld..];
        for h in 0..hv {
            let kh = h / (hv / hk);
            let q: Vec<f64> = (0..dk).map(|i| row[kh * dk + i] as f64).collect();
            let k: Vec<f64> = (0..dk).map(|i| row[hk * dk + kh * dk + i] as f64).collect();
            let v: Vec<f64> = (0..dv)
                .map(|j| row[2 * hk * dk + h * dv + j] as f64)
                .collect();
            let nq =
                1.0 / (q.iter().map(|x| x * x).sum::<f64>() + 1e-6).sqrt() / (dk as f64).sqrt();
            let nk = 1.0 / (k.iter().map(|x| x * x).sum::<f64>() + 1e-6).sqrt();
            let beta = bf(sigmoid(b[t * ld_ba + h] as f64) as f32) as f64;
            let x = a[t * ld_ba + h] as f64 + dt_bias[h] as f64;
            let softplus = if x > 20.0 { x } else { x.exp().ln_1p() };
            let decay = (-(a_log[h] as f64).exp() * softplus).exp();
            let st = &mut state[h * dk * dv..(h + 1) * dk * dv];
            for j in 0..dv {
                let mut u = 0.0;
                for i in 0..dk {
                    let sv = st[i * dv + j] as f64 * decay;
                    st[i * dv + j] = sv as f32;
                    u += sv * k[i] * nk;
                }
                let delta = beta * (v[j] - u);
                let mut o = 0.0;
                for i in 0..dk {
                    let sv = st[i * dv + j] as f64 + k[i] * nk * delta;
                    st[i * dv + j] = sv as f32;
                    o += sv * q[i] * nq;
                }
                out[(t * hv + h) * dv + j] = bf(o as f32);
            }
        }
    }
}

/// Inputs of one recurrence launch and what the launch gave: bf16 outputs and the f32 state of
/// every slot.
struct DeltaRun {
    qkv: Vec<bf16>,
    ba: Vec<bf16>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    state: Vec<f32>,
    cu: Vec<i32>,
    slots: Vec<i32>,
    out: Vec<bf16>,
    state_after: Vec<f32>,
}

/// One launch of `form` over sequences of `lens` tokens on inputs drawn from `seed`; `a_log`
/// values near `decay_scale` make the decays strong.
fn delta_run(g: &Gpu, form: DeltaForm, d: GdnDims, lens: &[usize], decay_scale: f32, seed: u64) -> DeltaRun {
    let s = g.stream();
    let mut rng = Rng::new(seed);
    let tokens: usize = lens.iter().sum();
    let seqs = lens.len();
    let num_slots = seqs + 1;
    let slots: Vec<i32> = rng
        .distinct(num_slots, seqs)
        .into_iter()
        .map(|v| v as i32)
        .collect();
    let ld = d.conv_channels() + 8;
    let ld_ba = 2 * d.hv;
    let qkv = rng.bf16s(tokens * ld, 0.6);
    let ba = rng.bf16s(tokens * ld_ba, 1.5);
    let a_log: Vec<f32> = rng
        .f32s(d.hv, 0.7)
        .iter()
        .map(|v| v + decay_scale)
        .collect();
    let dt_bias = rng.f32s(d.hv, 0.7);
    let state = rng.f32s(num_slots * d.hv * d.dk * d.dv, 0.05);
    let mut cu = vec![0i32];
    for &l in lens {
        cu.push(cu.last().unwrap() + l as i32);
    }
    let (dqkv, dba, dal, ddt) = (up(&s, &qkv), up(&s, &ba), up(&s, &a_log), up(&s, &dt_bias));
    let (dcu, dsl) = (up(&s, &cu), up(&s, &slots));
    let mut dst = up(&s, &state);
    let mut dout = nan_bf16(&s, tokens * d.hv * d.dv);
    let batch = SeqSlots {
        seqs,
        tokens,
        cu: dcu.slice(..),
        slots: dsl.slice(..),
    };
    let (bview, aview) = (dba.slice(..), dba.slice(d.hv..));
    g.ks.gdn_delta(
        form, &s, &dqkv, ld, &bview, &aview, ld_ba, &dal, &ddt, &mut dst, num_slots, &batch, d,
        &mut dout,
    )
    .unwrap();
    let (out, state_after) = (down(&s, &dout), down(&s, &dst));
    DeltaRun {
        qkv,
        ba,
        a_log,
        dt_bias,
        state,
        cu,
        slots,
        out,
        state_after,
    }
}

/// [`delta_run`] against the f64 recurrence.
fn delta_case(form: DeltaForm, d: GdnDims, lens: &[usize], decay_scale: f32, seed: u64) {
    let Some(g) = gpu() else { return };
    let r = delta_run(g, form, d, lens, decay_scale, seed);
    let (ld, ld_ba) = (d.conv_channels() + 8, 2 * d.hv);
    let per_slot = d.hv * d.dk * d.dv;
    let (qkvf, baf) = (to_f32(&r.qkv), to_f32(&r.ba));
    let mut want_state = r.state.clone();
    let mut want = vec![0f32; r.out.len()];
    for sq in 0..lens.len() {
        let slot = r.slots[sq] as usize;
        let st = &mut want_state[slot * per_slot..(slot + 1) * per_slot];
        let range = r.cu[sq] as usize..r.cu[sq + 1] as usize;
        ref_recurrent(
            d,
            &qkvf,
            ld,
            &baf,
            &baf[d.hv..],
            ld_ba,
            &r.a_log,
            &r.dt_bias,
            st,
            range,
            &mut want,
        );
    }
    let name = format!("gdn {form:?} {d:?} lens={lens:?} decay {decay_scale}");
    assert_close(&name, &to_f32(&r.out), &want, 1e-2);
    assert_close(&format!("{name} state"), &r.state_after, &want_state, 1e-4);
}

const SMALL: GdnDims = GdnDims {
    hk: 2,
    hv: 4,
    dk: 32,
    dv: 32,
};
/// Fewer value columns than a block's 32 and more, dk not a multiple of 32.
const ODD: GdnDims = GdnDims {
    hk: 1,
    hv: 3,
    dk: 24,
    dv: 40,
};
const MODEL: GdnDims = GdnDims {
    hk: 16,
    hv: 32,
    dk: 128,
    dv: 128,
};

#[test]
fn recurrent_small_heads_multi_token() {
    delta_case(DeltaForm::Recurrent, SMALL, &[3, 1, 6], 0.0, 810);
    delta_case(DeltaForm::Recurrent, ODD, &[2], 0.0, 811);
}

#[test]
fn recurrent_model_dims() {
    delta_case(DeltaForm::Recurrent, MODEL, &[1], 0.0, 812);
    delta_case(DeltaForm::Recurrent, MODEL, &[4, 1], 0.0, 813);
}

#[test]
fn chunked_matches_the_recurrence() {
    // Partial chunks, one-token rows and several chunks in one sequence.
    delta_case(DeltaForm::Chunked, SMALL, &[3, 1, 70, 32], 0.0, 814);
    delta_case(DeltaForm::Chunked, ODD, &[33, 5], 0.0, 815);
    delta_case(DeltaForm::Chunked, MODEL, &[300, 1, 17], 0.0, 816);
}

#[test]
fn chunked_walks_short_chunks_as_the_recurrence() {
    // Every chunk below GDN_CHUNK_MIN tokens: both forms give the same bits.
    let Some(g) = gpu() else { return };
    let runs: Vec<_> = [DeltaForm::Recurrent, DeltaForm::Chunked]
        .into_iter()
        .map(|form| delta_run(g, form, MODEL, &[1, 11, 5], 0.0, 819))
        .collect();
    assert!(runs[1].out.iter().all(|v| v.is_finite()));
    assert_eq!(runs[0].out, runs[1].out, "outputs differ");
    assert_eq!(runs[0].state_after, runs[1].state_after, "states differ");
}

#[test]
fn chunked_strong_decay_stays_finite() {
    // exp(a_log) ~ 50: each token's decay is near exp(-50) and a chunk's sum reaches -1,600;
    // every exponent the kernel takes is a difference of sums, never their raw value.
    delta_case(DeltaForm::Chunked, SMALL, &[64, 7], 4.0, 817);
    delta_case(DeltaForm::Chunked, MODEL, &[96], 4.0, 818);
}
