//! Gated DeltaNet (model-spec.md §2.4): causal depthwise conv with a carried conv state, gates,
//! L2-normalised q/k, and the delta rule, both as the token-by-token recurrence (decode) and as
//! the chunked form (multi-token steps). Both carry the recurrent state across calls, so a
//! sequence may be fed in any split.

use rayon::prelude::*;

use super::config::ModelConfig;
use super::ops::{axpy, dot, rms_norm_gated, sigmoid, silu, softplus};
use super::weights::GdnWeights;

/// Rows per chunk of the chunked form (model-spec.md §2.4 "Chunked (prefill) form").
pub const CHUNK: usize = 64;

/// Per-sequence state of one GDN layer.
#[derive(Debug, Clone)]
pub struct GdnState {
    /// The last `kernel − 1` pre-conv inputs, oldest first, `[kernel − 1, 2Kd+Vd]`.
    conv: Vec<f32>,
    /// Recurrent state per value head, `[Hv, dk, dv]` (key-major, as model-spec.md §2.4 step 7).
    s: Vec<f32>,
}

impl GdnState {
    pub fn new(cfg: &ModelConfig) -> Self {
        GdnState {
            conv: vec![0.0; (cfg.linear_conv_kernel - 1) * cfg.gdn_conv_dim()],
            s: vec![0.0; cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim],
        }
    }
}

/// Causal depthwise conv + SiLU over `n` rows of `x` (`[n, c]`), continuing from `hist` (the last
/// `kernel − 1` inputs) and updating it (steps 2 of §2.4).
fn causal_conv(x: &[f32], taps: &[f32], kernel: usize, hist: &mut [f32]) -> Vec<f32> {
    let c = taps.len() / kernel;
    let n = x.len() / c;
    let k1 = kernel - 1;
    // Timeline = history rows then the new rows; output row t ends at timeline row k1 + t.
    let mut line = Vec::with_capacity((k1 + n) * c);
    line.extend_from_slice(hist);
    line.extend_from_slice(x);
    let mut y = vec![0f32; n * c];
    for t in 0..n {
        for ch in 0..c {
            let mut acc = 0.0;
            for i in 0..kernel {
                acc += taps[ch * kernel + i] * line[(t + i) * c + ch];
            }
            y[t * c + ch] = silu(acc);
        }
    }
    hist.copy_from_slice(&line[n * c..]);
    y
}

/// One value head's inputs in time order: normalised q̂, k̂ `[n, dk]`, v `[n, dv]`, β and
/// log-decay g `[n]`.
pub struct HeadSeq<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub beta: &'a [f32],
    pub g: &'a [f32],
}

/// The recurrence (§2.4 step 7) over every row; `s` is `[dk, dv]`, `out` is `[n, dv]`.
pub fn delta_recurrent(x: &HeadSeq, dk: usize, dv: usize, s: &mut [f32], out: &mut [f32]) {
    let mut u = vec![0f32; dv];
    for t in 0..x.beta.len() {
        let (q, k, v) = (&x.q[t * dk..(t + 1) * dk], &x.k[t * dk..(t + 1) * dk], &x.v[t * dv..(t + 1) * dv]);
        let decay = x.g[t].exp();
        s.iter_mut().for_each(|e| *e *= decay);
        // u = Sᵀk̂: the state's prediction of v.
        u.iter_mut().for_each(|e| *e = 0.0);
        for (i, ki) in k.iter().enumerate() {
            axpy(&mut u, *ki, &s[i * dv..(i + 1) * dv]);
        }
        // δ = β(v − u); S += k̂δᵀ; o = Sᵀq̂ (reads the updated state).
        for (uj, vj) in u.iter_mut().zip(v) {
            *uj = x.beta[t] * (vj - *uj);
        }
        let o = &mut out[t * dv..(t + 1) * dv];
        o.iter_mut().for_each(|e| *e = 0.0);
        for i in 0..dk {
            let row = &mut s[i * dv..(i + 1) * dv];
            axpy(row, k[i], &u);
            axpy(o, q[i], row);
        }
    }
}

/// The chunked form (§2.4), chunks of `chunk` rows; same contract as [`delta_recurrent`].
///
/// Per chunk with entering state S and Γ the cumulative log-decay, the pseudo-values
/// V' = U − W·S solve (I + A)·V' = B·(V − diag(e^Γ)·K·S) with A[r,s] = β_r (k̂_r·k̂_s) e^{Γ_r−Γ_s}
/// (s < r); one forward substitution on that right-hand side gives V' directly. Then
/// O = diag(e^Γ)·Q·S + (M ⊙ QKᵀ)·V' and S ← e^{Γ_L}·S + (diag(e^{Γ_L−Γ})·K)ᵀ·V'.
pub fn delta_chunked(x: &HeadSeq, dk: usize, dv: usize, chunk: usize, s: &mut [f32], out: &mut [f32]) {
    let n = x.beta.len();
    let mut c0 = 0;
    while c0 < n {
        let l = chunk.min(n - c0);
        let (q, k, v) = (&x.q[c0 * dk..(c0 + l) * dk], &x.k[c0 * dk..(c0 + l) * dk], &x.v[c0 * dv..(c0 + l) * dv]);
        let (beta, g) = (&x.beta[c0..c0 + l], &x.g[c0..c0 + l]);
        let mut gam = vec![0f32; l];
        let mut acc = 0.0;
        for r in 0..l {
            acc += g[r];
            gam[r] = acc;
        }
        let kr = |r: usize| &k[r * dk..(r + 1) * dk];
        let qr = |r: usize| &q[r * dk..(r + 1) * dk];

        // Right-hand side B(V − diag(e^Γ)KS), then forward substitution row by row.
        let mut vp = vec![0f32; l * dv];
        for r in 0..l {
            let row = &mut vp[r * dv..(r + 1) * dv];
            for (i, ki) in kr(r).iter().enumerate() {
                axpy(row, *ki, &s[i * dv..(i + 1) * dv]);
            }
            let e = gam[r].exp();
            for (pj, vj) in row.iter_mut().zip(&v[r * dv..(r + 1) * dv]) {
                *pj = beta[r] * (vj - e * *pj);
            }
            for sidx in 0..r {
                let a = beta[r] * dot(kr(r), kr(sidx)) * (gam[r] - gam[sidx]).exp();
                let (done, cur) = vp.split_at_mut(r * dv);
                axpy(&mut cur[..dv], -a, &done[sidx * dv..(sidx + 1) * dv]);
            }
        }

        // Outputs: the entering state's contribution plus the intra-chunk causal part.
        let o = &mut out[c0 * dv..(c0 + l) * dv];
        for r in 0..l {
            let row = &mut o[r * dv..(r + 1) * dv];
            row.iter_mut().for_each(|e| *e = 0.0);
            let e = gam[r].exp();
            for (i, qi) in qr(r).iter().enumerate() {
                axpy(row, e * qi, &s[i * dv..(i + 1) * dv]);
            }
            for sidx in 0..=r {
                let m = dot(qr(r), kr(sidx)) * (gam[r] - gam[sidx]).exp();
                axpy(row, m, &vp[sidx * dv..(sidx + 1) * dv]);
            }
        }

        // State carried into the next chunk.
        let last = gam[l - 1];
        let e_last = last.exp();
        s.iter_mut().for_each(|e| *e *= e_last);
        for r in 0..l {
            let w = (last - gam[r]).exp();
            for (i, ki) in kr(r).iter().enumerate() {
                axpy(&mut s[i * dv..(i + 1) * dv], w * ki, &vp[r * dv..(r + 1) * dv]);
            }
        }
        c0 += l;
    }
}

/// The GDN mixer over `n` rows of normed input `a` (`n × H`); returns `n × H`.
pub fn gated_delta_net(cfg: &ModelConfig, w: &GdnWeights, a: &[f32], st: &mut GdnState) -> Vec<f32> {
    let (hk, hv, dk, dv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim);
    let (kd, vd, cd) = (cfg.gdn_key_dim(), cfg.gdn_value_dim(), cfg.gdn_conv_dim());
    let n = a.len() / cfg.hidden_size;

    // Step 1: projections. Step 2: conv + SiLU.
    let mixed = causal_conv(&w.qkv.apply(a), &w.conv, cfg.linear_conv_kernel, &mut st.conv);
    let z = w.z.apply(a);
    let b = w.b.apply(a);
    let alpha = w.a.apply(a);

    // Steps 3-6, gathered per value head: head h reads q/k head h / (Hv/Hk); q̂, k̂ are
    // L2-normalised with ε inside the root, q̂ also scaled by 1/√dk.
    let ratio = hv / hk;
    let qscale = 1.0 / (dk as f32).sqrt();
    let l2 = |x: &[f32], scale: f32| -> Vec<f32> {
        let inv = scale / (dot(x, x) + 1e-6).sqrt();
        x.iter().map(|e| e * inv).collect()
    };
    let mut qn = vec![0f32; n * hk * dk];
    let mut kn = vec![0f32; n * hk * dk];
    for t in 0..n {
        let row = &mixed[t * cd..(t + 1) * cd];
        for j in 0..hk {
            qn[(t * hk + j) * dk..(t * hk + j + 1) * dk].copy_from_slice(&l2(&row[j * dk..(j + 1) * dk], qscale));
            kn[(t * hk + j) * dk..(t * hk + j + 1) * dk].copy_from_slice(&l2(&row[kd + j * dk..kd + (j + 1) * dk], 1.0));
        }
    }

    // Step 7, heads in parallel; each head owns its slice of the state.
    let mut heads_out = vec![0f32; hv * n * dv];
    heads_out.par_chunks_mut(n * dv).zip(st.s.par_chunks_mut(dk * dv)).enumerate().for_each(|(h, (out, s))| {
        let j = h / ratio;
        let mut q = Vec::with_capacity(n * dk);
        let mut k = Vec::with_capacity(n * dk);
        let mut v = Vec::with_capacity(n * dv);
        let mut beta = Vec::with_capacity(n);
        let mut g = Vec::with_capacity(n);
        for t in 0..n {
            q.extend_from_slice(&qn[(t * hk + j) * dk..(t * hk + j + 1) * dk]);
            k.extend_from_slice(&kn[(t * hk + j) * dk..(t * hk + j + 1) * dk]);
            v.extend_from_slice(&mixed[t * cd + 2 * kd + h * dv..t * cd + 2 * kd + (h + 1) * dv]);
            beta.push(sigmoid(b[t * hv + h]));
            g.push(-w.a_log[h].exp() * softplus(alpha[t * hv + h] + w.dt_bias[h]));
        }
        let seq = HeadSeq { q: &q, k: &k, v: &v, beta: &beta, g: &g };
        if n == 1 {
            delta_recurrent(&seq, dk, dv, s, out);
        } else {
            delta_chunked(&seq, dk, dv, CHUNK, s, out);
        }
    });

    // Step 8: back to [n, Hv·dv], gated RMSNorm per head with z, output projection.
    let mut o = vec![0f32; n * vd];
    for h in 0..hv {
        for t in 0..n {
            o[t * vd + h * dv..t * vd + (h + 1) * dv].copy_from_slice(&heads_out[h * n * dv + t * dv..h * n * dv + (t + 1) * dv]);
        }
    }
    rms_norm_gated(&mut o, &z, &w.norm, cfg.rms_norm_eps);
    w.out.apply(&o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::testutil::{noise, rel_err};

    fn unit_rows(x: &mut [f32], d: usize, scale: f32) {
        for r in x.chunks_exact_mut(d) {
            let inv = scale / dot(r, r).sqrt();
            r.iter_mut().for_each(|e| *e *= inv);
        }
    }

    #[test]
    fn chunked_equals_recurrence_across_chunks_and_splits() {
        let (n, dk, dv) = (150, 16, 16);
        let mut q = noise(1, n * dk);
        let mut k = noise(2, n * dk);
        unit_rows(&mut q, dk, 0.25);
        unit_rows(&mut k, dk, 1.0);
        let v = noise(3, n * dv);
        let beta: Vec<f32> = noise(4, n).iter().map(|e| sigmoid(3.0 * e)).collect();
        let g: Vec<f32> = noise(5, n).iter().map(|e| -0.3 * softplus(2.0 * e)).collect();
        let seq = HeadSeq { q: &q, k: &k, v: &v, beta: &beta, g: &g };
        let s0 = noise(6, dk * dv);

        let (mut s_rec, mut o_rec) = (s0.clone(), vec![0f32; n * dv]);
        delta_recurrent(&seq, dk, dv, &mut s_rec, &mut o_rec);
        let (mut s_chk, mut o_chk) = (s0.clone(), vec![0f32; n * dv]);
        delta_chunked(&seq, dk, dv, CHUNK, &mut s_chk, &mut o_chk);
        assert!(rel_err(&o_chk, &o_rec) < 1e-4, "outputs {}", rel_err(&o_chk, &o_rec));
        assert!(rel_err(&s_chk, &s_rec) < 1e-4, "states {}", rel_err(&s_chk, &s_rec));
        // The entering state matters (guards against a chunked form that ignores S).
        let (mut s_zero, mut o_zero) = (vec![0f32; dk * dv], vec![0f32; n * dv]);
        delta_chunked(&seq, dk, dv, CHUNK, &mut s_zero, &mut o_zero);
        assert!(rel_err(&o_zero, &o_rec) > 1e-2);

        // Any chunk length gives the same result; so does feeding the rows in two calls.
        let (mut s7, mut o7) = (s0.clone(), vec![0f32; n * dv]);
        delta_chunked(&seq, dk, dv, 7, &mut s7, &mut o7);
        assert!(rel_err(&o7, &o_rec) < 1e-4);
        let split = 90;
        let first = HeadSeq { q: &q[..split * dk], k: &k[..split * dk], v: &v[..split * dv], beta: &beta[..split], g: &g[..split] };
        let rest = HeadSeq { q: &q[split * dk..], k: &k[split * dk..], v: &v[split * dv..], beta: &beta[split..], g: &g[split..] };
        let (mut s2, mut o2) = (s0.clone(), vec![0f32; n * dv]);
        delta_chunked(&first, dk, dv, CHUNK, &mut s2, &mut o2[..split * dv]);
        delta_chunked(&rest, dk, dv, CHUNK, &mut s2, &mut o2[split * dv..]);
        assert!(rel_err(&o2, &o_rec) < 1e-4 && rel_err(&s2, &s_rec) < 1e-4);
    }

    #[test]
    fn recurrence_hand_computed_step() {
        // dk = dv = 1, S = 2, k = q = 1, v = 5, β = 0.5, g = ln 0.5:
        // S' = 1, u = 1, δ = 0.5·(5 − 1) = 2, S = 3, o = 3.
        let seq = HeadSeq { q: &[1.0], k: &[1.0], v: &[5.0], beta: &[0.5], g: &[0.5f32.ln()] };
        let (mut s, mut o) = (vec![2.0], vec![0.0]);
        delta_recurrent(&seq, 1, 1, &mut s, &mut o);
        assert!((s[0] - 3.0).abs() < 1e-6 && (o[0] - 3.0).abs() < 1e-6, "{s:?} {o:?}");
    }

    #[test]
    fn conv_carries_history_across_calls() {
        // Two channels, kernel 3: taps [1, 10, 100] and [0, 0, 1].
        let taps = [1.0, 10.0, 100.0, 0.0, 0.0, 1.0];
        let x = [1.0, -1.0, 2.0, -2.0, 3.0, -3.0];
        let mut h1 = vec![0.0; 4];
        let whole = causal_conv(&x, &taps, 3, &mut h1);
        let mut h2 = vec![0.0; 4];
        let mut parts = causal_conv(&x[..2], &taps, 3, &mut h2);
        parts.extend(causal_conv(&x[2..], &taps, 3, &mut h2));
        assert_eq!(whole, parts);
        assert_eq!(h1, h2);
        assert_eq!(h1, vec![2.0, -2.0, 3.0, -3.0], "history = last two inputs, oldest first");
        // Channel 0 at t = 2: 1·1 + 10·2 + 100·3 = 321; channel 1 passes the current input.
        assert!((whole[4] - silu(321.0)).abs() < 1e-3 && (whole[5] - silu(-3.0)).abs() < 1e-6);
    }
}
