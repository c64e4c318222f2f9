//! gemv.cu: small-batch matrix-vector products over every encoding.

use ninfer_kernels::{bf16, Rows, GEMV_MAX_BATCH};

use crate::common::*;
use crate::mats::*;

fn run_case(enc: Enc, n: usize, k: usize, batch: usize, ldx: usize, segments: usize, seed: u64) {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(seed);
    let m = HostMat::random(enc, 1, n, k, segments, &mut rng);
    let dm = m.upload(&s);
    let mut x = rng.bf16s(batch * ldx, 1.0);
    for b in 0..batch {
        for c in k..ldx {
            x[b * ldx + c] = bf16::NAN; // padding past K must never be read
        }
    }
    let xs: Vec<f32> = (0..batch)
        .flat_map(|b| to_f32(&x[b * ldx..b * ldx + k]))
        .collect();
    let want = matvec(&m.dequant_expert(0), n, k, &xs);
    let dx = up(&s, &x);
    let name = format!("gemv {enc:?} n={n} k={k} b={batch} segments={segments}");

    let mut y32 = nan_f32(&s, batch * n);
    g.ks.gemv(&s, &dm.view(), &dx, batch, ldx, &mut y32, n)
        .unwrap();
    assert_close(&format!("{name} f32"), &down(&s, &y32), &want, 1e-4);

    // bf16 output into a wider buffer (ldy > n): the gap stays untouched.
    let ldy = n + 8;
    let mut y16 = nan_bf16(&s, batch * ldy);
    g.ks.gemv(&s, &dm.view(), &dx, batch, ldx, &mut y16, ldy)
        .unwrap();
    let got = down(&s, &y16);
    let mut packed = Vec::new();
    for b in 0..batch {
        packed.extend(to_f32(&got[b * ldy..b * ldy + n]));
        assert!(
            got[b * ldy + n..(b + 1) * ldy].iter().all(|v| v.is_nan()),
            "{name}: wrote past n"
        );
    }
    let want16: Vec<f32> = want.iter().map(|&v| bf(v)).collect();
    assert_close(&format!("{name} bf16"), &packed, &want16, 1e-2);
}

#[test]
fn gemv_all_encodings_small_shapes() {
    for (i, enc) in ALL_ENCS.into_iter().enumerate() {
        // Few chunks per row, 37 rows: neither a multiple of the lanes nor of the 8 rows a block.
        run_case(enc, 37, 192, 1, 192, 1, 10 + i as u64);
        run_case(enc, 5, 64 * 37, 3, 64 * 37 + 16, 1, 20 + i as u64);
        // A batch for the tensor-core kernels (q8_g32): 37 rows, 6 groups over 4 warps.
        run_case(enc, 37, 192, 9, 200, 1, 30 + i as u64);
    }
    // One q8_g32 row of K % 256 == 0 takes the bulk-copy kernel: more stages per block than it
    // keeps in flight, x padded with NaN past K.
    run_case(Enc::Q8, 12_357, 2048, 1, 2064, 1, 40);
    run_case(Enc::Q8, 3001, 4096, 1, 4096, 1, 41);
    // Batches of them: 2-8 and 9-16 rows, K = 4096 and 16 rows (one stage in flight).
    run_case(Enc::Q8, 12_357, 2048, 4, 2064, 1, 42);
    run_case(Enc::Q8, 3001, 4096, 16, 4096, 1, 43);
    run_case(Enc::Q8, 2048, 4096, 7, 4104, 1, 44);
}

/// More rows than the device holds warps at once: each warp streams several rows (RowStream),
/// with row ends at every chunk count per lane (192 columns: 3 to 24 chunks, fewer than the
/// lanes; 2048: 2 to 8 per lane).
#[test]
fn gemv_streams_more_rows_than_resident_warps() {
    for (i, enc) in ALL_ENCS.into_iter().enumerate() {
        for (j, &batch) in [1usize, 2, 16].iter().enumerate() {
            run_case(enc, 20011, 192, batch, 192, 1, 300 + 10 * i as u64 + j as u64);
        }
        run_case(enc, 9001, 2048, 1, 2048, 1, 350 + i as u64);
    }
}

#[test]
fn gemv_all_encodings_decode_shapes_and_batches() {
    for (i, enc) in ALL_ENCS.into_iter().enumerate() {
        for (j, &batch) in [1usize, 2, 4, 7, 16].iter().enumerate() {
            run_case(
                enc,
                300,
                2048,
                batch,
                2048,
                1,
                100 + 10 * i as u64 + j as u64,
            );
        }
        run_case(enc, 129, 4096, 5, 4096, 1, 200 + i as u64);
    }
}

#[test]
fn gemv_nvfp4_segment_globals() {
    // Two segments: rows 0..n/2 and n/2..n carry different global multipliers.
    run_case(Enc::Nvfp4, 64, 512, 2, 512, 2, 300);
    run_case(Enc::Nvfp4, 1024, 2048, 1, 2048, 2, 301);
}

#[test]
fn gemv_rejects_bad_arguments() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(5);
    let dm = HostMat::random(Enc::Q4, 1, 16, 64, 1, &mut rng).upload(&s);
    let x = up(&s, &rng.bf16s(17 * 64, 1.0));
    let mut y = nan_f32(&s, 17 * 16);
    assert!(g
        .ks
        .gemv(&s, &dm.view(), &x, GEMV_MAX_BATCH + 1, 64, &mut y, 16)
        .is_err());
    assert!(
        g.ks.gemv(&s, &dm.view(), &x, 2, 60, &mut y, 16).is_err(),
        "ldx < cols"
    );
    let xv = x.slice(4..);
    assert!(
        g.ks.gemv(&s, &dm.view(), &xv, 1, 64, &mut y, 16).is_err(),
        "misaligned x"
    );
    let bad = HostMat::random(Enc::Q4, 1, 16, 48, 1, &mut rng).upload(&s);
    assert!(
        g.ks.gemv(&s, &bad.view(), &x, 1, 64, &mut y, 16).is_err(),
        "cols not a multiple of 32"
    );
    let q6 = HostMat::random(Enc::Q6, 1, 16, 16384, 1, &mut rng).upload(&s);
    let x4 = up(&s, &rng.bf16s(4 * 16384, 1.0));
    let mut y4 = nan_f32(&s, 4 * 16);
    assert!(
        g.ks.gemv(&s, &q6.view(), &x4, 3, 16384, &mut y4, 16).is_err(),
        "3 rows of 16,384: past the q6_g64 kernel's shared memory"
    );
}

/// The normed product of `batch` rows against the two launches it replaces (the same bits) and
/// against the CPU.
fn norm_case(enc: Enc, n: usize, k: usize, batch: usize, seed: u64) {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(seed);
    let m = HostMat::random(enc, 1, n, k, 1, &mut rng);
    let dm = m.upload(&s);
    let (x, w) = (rng.bf16s(batch * k, 2.0), rng.bf16s(k, 0.1));
    let (dx, dw) = (up(&s, &x), up(&s, &w));
    let eps = 1e-6f32;
    let name = format!("gemv_norm {enc:?} n={n} k={k} batch={batch}");
    // y rows wider than n: the stride is honoured and the gap left alone.
    let ldy = n + 3;

    let rows = Rows::dense(batch, k);
    let mut a_two = nan_bf16(&s, batch * k);
    g.ks.rms_norm(&s, &dx, rows, &dw, &mut a_two, rows, eps).unwrap();
    let mut y_two = nan_f32(&s, batch * ldy);
    g.ks.gemv(&s, &dm.view(), &a_two, batch, k, &mut y_two, ldy).unwrap();

    let mut a_one = nan_bf16(&s, batch * k);
    let mut y_one = nan_f32(&s, batch * ldy);
    g.ks.gemv_norm(&s, &dm.view(), &dx, (batch, ldy), (&dw, eps), &mut y_one, Some(&mut a_one.slice_mut(..))).unwrap();
    let (y_two, y_one) = (down(&s, &y_two), down(&s, &y_one));
    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    // q8_g32 rows of K % 256 == 0 (a batch's: K <= 4096) run the bulk-copy kernels on the
    // tensor cores: their sums in another order than the other products'.
    let bulk = enc == Enc::Q8 && k.is_multiple_of(256) && (batch == 1 || k <= 4096);
    if bulk {
        let dense = |v: &[f32]| (0..batch).flat_map(|b| v[b * ldy..b * ldy + n].to_vec()).collect::<Vec<_>>();
        assert_close(&format!("{name} vs norm + gemv"), &dense(&y_one), &dense(&y_two), 1e-5);
    } else {
        assert_eq!(bits(&y_one), bits(&y_two), "{name}: y differs from norm + gemv");
    }
    assert_eq!(down(&s, &a_one), down(&s, &a_two), "{name}: a differs from the norm kernel's");

    // CPU: a = bf16(x / rms(x) * (1 + w)), y = a . W, row by row; the gaps stay NaN.
    let dense = m.dequant_expert(0);
    for b in 0..batch {
        let row = &y_one[b * ldy..(b + 1) * ldy];
        assert!(row[..n].iter().all(|v| v.is_finite()), "{name}: non-finite output in row {b}");
        assert!(row[n..].iter().all(|v| v.is_nan()), "{name}: row {b} written past n");
        let xf = to_f32(&x[b * k..(b + 1) * k]);
        let ms = xf.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / k as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        let a: Vec<f32> = xf.iter().zip(to_f32(&w)).map(|(&v, wv)| bf((v as f64 * inv * (1.0 + wv as f64)) as f32)).collect();
        assert_close(&format!("{name} row {b} vs CPU"), &row[..n], &matvec(&dense, n, k, &a), 1e-3);
    }

    // Without a_out, and into bf16.
    let mut y16 = nan_bf16(&s, batch * ldy);
    g.ks.gemv_norm(&s, &dm.view(), &dx, (batch, ldy), (&dw, eps), &mut y16, None).unwrap();
    let got16 = to_f32(&down(&s, &y16));
    for b in 0..batch {
        let want16: Vec<f32> = y_one[b * ldy..b * ldy + n].iter().map(|&v| bf(v)).collect();
        assert_eq!(got16[b * ldy..b * ldy + n], want16[..], "{name}: bf16 output, row {b}");
    }
}

#[test]
fn gemv_norm_equals_norm_then_gemv() {
    for (i, enc) in [Enc::Bf16, Enc::Q8].into_iter().enumerate() {
        for (j, batch) in [1usize, 2, 5, 8, 9, 16].into_iter().enumerate() {
            let seed = 600 + 10 * i as u64 + 100 * j as u64;
            norm_case(enc, 300, 2048, batch, seed);
            norm_case(enc, 37, 192, batch, seed + 1);
            norm_case(enc, 20011, 256, batch, seed + 2);
        }
    }
    // One q8_g32 row by bulk copies with more stages per block than in flight (K = 2048: 4,
    // K = 4096: 2), the last block's last stage partial.
    norm_case(Enc::Q8, 12357, 2048, 1, 681);
    norm_case(Enc::Q8, 6003, 4096, 1, 682);
    // Batches of them the same way, the rows at the start of the shared memory (K = 4096 and 8
    // rows: one stage in flight), and a batch of 4,352 columns on the tensor-core kernel.
    norm_case(Enc::Q8, 12357, 2048, 3, 683);
    norm_case(Enc::Q8, 12357, 2048, 16, 684);
    norm_case(Enc::Q8, 6003, 4096, 8, 685);
    norm_case(Enc::Q8, 301, 4352, 7, 686);
}

/// The product added into a bf16 residual: y = bf16(y + bf16(x . W)), SIMT and tensor-core rows.
#[test]
fn gemv_add_accumulates_in_bf16() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    for (i, enc) in ALL_ENCS.into_iter().enumerate() {
        for batch in [1usize, 3, 16] {
            let mut rng = Rng::new(700 + 10 * i as u64 + batch as u64);
            let (n, k) = (70, 256);
            let m = HostMat::random(enc, 1, n, k, 1, &mut rng);
            let x = rng.bf16s(batch * k, 1.0);
            let resid = rng.bf16s(batch * n, 2.0);
            let prod = matvec(&m.dequant_expert(0), n, k, &to_f32(&x));
            let want: Vec<f32> = resid.iter().zip(&prod).map(|(r, &p)| bf(r.to_f32() + bf(p))).collect();
            let mut y = up(&s, &resid);
            g.ks.gemv_add(&s, &m.upload(&s).view(), &up(&s, &x), batch, k, &mut y, n).unwrap();
            assert_close(&format!("gemv_add {enc:?} b={batch}"), &to_f32(&down(&s, &y)), &want, 1e-2);
        }
    }
}
