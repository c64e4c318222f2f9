//! Random encoded matrices (docs/format.md section 3) for the matrix kernels: host parts,
//! their CPU dequantisation, and device copies viewed as `MatrixView`.

use std::sync::Arc;

use ninfer_kernels::cudarc::driver::{CudaSlice, CudaStream};
use ninfer_kernels::{bf16, f16, MatrixView, Weights};

use crate::common::*;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Enc {
    Bf16,
    Q8,
    Q6,
    Q4,
    Nvfp4,
}

pub const ALL_ENCS: [Enc; 5] = [Enc::Bf16, Enc::Q8, Enc::Q6, Enc::Q4, Enc::Nvfp4];

enum Host {
    Bf16(Vec<bf16>),
    Q8(Vec<i8>, Vec<f16>),
    Q6(Vec<u8>, Vec<u8>, Vec<f16>),
    Q4(Vec<u8>, Vec<f16>),
    Nvfp4(Vec<u8>, Vec<u8>, Vec<f32>, usize),
}

pub struct HostMat {
    host: Host,
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
}

enum Dev {
    Bf16(CudaSlice<bf16>),
    Q8(CudaSlice<i8>, CudaSlice<f16>),
    Q6(CudaSlice<u8>, CudaSlice<u8>, CudaSlice<f16>),
    Q4(CudaSlice<u8>, CudaSlice<f16>),
    Nvfp4(CudaSlice<u8>, CudaSlice<u8>, CudaSlice<f32>, usize),
}

pub struct DevMat {
    dev: Dev,
    experts: usize,
    rows: usize,
    cols: usize,
}

/// A random E4M3 block scale between 2^-2 and 2^2 (never NaN).
fn e4m3_scale(rng: &mut Rng) -> u8 {
    let e = 5 + rng.below(4) as u8;
    (e << 3) | rng.below(8) as u8
}

impl HostMat {
    pub fn random(
        enc: Enc,
        experts: usize,
        rows: usize,
        cols: usize,
        segments: usize,
        rng: &mut Rng,
    ) -> Self {
        let n = experts * rows * cols;
        let sd = 1.0 / (cols as f32).sqrt();
        let host = match enc {
            Enc::Bf16 => Host::Bf16(rng.bf16s(n, sd)),
            Enc::Q8 => Host::Q8(
                (0..n)
                    .map(|_| (rng.below(255) as i32 - 127) as i8)
                    .collect(),
                rng.f16_scales(n / 32, 0.2 * sd / 64.0, 2.0 * sd / 64.0),
            ),
            Enc::Q6 => Host::Q6(
                rng.bytes(n / 2),
                rng.bytes(n / 4),
                rng.f16_scales(n / 64, 0.2 * sd / 16.0, 2.0 * sd / 16.0),
            ),
            Enc::Q4 => Host::Q4(
                rng.bytes(n / 2),
                rng.f16_scales(n / 32, 0.2 * sd / 4.0, 2.0 * sd / 4.0),
            ),
            Enc::Nvfp4 => Host::Nvfp4(
                rng.bytes(n / 2),
                (0..n / 16).map(|_| e4m3_scale(rng)).collect(),
                (0..experts * segments)
                    .map(|_| sd * (0.1 + 0.4 * rng.uniform() as f32))
                    .collect(),
                segments,
            ),
        };
        HostMat {
            host,
            experts,
            rows,
            cols,
        }
    }

    /// Every element of expert `e`, `[rows, cols]`, decoded per format.md.
    pub fn dequant_expert(&self, e: usize) -> Vec<f32> {
        let (n, k) = (self.rows, self.cols);
        let mut out = vec![0f32; n * k];
        for r in e * n..(e + 1) * n {
            for c in 0..k {
                let i = r * k + c;
                out[i - e * n * k] = match &self.host {
                    Host::Bf16(d) => d[i].to_f32(),
                    Host::Q8(q, s) => q[i] as f32 * s[r * (k / 32) + c / 32].to_f32(),
                    Host::Q6(ql, qh, s) => {
                        let lo = (ql[i / 2] >> (4 * (i % 2))) & 0xf;
                        let hi = (qh[i / 4] >> (2 * (i % 4))) & 3;
                        ((lo | (hi << 4)) as f32 - 32.0) * s[r * (k / 64) + c / 64].to_f32()
                    }
                    Host::Q4(q, s) => {
                        let u = (q[i / 2] >> (4 * (i % 2))) & 0xf;
                        (u as f32 - 8.0) * s[r * (k / 32) + c / 32].to_f32()
                    }
                    Host::Nvfp4(codes, scales, global, p) => {
                        let code = (codes[i / 2] >> (4 * (i % 2))) & 0xf;
                        let seg = (r % n) / (n / p);
                        e2m1(code) * e4m3(scales[r * (k / 16) + c / 16]) * global[e * p + seg]
                    }
                };
            }
        }
        out
    }

    pub fn upload(&self, s: &Arc<CudaStream>) -> DevMat {
        let dev = match &self.host {
            Host::Bf16(d) => Dev::Bf16(up(s, d)),
            Host::Q8(q, sc) => Dev::Q8(up(s, q), up(s, sc)),
            Host::Q6(ql, qh, sc) => Dev::Q6(up(s, ql), up(s, qh), up(s, sc)),
            Host::Q4(q, sc) => Dev::Q4(up(s, q), up(s, sc)),
            Host::Nvfp4(c, sc, g, p) => {
                // The kernels read codes in the device layout, as the engine uploads them.
                let mut codes = up(s, c);
                gpu().expect("a GPU uploads").ks.nvfp4_device_layout(s, &mut codes).expect("device layout");
                Dev::Nvfp4(codes, up(s, sc), up(s, g), *p)
            }
        };
        DevMat {
            dev,
            experts: self.experts,
            rows: self.rows,
            cols: self.cols,
        }
    }
}

impl DevMat {
    pub fn view(&self) -> MatrixView<'_> {
        let weights = match &self.dev {
            Dev::Bf16(d) => Weights::Bf16 { data: d.slice(..) },
            Dev::Q8(q, s) => Weights::Q8G32 {
                q: q.slice(..),
                scales: s.slice(..),
            },
            Dev::Q6(ql, qh, s) => Weights::Q6G64 {
                ql: ql.slice(..),
                qh: qh.slice(..),
                scales: s.slice(..),
            },
            Dev::Q4(q, s) => Weights::Q4G32 {
                q: q.slice(..),
                scales: s.slice(..),
            },
            Dev::Nvfp4(c, s, g, p) => Weights::Nvfp4 {
                codes: c.slice(..),
                scales: s.slice(..),
                global: g.slice(..),
                segments: *p,
            },
        };
        MatrixView {
            weights,
            experts: self.experts,
            rows: self.rows,
            cols: self.cols,
        }
    }
}

/// `x [b, k] . W [n, k]^T` in f64, rounded to f32, for one matrix `w` of `n` rows.
pub fn matvec(w: &[f32], n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    let b = x.len() / k;
    let mut y = vec![0f32; b * n];
    for bi in 0..b {
        for r in 0..n {
            let row = &w[r * k..(r + 1) * k];
            let acc: f64 = row
                .iter()
                .zip(&x[bi * k..(bi + 1) * k])
                .map(|(&a, &c)| a as f64 * c as f64)
                .sum();
            y[bi * n + r] = acc as f32;
        }
    }
    y
}
