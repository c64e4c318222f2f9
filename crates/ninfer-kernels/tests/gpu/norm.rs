//! norm.cu: zero-centred RMSNorm, the fused residual add, the gated GDN norm.

use ninfer_kernels::Rows;

use crate::common::*;

const EPS: f32 = 1e-6;

fn ref_norm(x: &[f32], w: &[f32], dim: usize) -> Vec<f32> {
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks(dim) {
        let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dim as f64;
        let inv = 1.0 / (ms + EPS as f64).sqrt();
        y.extend(
            row.iter()
                .zip(w)
                .map(|(&v, &wi)| bf((v as f64 * inv * (1.0 + wi as f64)) as f32)),
        );
    }
    y
}

#[test]
fn rms_norm_matches_reference() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(1);
    for &(rows, dim) in &[(1, 2048), (3, 8), (37, 264), (5, 128)] {
        let x = rng.bf16s(rows * dim, 3.0);
        let w = rng.bf16s(dim, 0.5);
        let (dx, dw) = (up(&s, &x), up(&s, &w));
        let mut dy = nan_bf16(&s, rows * dim);
        let r = Rows::dense(rows, dim);
        g.ks.rms_norm(&s, &dx, r, &dw, &mut dy, r, EPS).unwrap();
        let want = ref_norm(&to_f32(&x), &to_f32(&w), dim);
        assert_close(
            &format!("rms_norm {rows}x{dim}"),
            &to_f32(&down(&s, &dy)),
            &want,
            1e-2,
        );
    }
}

#[test]
fn rms_norm_in_place_on_strided_heads() {
    // The q_proj layout: per head `dim` query values then `dim` gate values; only the query
    // halves are normed, the gate halves must come back bit for bit.
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(2);
    let (rows, dim) = (6 * 3, 64);
    let x = rng.bf16s(rows * 2 * dim, 2.0);
    let w = rng.bf16s(dim, 0.3);
    let mut dx = up(&s, &x);
    let dw = up(&s, &w);
    g.ks.rms_norm_in_place(
        &s,
        &mut dx,
        Rows {
            rows,
            dim,
            ld: 2 * dim,
        },
        &dw,
        EPS,
    )
    .unwrap();
    let got = down(&s, &dx);
    let xf = to_f32(&x);
    let mut q_in = Vec::new();
    let mut q_got = Vec::new();
    for r in 0..rows {
        q_in.extend_from_slice(&xf[r * 2 * dim..r * 2 * dim + dim]);
        q_got.extend(
            got[r * 2 * dim..r * 2 * dim + dim]
                .iter()
                .map(|v| v.to_f32()),
        );
        assert_eq!(
            &got[r * 2 * dim + dim..(r + 1) * 2 * dim],
            &x[r * 2 * dim + dim..(r + 1) * 2 * dim]
        );
    }
    assert_close(
        "rms_norm strided in place",
        &q_got,
        &ref_norm(&q_in, &to_f32(&w), dim),
        1e-2,
    );
}

#[test]
fn add_rms_norm_updates_residual_and_norms() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(3);
    for &(rows, dim) in &[(1, 2048), (9, 72)] {
        let h = rng.bf16s(rows * dim, 4.0);
        let d = rng.bf16s(rows * dim, 1.0);
        let w = rng.bf16s(dim, 0.5);
        let mut dh = up(&s, &h);
        let (dd, dw) = (up(&s, &d), up(&s, &w));
        let mut dy = nan_bf16(&s, rows * dim);
        let r = Rows::dense(rows, dim);
        g.ks.add_rms_norm(&s, &mut dh, &dd, r, &dw, &mut dy, r, EPS)
            .unwrap();
        let h_want: Vec<f32> = h
            .iter()
            .zip(&d)
            .map(|(a, b)| bf(a.to_f32() + b.to_f32()))
            .collect();
        let h_got = to_f32(&down(&s, &dh));
        assert_eq!(h_got, h_want, "residual add in bf16");
        let want = ref_norm(&h_want, &to_f32(&w), dim);
        assert_close(
            &format!("add_rms_norm {rows}x{dim}"),
            &to_f32(&down(&s, &dy)),
            &want,
            1e-2,
        );
    }
}

#[test]
fn gated_rms_norm_matches_reference() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(4);
    // (rows, dim, z group, z stride): dense z, and z inside wider token rows (the stacked GDN
    // projection: a token's 4 heads of 32 every 200 elements).
    for &(rows, dim, group, ldg) in &[(32, 128, 1, 128), (7, 32, 1, 32), (12, 32, 4, 200)] {
        let x = rng.bf16s(rows * dim, 0.7);
        let z = rng.bf16s((rows / group - 1) * ldg + group * dim, 2.0);
        let w = rng.bf16s(dim, 1.0);
        let (dx, dz, dw) = (up(&s, &x), up(&s, &z), up(&s, &w));
        let mut dy = nan_bf16(&s, rows * dim);
        g.ks.gated_rms_norm(&s, &dx, &dz, group, ldg, &dw, &mut dy, rows, dim, EPS)
            .unwrap();
        let (xf, zf, wf) = (to_f32(&x), to_f32(&z), to_f32(&w));
        let mut want = Vec::new();
        for r in 0..rows {
            let row = &xf[r * dim..(r + 1) * dim];
            let zr = (r / group) * ldg + (r % group) * dim;
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + EPS as f64).sqrt();
            for i in 0..dim {
                let n = bf((row[i] as f64 * inv) as f32);
                let m = bf(n * wf[i]);
                want.push(bf((m as f64 * silu(zf[zr + i] as f64)) as f32));
            }
        }
        assert_close(
            &format!("gated_rms_norm {rows}x{dim} z groups of {group} every {ldg}"),
            &to_f32(&down(&s, &dy)),
            &want,
            1e-2,
        );
    }
}

#[test]
fn norm_rejects_bad_shapes() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let x = up(&s, &[bf16_zero(); 100]);
    let w = up(&s, &[bf16_zero(); 12]);
    let mut y = nan_bf16(&s, 100);
    // dim 12 is not a multiple of 8
    let r = Rows::dense(8, 12);
    assert!(g.ks.rms_norm(&s, &x, r, &w, &mut y, r, EPS).is_err());
    // y too short for 20 rows of 8
    let r = Rows::dense(20, 8);
    assert!(g
        .ks
        .rms_norm(&s, &x, Rows::dense(12, 8), &w, &mut y, r, EPS)
        .is_err());
    // misaligned start (one element in)
    let xv = x.slice(1..);
    let r = Rows::dense(4, 8);
    assert!(g.ks.rms_norm(&s, &xv, r, &w, &mut y, r, EPS).is_err());
}

fn bf16_zero() -> ninfer_kernels::bf16 {
    ninfer_kernels::bf16::ZERO
}
