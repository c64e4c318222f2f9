//! Sparse MoE block (model-spec.md §2.5): softmax router over all experts, top-k renormalised,
//! SwiGLU experts, plus the optional shared expert behind its scalar sigmoid gate.

use super::config::ModelConfig;
use super::ops::{dot, sigmoid, silu, softmax, MatRef};
use super::weights::MoeWeights;

/// Top-k experts of one token from its router logits: (expert, weight), weights renormalised to
/// sum to 1, ordered by decreasing probability (lower expert id first on a tie).
pub fn route(logits: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut p = logits.to_vec();
    softmax(&mut p);
    let mut idx: Vec<usize> = (0..p.len()).collect();
    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    idx.truncate(k);
    let sum: f32 = idx.iter().map(|&e| p[e]).sum();
    idx.into_iter().map(|e| (e, p[e] / sum)).collect()
}

/// SwiGLU over `m` rows: `gate_up` gives [g ‖ u] (I each), `down` maps SiLU(g)⊙u back to H.
fn swiglu(gate_up: MatRef, down: MatRef, x: &[f32]) -> Vec<f32> {
    let i = gate_up.rows / 2;
    let gu = gate_up.apply(x);
    let m = gu.len() / gate_up.rows;
    let mut act = vec![0f32; m * i];
    for t in 0..m {
        let row = &gu[t * 2 * i..(t + 1) * 2 * i];
        for j in 0..i {
            act[t * i + j] = silu(row[j]) * row[i + j];
        }
    }
    down.apply(&act)
}

/// The MoE block over `n` rows of normed input `x` (`n × H`); returns `n × H`.
pub fn moe(cfg: &ModelConfig, w: &MoeWeights, x: &[f32]) -> Vec<f32> {
    let h = cfg.hidden_size;
    let n = x.len() / h;
    let logits = w.router.apply(x);

    // Steps 1-2: route every token, then group tokens by expert.
    let mut per_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); cfg.num_experts];
    for t in 0..n {
        for (e, wt) in route(&logits[t * cfg.num_experts..(t + 1) * cfg.num_experts], cfg.num_experts_per_tok) {
            per_expert[e].push((t, wt));
        }
    }

    // Step 3: each used expert over its tokens; contributions summed in ascending expert id,
    // so a token's sum has the same order whatever batch it is in.
    let mut out = vec![0f32; n * h];
    for (e, toks) in per_expert.iter().enumerate() {
        if toks.is_empty() {
            continue;
        }
        let mut xs = Vec::with_capacity(toks.len() * h);
        for &(t, _) in toks {
            xs.extend_from_slice(&x[t * h..(t + 1) * h]);
        }
        let y = swiglu(w.gate_up.get(e), w.down.get(e), &xs);
        for (r, &(t, wt)) in toks.iter().enumerate() {
            for (o, yi) in out[t * h..(t + 1) * h].iter_mut().zip(&y[r * h..(r + 1) * h]) {
                *o += wt * yi;
            }
        }
    }

    // Step 4: shared expert scaled by sigmoid(x · shared_gate).
    if let Some(s) = &w.shared {
        let y = swiglu(s.gate_up.view(), s.down.view(), x);
        for t in 0..n {
            let sg = sigmoid(dot(&x[t * h..(t + 1) * h], &s.gate));
            for (o, yi) in out[t * h..(t + 1) * h].iter_mut().zip(&y[t * h..(t + 1) * h]) {
                *o += sg * yi;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_renormalises_the_top_k() {
        let logits = [0.0, 2.0, 1.0, 2.0f32.ln() + 2.0, -5.0];
        let r = route(&logits, 2);
        // Experts 3 (e^{2+ln2} = 2e²) and 1 (e²): weights 2/3 and 1/3 whatever the other logits.
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![3, 1]);
        assert!((r[0].1 - 2.0 / 3.0).abs() < 1e-6 && (r[1].1 - 1.0 / 3.0).abs() < 1e-6, "{r:?}");
        let all = route(&logits, 5);
        assert!((all.iter().map(|x| x.1).sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(all[4].0, 4);
    }

    #[test]
    fn swiglu_hand_computed() {
        // I = 1, H = 2: g = x0, u = x1; down = [[1], [2]].
        let gu = [1.0, 0.0, 0.0, 1.0];
        let down = [1.0, 2.0];
        let y = swiglu(MatRef { rows: 2, cols: 2, data: &gu }, MatRef { rows: 2, cols: 1, data: &down }, &[2.0, 3.0]);
        let m = silu(2.0) * 3.0;
        assert!((y[0] - m).abs() < 1e-6 && (y[1] - 2.0 * m).abs() < 1e-6, "{y:?}");
    }
}
