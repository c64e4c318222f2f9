//! gemv.cu: small-batch matrix-vector products over every encoding.

use ninfer_kernels::{bf16, GEMV_MAX_BATCH};

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
}
