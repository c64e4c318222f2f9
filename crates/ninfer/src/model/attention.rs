//! Gated full attention (model-spec.md §2.3) and its KV cache: per-head query/gate interleave,
//! q/k zero-centred norms, partial rotate-half RoPE, GQA causal softmax, sigmoid output gate.

use rayon::prelude::*;

use super::config::ModelConfig;
use super::ops::{dot, rms_norm_zc, sigmoid, softmax};
use super::weights::AttnWeights;

/// K (after norm and RoPE) and V of every position so far, each `[len, Hkv·D]`.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    k: Vec<f32>,
    v: Vec<f32>,
    len: usize,
}

impl KvCache {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Drops every position from `len` on (rejected speculative rows).
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            let row = self.k.len() / self.len;
            self.k.truncate(len * row);
            self.v.truncate(len * row);
            self.len = len;
        }
    }
}

/// Rotate-half RoPE on the first `rotary_dim` dims of one head (model-spec.md §2.3 step 4).
/// Frequencies and angles are formed in f32 the way the reference does, so long positions
/// round the same way.
pub fn apply_rope(x: &mut [f32], pos: usize, rotary_dim: usize, theta: f64) {
    let half = rotary_dim / 2;
    let base = theta as f32;
    for j in 0..half {
        let inv_freq = 1.0 / base.powf((2 * j) as f32 / rotary_dim as f32);
        let (sin, cos) = (pos as f32 * inv_freq).sin_cos();
        let (a, b) = (x[j], x[j + half]);
        x[j] = a * cos - b * sin;
        x[j + half] = b * cos + a * sin;
    }
}

/// The attention mixer over `n` rows of normed input `a` (`n × H`) at positions
/// `cache.len()..cache.len() + n`; appends to the cache and returns `n × H`.
pub fn attention(cfg: &ModelConfig, w: &AttnWeights, a: &[f32], cache: &mut KvCache) -> Vec<f32> {
    let (hq, hkv, d) = (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim);
    let n = a.len() / cfg.hidden_size;
    let pos0 = cache.len;

    // Steps 1-2: projections; split each head's 2D q_proj outputs into query then gate.
    let qg = w.q.apply(a);
    let mut q = vec![0f32; n * hq * d];
    let mut gate = vec![0f32; n * hq * d];
    for t in 0..n {
        for h in 0..hq {
            let src = &qg[(t * hq + h) * 2 * d..(t * hq + h + 1) * 2 * d];
            q[(t * hq + h) * d..(t * hq + h + 1) * d].copy_from_slice(&src[..d]);
            gate[(t * hq + h) * d..(t * hq + h + 1) * d].copy_from_slice(&src[d..]);
        }
    }
    let mut k = w.k.apply(a);
    let v = w.v.apply(a);

    // Steps 3-4: per-head norms over D, then RoPE at each row's position.
    rms_norm_zc(&mut q, &w.q_norm, cfg.rms_norm_eps);
    rms_norm_zc(&mut k, &w.k_norm, cfg.rms_norm_eps);
    for t in 0..n {
        for head in q[t * hq * d..(t + 1) * hq * d].chunks_exact_mut(d) {
            apply_rope(head, pos0 + t, cfg.rotary_dim, cfg.rope_theta);
        }
        for head in k[t * hkv * d..(t + 1) * hkv * d].chunks_exact_mut(d) {
            apply_rope(head, pos0 + t, cfg.rotary_dim, cfg.rope_theta);
        }
    }
    cache.k.extend_from_slice(&k);
    cache.v.extend_from_slice(&v);
    cache.len += n;

    // Step 5: causal GQA softmax attention; row t sees positions 0..=pos0+t.
    let scale = 1.0 / (d as f32).sqrt();
    let group = hq / hkv;
    let (ck, cv) = (&cache.k, &cache.v);
    let mut o = vec![0f32; n * hq * d];
    o.par_chunks_mut(d).enumerate().for_each(|(idx, out)| {
        let (t, h) = (idx / hq, idx % hq);
        let qh = &q[idx * d..(idx + 1) * d];
        let kvh = h / group;
        let seen = pos0 + t + 1;
        let mut p: Vec<f32> = (0..seen).map(|j| dot(qh, &ck[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d]) * scale).collect();
        softmax(&mut p);
        for (j, pj) in p.iter().enumerate() {
            let vj = &cv[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d];
            for (oi, vi) in out.iter_mut().zip(vj) {
                *oi += pj * vi;
            }
        }
    });

    // Steps 6-7: sigmoid gate, output projection.
    for (oi, gi) in o.iter_mut().zip(&gate) {
        *oi *= sigmoid(*gi);
    }
    w.o.apply(&o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rotates_only_the_rotary_dims() {
        let mut x: Vec<f32> = (1..=8).map(|i| i as f32).collect();
        apply_rope(&mut x, 0, 4, 1e7);
        assert_eq!(x, (1..=8).map(|i| i as f32).collect::<Vec<_>>(), "position 0 is the identity");
        let mut y: Vec<f32> = (1..=8).map(|i| i as f32).collect();
        apply_rope(&mut y, 3, 4, 100.0);
        // Pair (0, 2) turns by 3 rad, pair (1, 3) by 3·100^(-1/2) = 0.3 rad; dims 4..8 untouched.
        let (s0, c0) = 3f32.sin_cos();
        let (s1, c1) = 0.3f32.sin_cos();
        let want = [1.0 * c0 - 3.0 * s0, 2.0 * c1 - 4.0 * s1, 3.0 * c0 + 1.0 * s0, 4.0 * c1 + 2.0 * s1];
        for i in 0..4 {
            assert!((y[i] - want[i]).abs() < 1e-5, "dim {i}: {} vs {}", y[i], want[i]);
        }
        assert_eq!(&y[4..], &[5.0, 6.0, 7.0, 8.0]);
    }

    #[test]
    fn truncate_drops_positions() {
        let mut c = KvCache { k: vec![1.0; 12], v: vec![2.0; 12], len: 3 };
        c.truncate(1);
        assert_eq!((c.len(), c.k.len(), c.v.len()), (1, 4, 4));
        c.truncate(5);
        assert_eq!(c.len(), 1);
    }
}
