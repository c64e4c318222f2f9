//! fused.cu: the products with their neighbouring launches folded in, against those launches
//! (the same bits) and against the CPU.

use ninfer_kernels::{bf16, ConvTail, SeqSlots};

use crate::common::*;
use crate::mats::*;

/// gemv_norm_conv of `batch` rows (each a one-token sequence) against gemv_norm then gdn_conv on
/// the product's rows lo..lo + C.
fn norm_conv_case(enc: Enc, (lo, ch, tail): (usize, usize, usize), k: usize, batch: usize, seed: u64) {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(seed);
    let n = lo + ch + tail;
    let m = HostMat::random(enc, 1, n, k, 1, &mut rng);
    let dm = m.upload(&s);
    // Row b's sequence holds slot batch - b: slot 0 belongs to no row.
    let slots = batch + 1;
    let (x, nw) = (rng.bf16s(batch * k, 2.0), rng.bf16s(k, 0.1));
    let (cw, state) = (rng.bf16s(ch * 4, 0.5), rng.bf16s(slots * 3 * ch, 1.0));
    let (dx, dnw, dcw) = (up(&s, &x), up(&s, &nw), up(&s, &cw));
    let slot = up(&s, &(0..batch).map(|b| (batch - b) as i32).collect::<Vec<_>>());
    let cu = up(&s, &(0..=batch as i32).collect::<Vec<_>>());
    let eps = 1e-6f32;
    let name = format!("gemv_norm_conv {enc:?} n={n} k={k} lo={lo} C={ch} batch={batch}");

    let mut y_two = nan_bf16(&s, batch * n);
    let mut a_two = nan_bf16(&s, batch * k);
    g.ks.gemv_norm(&s, &dm.view(), &dx, (batch, n), (&dnw, eps), &mut y_two, Some(&mut a_two.slice_mut(..))).unwrap();
    let mut st_two = up(&s, &state);
    let mut cy_two = nan_bf16(&s, batch * ch);
    let seqs = SeqSlots { seqs: batch, tokens: batch, cu: cu.slice(..), slots: slot.slice(..) };
    g.ks.gdn_conv(&s, &y_two.slice(lo..), n, &dcw, ch, &mut st_two, slots, &seqs, &mut cy_two, ch).unwrap();

    let mut y_one = nan_bf16(&s, batch * n);
    let mut a_one = nan_bf16(&s, batch * k);
    let mut st_one = up(&s, &state);
    let mut cy_one = nan_bf16(&s, batch * ch);
    let tail_args = ConvTail { w: dcw.slice(..), state: &mut st_one, slot: slot.slice(..), y: &mut cy_one.slice_mut(..), lo };
    g.ks.gemv_norm_conv(&s, &dm.view(), &dx, batch, (&dnw, eps), &mut y_one, Some(&mut a_one.slice_mut(..)), tail_args).unwrap();

    let conv = down(&s, &cy_one);
    assert!(conv.iter().all(|v| v.to_f32().is_finite()), "{name}: non-finite conv output");
    assert_eq!(down(&s, &y_one), down(&s, &y_two), "{name}: y differs from gemv_norm");
    assert_eq!(down(&s, &a_one), down(&s, &a_two), "{name}: a differs from gemv_norm");
    assert_eq!(conv, down(&s, &cy_two), "{name}: conv output differs from gdn_conv");
    let st = down(&s, &st_one);
    assert_eq!(st, down(&s, &st_two), "{name}: conv state differs from gdn_conv");
    assert_ne!(st[3 * ch..], state[3 * ch..], "{name}: the rows' states did not move");
    assert_eq!(st[..3 * ch], state[..3 * ch], "{name}: the slot of no row changed");
}

#[test]
fn gemv_norm_conv_equals_norm_gemv_then_conv() {
    for (i, enc) in [Enc::Bf16, Enc::Q8].into_iter().enumerate() {
        for (j, batch) in [1usize, 4, 8, 11, 16].into_iter().enumerate() {
            let seed = 900 + i as u64 + 20 * j as u64;
            norm_conv_case(enc, (64, 192, 16), 256, batch, seed);
            norm_conv_case(enc, (0, 120, 0), 2048, batch, seed + 10);
            // More rows than resident warps: the conv rows in the middle of a warp's rows;
            // for a batch, conv rows starting and ending inside a block's 16-row tile.
            norm_conv_case(enc, (7000, 8192, 9000), 256, batch, seed + 15);
            norm_conv_case(enc, (40, 72, 5), 128, batch, seed + 17);
        }
    }
    // One q8_g32 row of the model's shape takes its weights by bulk copies: more stages per
    // block than it keeps in flight, the conv rows starting and ending inside stages.
    norm_conv_case(Enc::Q8, (3003, 6000, 4005), 2048, 1, 990);
    // A decode batch of that shape on the bulk-copy kernel of 2-8 rows and the tensor-core one
    // of 9-16.
    norm_conv_case(Enc::Q8, (3003, 6000, 4005), 2048, 4, 991);
    norm_conv_case(Enc::Q8, (3003, 6000, 4005), 2048, 13, 992);
}

/// gemv_gnorm of `batch` rows (their gates `ldz` apart, NaN between) against gated_rms_norm then
/// gemv (or gemv_add), and against the CPU.
fn gnorm_case(enc: Enc, n: usize, (heads, dim): (usize, usize), batch: usize, seed: u64) {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(seed);
    let k = heads * dim;
    let ldz = k + 16;
    let m = HostMat::random(enc, 1, n, k, 1, &mut rng);
    let dm = m.upload(&s);
    let (x, mut z, nw) = (rng.bf16s(batch * k, 1.0), rng.bf16s(batch * ldz, 1.5), rng.bf16s(dim, 0.5));
    for b in 0..batch {
        z[b * ldz + k..(b + 1) * ldz].fill(bf16::NAN);
    }
    let resid = rng.bf16s(batch * n, 2.0);
    let (dx, dz, dnw) = (up(&s, &x), up(&s, &z), up(&s, &nw));
    let eps = 1e-6f32;
    let name = format!("gemv_gnorm {enc:?} n={n} heads={heads} dim={dim} batch={batch}");

    let mut a = nan_bf16(&s, batch * k);
    g.ks.gated_rms_norm(&s, &dx, &dz, heads, ldz, &dnw, &mut a, batch * heads, dim, eps).unwrap();
    let mut y_two = nan_bf16(&s, batch * n);
    g.ks.gemv(&s, &dm.view(), &a, batch, k, &mut y_two, n).unwrap();
    let mut h_two = up(&s, &resid);
    g.ks.gemv_add(&s, &dm.view(), &a, batch, k, &mut h_two, n).unwrap();

    let mut y_one = nan_bf16(&s, batch * n);
    g.ks.gemv_gnorm(&s, &dm.view(), &dx, (&dz, batch, ldz), (&dnw, dim, eps), &mut y_one, false).unwrap();
    let mut h_one = up(&s, &resid);
    g.ks.gemv_gnorm(&s, &dm.view(), &dx, (&dz, batch, ldz), (&dnw, dim, eps), &mut h_one, true).unwrap();
    let y = to_f32(&down(&s, &y_one));
    assert!(y.iter().all(|v| v.is_finite()), "{name}: non-finite output");
    if batch == 1 && enc == Enc::Q8 && k.is_multiple_of(256) {
        // The bulk-copy kernel on the tensor cores: its sums in another order, then bf16.
        assert_close(&format!("{name} vs gated_rms_norm + gemv"), &y, &to_f32(&down(&s, &y_two)), 5e-3);
        assert_close(&format!("{name} accumulated vs gemv_add"), &to_f32(&down(&s, &h_one)), &to_f32(&down(&s, &h_two)), 5e-3);
    } else {
        // One row's SIMT kernel, and a batch's bulk-copy kernel beside gemv's of the same rows.
        assert_eq!(down(&s, &y_one), down(&s, &y_two), "{name}: y differs from gated_rms_norm + gemv");
        assert_eq!(down(&s, &h_one), down(&s, &h_two), "{name}: accumulated y differs from gated_rms_norm + gemv_add");
    }

    // CPU: per head n = bf16(x / rms), m = bf16(n * w), a = bf16(m * silu(z)), y = a . W.
    let (xf, zf, wf) = (to_f32(&x), to_f32(&z), to_f32(&nw));
    let dense = m.dequant_expert(0);
    for b in 0..batch {
        let mut af = vec![0f32; k];
        for hd in 0..heads {
            let r = &xf[b * k + hd * dim..b * k + (hd + 1) * dim];
            let ms = r.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            for i in 0..dim {
                let nrm = bf((r[i] as f64 * inv) as f32);
                let mm = bf(nrm * wf[i]);
                af[hd * dim + i] = bf((mm as f64 * silu(zf[b * ldz + hd * dim + i] as f64)) as f32);
            }
        }
        assert_close(&format!("{name} row {b} vs CPU"), &y[b * n..(b + 1) * n], &matvec(&dense, n, k, &af), 1e-2);
    }
}

#[test]
fn gemv_gnorm_equals_gated_norm_then_gemv() {
    for (i, enc) in [Enc::Bf16, Enc::Q8].into_iter().enumerate() {
        gnorm_case(enc, 300, (32, 128), 1, 920 + i as u64);
        gnorm_case(enc, 37, (3, 64), 1, 930 + i as u64);
        gnorm_case(enc, 20011, (2, 128), 1, 935 + i as u64);
    }
    // One row on the bulk-copy kernel with heads of 64 and 256: a head's chunks summed by 8 and
    // by 32 lanes.
    gnorm_case(Enc::Q8, 300, (4, 64), 1, 937);
    gnorm_case(Enc::Q8, 300, (2, 256), 1, 938);
    // A decode batch's GDN output projection (32 heads of 128, K = 4096) on the bulk-copy
    // kernel of 2-8 rows; 3 heads of 256 over a cluster's 8 blocks, and more rows than stages
    // in flight.
    for (j, batch) in [2usize, 5, 8].into_iter().enumerate() {
        gnorm_case(Enc::Q8, 2048, (32, 128), batch, 940 + j as u64);
        gnorm_case(Enc::Q8, 37, (3, 256), batch, 950 + j as u64);
    }
    gnorm_case(Enc::Q8, 12_357, (16, 128), 4, 960);
}

/// The launchers refuse what the kernels cannot do.
#[test]
fn fused_launchers_refuse_bad_shapes() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(940);
    let m = HostMat::random(Enc::Q8, 1, 16, 8192 + 32, 1, &mut rng).upload(&s);
    let x = nan_bf16(&s, 8192 + 32);
    let mut y = nan_bf16(&s, 16);
    assert!(g.ks.gemv_norm(&s, &m.view(), &x, (1, 16), (&x, 1e-6), &mut y, None).is_err(), "a row longer than shared memory");
    let m2 = HostMat::random(Enc::Q8, 1, 16, 4096, 1, &mut rng).upload(&s);
    let (x9, nw2) = (nan_bf16(&s, 9 * 4096), nan_bf16(&s, 4096));
    let mut y9 = nan_bf16(&s, 9 * 16);
    assert!(g.ks.gemv_norm(&s, &m2.view(), &x9, (9, 16), (&nw2, 1e-6), &mut y9, None).is_err(), "9 rows of 4,096: past a normed batch's shared memory");
    assert!(g.ks.gemv_norm(&s, &m2.view(), &x9, (17, 16), (&nw2, 1e-6), &mut y9, None).is_err(), "17 rows");
    let nw128 = nan_bf16(&s, 128);
    let err = g.ks.gemv_gnorm(&s, &m2.view(), &x9, (&x9, 9, 4096), (&nw128, 128, 1e-6), &mut y9, false).unwrap_err();
    assert!(err.to_string().contains("9 rows"), "9 rows: the gated norm takes 2-8 (9-16 run as two launches): {err}");
    let m48 = HostMat::random(Enc::Bf16, 1, 16, 48, 1, &mut rng).upload(&s);
    let (x48, nw48) = (nan_bf16(&s, 2 * 48), nan_bf16(&s, 48));
    assert!(g.ks.gemv_norm(&s, &m48.view(), &x48, (2, 16), (&nw48, 1e-6), &mut y9, None).is_err(), "a batch of 48 columns: not whole 32-column groups");
    let m4 = HostMat::random(Enc::Q4, 1, 16, 256, 1, &mut rng).upload(&s);
    let (x4, nw) = (nan_bf16(&s, 256), nan_bf16(&s, 96));
    assert!(g.ks.gemv_gnorm(&s, &m4.view(), &x4, (&x4, 1, 256), (&nw, 64, 1e-6), &mut y, false).is_err(), "q4 has no gated-norm product");
    let m8 = HostMat::random(Enc::Q8, 1, 16, 256, 1, &mut rng).upload(&s);
    assert!(g.ks.gemv_gnorm(&s, &m8.view(), &x4, (&x4, 1, 256), (&nw, 96, 1e-6), &mut y, false).is_err(), "256 columns are not heads of 96");
    let (x2, mut y2) = (nan_bf16(&s, 2 * 256), nan_bf16(&s, 2 * 16));
    assert!(g.ks.gemv_gnorm(&s, &m8.view(), &x2, (&x2, 2, 128), (&nw, 64, 1e-6), &mut y2, false).is_err(), "z rows closer than their 256 columns");
    assert!(g.ks.gemv_gnorm(&s, &m2.view(), &x9, (&x9, 2, 4096), (&nw, 64, 1e-6), &mut y, false).is_err(), "y of 16 for 2 rows of 16");
    let (m768, x768, nw96) = (HostMat::random(Enc::Q8, 1, 16, 768, 1, &mut rng).upload(&s), nan_bf16(&s, 768), nan_bf16(&s, 96));
    let err = g.ks.gemv_gnorm(&s, &m768.view(), &x768, (&x768, 1, 768), (&nw96, 96, 1e-6), &mut y, false).unwrap_err();
    assert!(err.to_string().contains("power of two"), "one row of heads of 96: 12 chunks a head, no lane group: {err}");
    let m8b = HostMat::random(Enc::Q8, 1, 16, 192, 1, &mut rng).upload(&s);
    assert!(g.ks.gemv_gnorm(&s, &m8b.view(), &x2, (&x2, 2, 192), (&nw, 64, 1e-6), &mut y2, false).is_err(), "a batch of 192 columns: no bulk-copy kernel");
}
