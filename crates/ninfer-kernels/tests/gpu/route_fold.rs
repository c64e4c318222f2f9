//! fused.cu's _route_b1 kernels: the MoE router folded into a one-row output projection, against
//! the projection then the normed router product, and against the CPU.

use ninfer_kernels::RouterFold;

use crate::common::*;
use crate::mats::*;

/// Heads of the gated norm in the gated cases.
const DIM: usize = 128;

/// The folded router over `experts` rows (`routed` experts, then the shared gate when one more)
/// after a q8_g32 projection of `k` columns into `h` rows (gemv_gnorm_route with `gated`,
/// else gemv_add_route), against the projection then gemv_norm with a_out: h and a the same
/// bits, the logits within a bf16 rounding of the CPU's sums and close to the normed product's
/// (which rounds a first), the top-`topk` routing the bits of moe_route on the fold's logits;
/// run twice from the same h, the same bits, the sums and the ticket left zero.
fn fold_case(gated: bool, h: usize, k: usize, (experts, routed, topk): (usize, usize, usize), seed: u64) {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(seed);
    let m = HostMat::random(Enc::Q8, 1, h, k, 1, &mut rng);
    let r = HostMat::random(Enc::Bf16, 1, experts, h, 1, &mut rng);
    let (dm, dr) = (m.upload(&s), r.upload(&s));
    let (x, z, gw) = (rng.bf16s(k, 1.0), rng.bf16s(k, 1.5), rng.bf16s(DIM, 0.5));
    let (resid, nw) = (rng.bf16s(h, 2.0), rng.bf16s(h, 0.1));
    let (dx, dz, dgw, dnw) = (up(&s, &x), up(&s, &z), up(&s, &gw), up(&s, &nw));
    let eps = 1e-6f32;
    let name = format!("route fold gated={gated} h={h} k={k} experts={experts} routed={routed} topk={topk}");
    let gate = experts - routed;

    let mut h_two = up(&s, &resid);
    match gated {
        true => g.ks.gemv_gnorm(&s, &dm.view(), &dx, (&dz, 1, k), (&dgw, DIM, eps), &mut h_two, true),
        false => g.ks.gemv_add(&s, &dm.view(), &dx, 1, k, &mut h_two, h),
    }
    .unwrap();
    let (mut l_two, mut a_two) = (nan_bf16(&s, experts), nan_bf16(&s, h));
    g.ks.gemv_norm(&s, &dr.view(), &h_two, (1, experts), (&dnw, eps), &mut l_two, Some(&mut a_two.slice_mut(..))).unwrap();

    let mut acc = s.alloc_zeros::<i64>(experts).unwrap();
    let mut ticket = s.alloc_zeros::<u32>(1).unwrap();
    let mut runs = Vec::new();
    for _ in 0..2 {
        let (mut h1, mut l1, mut a1) = (up(&s, &resid), nan_bf16(&s, experts), nan_bf16(&s, h));
        let (mut ids, mut w) = (up(&s, &vec![-7i32; topk]), up(&s, &vec![f32::NAN; topk + gate]));
        let rv = dr.view();
        let (logits, a_out, ids_v, route_w) = (l1.slice_mut(..), a1.slice_mut(..), ids.slice_mut(..), w.slice_mut(..));
        let fold = RouterFold { r: &rv, norm_w: dnw.slice(..), acc: &mut acc, ticket: &mut ticket, logits, a_out, eps, routed, topk, ids: ids_v, route_w };
        match gated {
            true => g.ks.gemv_gnorm_route(&s, &dm.view(), &dx, (&dz, k), (&dgw, DIM, eps), &mut h1, fold),
            false => g.ks.gemv_add_route(&s, &dm.view(), &dx, &mut h1, fold),
        }
        .unwrap();
        runs.push((down(&s, &h1), down(&s, &a1), down(&s, &l1), down(&s, &ids), down(&s, &w)));
    }
    assert_eq!(down(&s, &acc), vec![0i64; experts], "{name}: sums left behind");
    assert_eq!(down(&s, &ticket), vec![0u32], "{name}: ticket left behind");
    assert!(runs[0] == runs[1], "{name}: a second launch gave other bits");
    let (h1, a1, l1, ids, w) = &runs[0];
    assert_eq!(h1, &down(&s, &h_two), "{name}: h differs from the projection alone");
    assert_eq!(a1, &down(&s, &a_two), "{name}: a differs from the normed router product's");

    // CPU: logits[e] = inv_rms(h) * sum_d r[e, d] (1 + w[d]) h[d], in f64 from the new h.
    let (hf, wf) = (to_f32(h1), to_f32(&nw));
    let inv = 1.0 / (hf.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / h as f64 + eps as f64).sqrt();
    let rd = r.dequant_expert(0);
    let got = to_f32(l1);
    assert!(got.iter().all(|v| v.is_finite()), "{name}: non-finite logits");
    for e in 0..experts {
        let terms = (0..h).map(|d| rd[e * h + d] as f64 * (1.0 + wf[d] as f64) * hf[d] as f64);
        let (sum, size) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
        let want = sum * inv;
        // A bf16 rounding (2^-9 of the value) and the f32 sums' rounding (1e-6 of the terms' size).
        let tol = want.abs() / 256.0 + 1e-6 * size * inv;
        assert!((got[e] as f64 - want).abs() <= tol, "{name}: logit {e} = {} against {want:.6} (tolerance {tol:.2e})", got[e]);
    }
    assert_close(&format!("{name} vs the normed router product"), &got, &to_f32(&down(&s, &l_two)), 1e-2);

    // The routing: moe_route's of the fold's own logits, bit for bit.
    let (mut ids_r, mut w_r) = (up(&s, &vec![-7i32; topk]), up(&s, &vec![f32::NAN; topk + gate]));
    g.ks.moe_route(&s, &up(&s, l1), experts, 1, routed, topk, gate == 1, &mut ids_r, &mut w_r).unwrap();
    assert_eq!(ids, &down(&s, &ids_r), "{name}: picks differ from moe_route's");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(w), bits(&down(&s, &w_r)), "{name}: weights differ from moe_route's");
    assert!(w.iter().all(|v| v.is_finite()), "{name}: non-finite weights");
}

#[test]
fn route_fold_equals_projection_then_router() {
    // The model's: GDN output projection (32 heads of 128) and attention's o (16 heads of 256)
    // into H = 2048, 256 experts and the shared gate.
    fold_case(true, 2048, 4096, (257, 256, 8), 1000);
    fold_case(false, 2048, 4096, (257, 256, 8), 1001);
    // Few blocks and few experts, no gate row; more rows than 16 a block (the rows past the
    // first two chunks read after the wait), more than 256 routed (16 keys a lane); the most
    // experts (two a thread) and picks (32).
    fold_case(true, 256, 256, (9, 9, 4), 1002);
    fold_case(false, 8192, 512, (300, 299, 8), 1003);
    fold_case(true, 1024, 1024, (512, 512, 32), 1004);
}

/// The fold's launchers refuse what the kernels cannot do.
#[test]
fn route_fold_refuses_bad_shapes() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(1010);
    let (h, k) = (256, 256);
    let x = nan_bf16(&s, k);
    let nw = nan_bf16(&s, h);
    let mut acc = s.alloc_zeros::<i64>(600).unwrap();
    let mut ticket = s.alloc_zeros::<u32>(1).unwrap();
    let (mut hv, mut l, mut a) = (nan_bf16(&s, h), nan_bf16(&s, 600), nan_bf16(&s, h));
    let (mut ids, mut w) = (s.alloc_zeros::<i32>(40).unwrap(), s.alloc_zeros::<f32>(40).unwrap());
    let q8 = HostMat::random(Enc::Q8, 1, h, k, 1, &mut rng).upload(&s);
    let bf = HostMat::random(Enc::Bf16, 1, h, k, 1, &mut rng).upload(&s);
    let r9 = || HostMat::random(Enc::Bf16, 1, 9, h, 1, &mut Rng::new(1011)).upload(&s);
    let cases = [
        (r9(), &bf, (8, 4), "a bf16 projection: no bulk-copy kernel"),
        (HostMat::random(Enc::Q8, 1, 9, h, 1, &mut rng).upload(&s), &q8, (8, 4), "a q8_g32 router"),
        (HostMat::random(Enc::Bf16, 1, 513, h, 1, &mut rng).upload(&s), &q8, (512, 4), "513 router rows"),
        (HostMat::random(Enc::Bf16, 1, 9, 2 * h, 1, &mut rng).upload(&s), &q8, (8, 4), "router rows of 512 for h of 256"),
        (r9(), &q8, (8, 0), "top-0"),
        (r9(), &q8, (8, 9), "top-9 of 8"),
        (r9(), &q8, (7, 4), "two rows past the routed experts"),
        (r9(), &q8, (10, 4), "more routed experts than rows"),
        (HostMat::random(Enc::Bf16, 1, 40, h, 1, &mut rng).upload(&s), &q8, (40, 33), "top-33"),
    ];
    for (r, m, (routed, topk), what) in &cases {
        let rv = r.view();
        let (ids_v, route_w) = (ids.slice_mut(..), w.slice_mut(..));
        let fold = RouterFold { r: &rv, norm_w: nw.slice(..), acc: &mut acc, ticket: &mut ticket, logits: l.slice_mut(..), a_out: a.slice_mut(..), eps: 1e-6, routed: *routed, topk: *topk, ids: ids_v, route_w };
        assert!(g.ks.gemv_add_route(&s, &m.view(), &x, &mut hv, fold).is_err(), "{what}");
    }
    let r = r9();
    let rv = r.view();
    let (ids_v, route_w) = (ids.slice_mut(..), w.slice_mut(..));
    let fold = RouterFold { r: &rv, norm_w: nw.slice(..), acc: &mut acc, ticket: &mut ticket, logits: l.slice_mut(..), a_out: a.slice_mut(..), eps: 1e-6, routed: 8, topk: 4, ids: ids_v, route_w };
    let nwh = nan_bf16(&s, DIM);
    let z = nan_bf16(&s, k);
    assert!(g.ks.gemv_gnorm_route(&s, &q8.view(), &x, (&z, k - 8), (&nwh, DIM, 1e-6), &mut hv, fold).is_err(), "z rows closer than their columns");
}
