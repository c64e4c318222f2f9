//! Numeric building blocks of the CPU reference: y = x·Wᵀ over row-major `[out, in]` weights,
//! the two RMSNorms of model-spec.md §2.1 and the scalar activations. Every dot product goes
//! through [`dot`], so a row computes the same value whatever batch it is part of (prefill and
//! decode differ only where the math differs, not by summation order).

use rayon::prelude::*;

/// An owned row-major matrix `[rows, cols]`; as a linear layer, rows = out and cols = in.
#[derive(Debug, Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

/// A borrowed row-major matrix (one expert of a bank, or a [`Matrix`]).
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [f32],
}

impl Matrix {
    pub fn view(&self) -> MatRef<'_> {
        MatRef { rows: self.rows, cols: self.cols, data: &self.data }
    }

    /// y = x·Wᵀ, see [`MatRef::apply`].
    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        self.view().apply(x)
    }

    /// Row `r` (an embedding lookup).
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// Output rows computed together: one block of weight rows stays in cache while every input
/// row passes over it.
const ROW_BLOCK: usize = 16;
/// Below this many multiply-adds a matmul runs on the calling thread.
const PAR_MIN_WORK: usize = 1 << 16;

impl MatRef<'_> {
    /// y = x·Wᵀ for `n = x.len() / cols` input rows; returns `n × rows`, row-major.
    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        assert_eq!(x.len() % self.cols.max(1), 0, "input length {} is not a multiple of {}", x.len(), self.cols);
        let n = x.len().checked_div(self.cols).unwrap_or(0);
        if n == 0 || self.rows == 0 {
            return vec![0.0; n * self.rows];
        }
        // Computed transposed ([rows, n]) so that each parallel task owns whole weight rows.
        let mut yt = vec![0f32; self.rows * n];
        let block = |(b, out): (usize, &mut [f32])| {
            let r0 = b * ROW_BLOCK;
            let nr = out.len() / n;
            for t in 0..n {
                let xt = &x[t * self.cols..(t + 1) * self.cols];
                for i in 0..nr {
                    let w = &self.data[(r0 + i) * self.cols..(r0 + i + 1) * self.cols];
                    out[i * n + t] = dot(w, xt);
                }
            }
        };
        if self.rows * self.cols * n < PAR_MIN_WORK {
            yt.chunks_mut(ROW_BLOCK * n).enumerate().for_each(block);
        } else {
            yt.par_chunks_mut(ROW_BLOCK * n).enumerate().for_each(block);
        }
        if n == 1 {
            return yt;
        }
        let mut y = vec![0f32; n * self.rows];
        for r in 0..self.rows {
            for t in 0..n {
                y[t * self.rows + r] = yt[r * n + t];
            }
        }
        y
    }
}

/// Dot product with eight independent accumulators (vectorizes; fixed summation order).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `y += a·x`.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// Zero-centred RMSNorm (model-spec.md §2.1) in place over every `w.len()`-wide row of `x`:
/// y = x / sqrt(mean(x²) + ε) ⊙ (1 + w).
pub fn rms_norm_zc(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for row in x.chunks_exact_mut(d) {
        let inv = 1.0 / (dot(row, row) / d as f32 + eps).sqrt();
        for (v, wi) in row.iter_mut().zip(w) {
            *v = *v * inv * (1.0 + wi);
        }
    }
}

/// Gated RMSNorm of the GDN output (model-spec.md §2.1), in place over every `w.len()`-wide row
/// of `x` with the matching row of `z`: y = x / sqrt(mean(x²) + ε) · w · SiLU(z), plain weight.
pub fn rms_norm_gated(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let d = w.len();
    for (row, zr) in x.chunks_exact_mut(d).zip(z.chunks_exact(d)) {
        let inv = 1.0 / (dot(row, row) / d as f32 + eps).sqrt();
        for ((v, wi), zi) in row.iter_mut().zip(w).zip(zr) {
            *v = *v * inv * wi * silu(*zi);
        }
    }
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// softplus with PyTorch's default threshold (x > 20 returns x), as the reference computes it.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Numerically stable softmax in place.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_matches_naive_for_every_batch_size() {
        let (rows, cols) = (37, 29);
        let w = Matrix { rows, cols, data: (0..rows * cols).map(|i| ((i * 7919 % 113) as f32 - 56.0) / 31.0).collect() };
        for n in [1usize, 2, 5] {
            let x: Vec<f32> = (0..n * cols).map(|i| ((i * 31 % 17) as f32 - 8.0) / 5.0).collect();
            let y = w.apply(&x);
            assert_eq!(y.len(), n * rows);
            for t in 0..n {
                for r in 0..rows {
                    let want: f64 = (0..cols).map(|c| w.data[r * cols + c] as f64 * x[t * cols + c] as f64).sum();
                    assert!((y[t * rows + r] as f64 - want).abs() < 1e-4, "n {n} t {t} r {r}");
                }
                // A row's result does not depend on the batch it is in.
                assert_eq!(&y[t * rows..(t + 1) * rows], &w.apply(&x[t * cols..(t + 1) * cols])[..]);
            }
        }
        // Large enough to take the parallel path.
        let big = Matrix { rows: 300, cols: 256, data: (0..300 * 256).map(|i| (i % 13) as f32 - 6.0).collect() };
        let x: Vec<f32> = (0..3 * 256).map(|i| (i % 5) as f32 - 2.0).collect();
        let y = big.apply(&x);
        for t in 0..3 {
            assert_eq!(&y[t * 300..(t + 1) * 300], &big.apply(&x[t * 256..(t + 1) * 256])[..]);
        }
    }

    #[test]
    fn norms_hand_computed() {
        // x = [3, 4]: mean(x²) = 12.5, 1/sqrt(12.5) = 0.28284.
        let mut x = vec![3.0, 4.0];
        rms_norm_zc(&mut x, &[0.0, 1.0], 0.0);
        let s = 1.0 / 12.5f32.sqrt();
        assert!((x[0] - 3.0 * s).abs() < 1e-6 && (x[1] - 8.0 * s).abs() < 1e-6, "{x:?}");
        let mut g = vec![3.0, 4.0];
        rms_norm_gated(&mut g, &[0.0, 2.0], &[1.0, 0.5], 0.0);
        assert_eq!(g[0], 0.0, "SiLU(0) = 0 gates the element off");
        assert!((g[1] - 4.0 * s * 0.5 * silu(2.0)).abs() < 1e-6);
    }

    #[test]
    fn activations() {
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-7);
        assert_eq!(softplus(30.0), 30.0);
        assert!((silu(1.0) - 0.7310586).abs() < 1e-6);
        let mut p = vec![1.0, 2.0, 3.0];
        softmax(&mut p);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6 && p[2] > p[1] && p[1] > p[0]);
        assert!((p[2] / p[1] - std::f32::consts::E).abs() < 1e-5);
    }
}
