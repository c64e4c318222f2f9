//! moe.cu (router), experts.cu and experts_batch.cu: the per-slot expert-bank kernels, the
//! batch ones (gate/up and down) and the grouped ones.

use ninfer_kernels::{bf16, Routing, BATCH_MAX_TOKENS, GROUPED_MAX_TOKENS};

use crate::common::*;
use crate::mats::*;

/// gate_up then down for `tokens` tokens, each with `topk` distinct experts of `experts`,
/// bank and optional shared expert in encoding `enc`.
fn bank_case(
    enc: Enc,
    experts: usize,
    inter: usize,
    hidden: usize,
    tokens: usize,
    topk: usize,
    shared: bool,
    seed: u64,
) {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(seed);
    let segs = if enc == Enc::Nvfp4 { 2 } else { 1 };
    let gu = HostMat::random(enc, experts, 2 * inter, hidden, segs, &mut rng);
    let dn = HostMat::random(enc, experts, hidden, inter, 1, &mut rng);
    let sgu = HostMat::random(enc, 1, 2 * inter, hidden, segs, &mut rng);
    let sdn = HostMat::random(enc, 1, hidden, inter, 1, &mut rng);
    let (dgu, ddn, dsgu, dsdn) = (gu.upload(&s), dn.upload(&s), sgu.upload(&s), sdn.upload(&s));
    let x = rng.bf16s(tokens * hidden, 1.0);
    let mut ids: Vec<i32> = Vec::new();
    for _ in 0..tokens {
        ids.extend(rng.distinct(experts, topk).into_iter().map(|e| e as i32));
    }
    let slots = tokens * topk + if shared { tokens } else { 0 };
    let route_w: Vec<f32> = (0..slots)
        .map(|_| bf(0.05 + rng.uniform() as f32))
        .collect();
    let (dx, dids, dw) = (up(&s, &x), up(&s, &ids), up(&s, &route_w));
    let table = Routing::Table { ids: dids.slice(..), w: dw.slice(..) };
    let shared_gu = dsgu.view();
    let shared_dn = dsdn.view();
    let name =
        format!("moe {enc:?} E={experts} I={inter} H={hidden} T={tokens} k={topk} shared={shared}");

    // gate_up: silu(g) * u per slot.
    let mut m = nan_bf16(&s, slots * inter);
    g.ks.moe_gate_up(
        &s,
        &dgu.view(),
        shared.then_some(&shared_gu),
        &dx,
        hidden,
        (tokens, topk),
        &table,
        &mut m,
    )
    .unwrap();
    let mut want_m = Vec::new();
    for slot in 0..slots {
        let (w, t) = if slot < tokens * topk {
            (gu.dequant_expert(ids[slot] as usize), slot / topk)
        } else {
            (sgu.dequant_expert(0), slot - tokens * topk)
        };
        let xt = to_f32(&x[t * hidden..(t + 1) * hidden]);
        let y = matvec(&w, 2 * inter, hidden, &xt);
        for j in 0..inter {
            let (gv, uv) = (bf(y[j]), bf(y[inter + j]));
            want_m.push(bf(bf(silu(gv as f64) as f32) * uv));
        }
    }
    let got_m = down(&s, &m);
    assert_close(&format!("{name} gate_up"), &to_f32(&got_m), &want_m, 1e-2);

    // down: weighted sum over each token's slots, from the kernel's own gate_up output.
    let mf = to_f32(&got_m);
    let mut want = vec![0f32; tokens * hidden];
    for t in 0..tokens {
        let mut acc = vec![0f64; hidden];
        let mut add = |w: &[f32], slot: usize| {
            let y = matvec(w, hidden, inter, &mf[slot * inter..(slot + 1) * inter]);
            for n in 0..hidden {
                acc[n] += route_w[slot] as f64 * y[n] as f64;
            }
        };
        for j in 0..topk {
            add(&dn.dequant_expert(ids[t * topk + j] as usize), t * topk + j);
        }
        if shared {
            add(&sdn.dequant_expert(0), tokens * topk + t);
        }
        for n in 0..hidden {
            want[t * hidden + n] = acc[n] as f32;
        }
    }
    let mut y32 = nan_f32(&s, tokens * hidden);
    g.ks.moe_down(
        &s,
        &ddn.view(),
        shared.then_some(&shared_dn),
        &m,
        (tokens, topk),
        &table,
        &mut y32,
        hidden,
        false,
    )
    .unwrap();
    assert_close(&format!("{name} down f32"), &down(&s, &y32), &want, 1e-4);

    // Accumulating into a bf16 residual: y = bf16(y + bf16(r)).
    let resid = rng.bf16s(tokens * hidden, 2.0);
    let mut y16 = up(&s, &resid);
    g.ks.moe_down(
        &s,
        &ddn.view(),
        shared.then_some(&shared_dn),
        &m,
        (tokens, topk),
        &table,
        &mut y16,
        hidden,
        true,
    )
    .unwrap();
    let want16: Vec<f32> = resid
        .iter()
        .zip(&want)
        .map(|(r, &v)| bf(r.to_f32() + bf(v)))
        .collect();
    assert_close(
        &format!("{name} down accumulate bf16"),
        &to_f32(&down(&s, &y16)),
        &want16,
        1e-2,
    );

    // The batch kernels of a decode batch (NVFP4): the same gate_up output, and down plus the
    // combine into the same residual, each expert run once.
    let batch = enc == Enc::Nvfp4 && tokens <= BATCH_MAX_TOKENS && hidden.is_multiple_of(128);
    if batch {
        let mut mb = nan_bf16(&s, slots * inter);
        g.ks.moe_gate_up_batch(&s, &dgu.view(), shared.then_some(&shared_gu), &dx, hidden, (tokens, topk), &dids, &mut mb)
            .unwrap();
        assert_close(&format!("{name} gate_up batch"), &to_f32(&down(&s, &mb)), &want_m, 1e-2);
    }
    if batch && inter.is_multiple_of(512) {
        let mut part = nan_f32(&s, slots * hidden);
        g.ks.moe_down_batch(&s, &ddn.view(), shared.then_some(&shared_dn), &m, (tokens, topk), &dids, &dw, &mut part)
            .unwrap();
        let mut yb = up(&s, &resid);
        g.ks.moe_combine(&s, &part, &dids, tokens, topk, experts, shared, &mut yb, hidden, hidden).unwrap();
        assert_close(&format!("{name} batch down + combine"), &to_f32(&down(&s, &yb)), &want16, 1e-2);
    }

    // The grouped kernels of a prompt pass (NVFP4): the same gate_up output, and down plus the
    // combine into the same residual.
    let fits = inter.is_multiple_of(32) && hidden.is_multiple_of(32) && hidden.max(inter) <= 2048;
    if enc == Enc::Nvfp4 && tokens <= GROUPED_MAX_TOKENS && fits {
        let mut mg = nan_bf16(&s, slots * inter);
        g.ks.moe_gate_up_grouped(&s, &dgu.view(), shared.then_some(&shared_gu), &dx, hidden, tokens, topk, &dids, &mut mg)
            .unwrap();
        assert_close(&format!("{name} gate_up grouped"), &to_f32(&down(&s, &mg)), &want_m, 1e-2);
        let mut part = nan_f32(&s, slots * hidden);
        g.ks.moe_down_grouped(&s, &ddn.view(), shared.then_some(&shared_dn), &m, tokens, topk, &dids, &dw, &mut part)
            .unwrap();
        let mut yg = up(&s, &resid);
        g.ks.moe_combine(&s, &part, &dids, tokens, topk, experts, shared, &mut yg, hidden, hidden).unwrap();
        assert_close(&format!("{name} grouped down + combine"), &to_f32(&down(&s, &yg)), &want16, 1e-2);
    }
}

#[test]
fn expert_banks_all_encodings() {
    for (i, enc) in ALL_ENCS.into_iter().enumerate() {
        bank_case(enc, 8, 64, 256, 3, 2, true, 400 + i as u64);
        bank_case(enc, 8, 64, 256, 1, 4, false, 410 + i as u64);
    }
}

#[test]
fn expert_banks_model_shapes() {
    // Qwen3.6-35B-A3B decode: 256 experts of I = 512 over H = 2048, top-8 plus the shared expert.
    bank_case(Enc::Nvfp4, 256, 512, 2048, 1, 8, true, 420);
    bank_case(Enc::Q8, 256, 512, 2048, 2, 8, true, 421);
    // Decode batches of 4 and 16 tokens.
    bank_case(Enc::Nvfp4, 256, 512, 2048, 4, 8, true, 422);
    bank_case(Enc::Nvfp4, 256, 512, 2048, 16, 8, true, 423);
}

#[test]
fn expert_banks_decode_batch_shared_experts() {
    // Few experts for the tokens, so that most experts take several slots (one and two passes
    // of 8 in the batch kernels); with and without the shared expert.
    bank_case(Enc::Nvfp4, 8, 512, 256, 3, 2, true, 427);
    bank_case(Enc::Nvfp4, 12, 512, 128, 16, 4, false, 428);
    bank_case(Enc::Nvfp4, 12, 512, 128, 11, 4, true, 429);
}

#[test]
fn expert_banks_prompt_pass_grouped() {
    // 200 tokens of top-8 over 32 experts: every expert lists many slots, in several MMA tiles.
    bank_case(Enc::Nvfp4, 32, 128, 512, 200, 8, true, 425);
    bank_case(Enc::Nvfp4, 32, 128, 512, 37, 3, false, 426);
}

#[test]
fn expert_banks_long_prompt_pass() {
    // 7,300 tokens of top-8 plus the shared expert: 65,700 slots, past a grid's y limit.
    bank_case(Enc::Nvfp4, 16, 32, 64, 7300, 8, true, 430);
}

#[test]
fn gate_up_zeroes_invalid_expert_ids() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(430);
    let gu = HostMat::random(Enc::Bf16, 4, 64, 64, 1, &mut rng).upload(&s);
    let x = up(&s, &rng.bf16s(64, 1.0));
    let (ids, w) = (up(&s, &[2i32, -1, 4]), up(&s, &[1f32; 3]));
    let mut m = nan_bf16(&s, 3 * 32);
    let table = Routing::Table { ids: ids.slice(..), w: w.slice(..) };
    g.ks.moe_gate_up(&s, &gu.view(), None, &x, 64, (1, 3), &table, &mut m)
        .unwrap();
    let got = down(&s, &m);
    assert!(got[..32].iter().all(|v| v.is_finite()));
    assert!(
        got[..32].iter().any(|v| v.to_f32() != 0.0),
        "valid expert produced zeros"
    );
    assert!(
        got[32..].iter().all(|v| *v == bf16::ZERO),
        "ids -1 and 4 (>= E) must give zero rows"
    );
}

#[test]
fn batch_kernels_skip_invalid_ids_and_share_experts() {
    // Three tokens of four ids over 6 experts: expert 2 named by every token, ids -1 and 6
    // (>= E) in the middle of a token's list. gate_up gives their slots zero rows; down leaves
    // their rows of `part` unwritten (the combine skips them).
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(431);
    let (experts, inter, hidden, topk, tokens) = (6, 512, 128, 4, 3);
    let gu = HostMat::random(Enc::Nvfp4, experts, 2 * inter, hidden, 2, &mut rng);
    let dn = HostMat::random(Enc::Nvfp4, experts, hidden, inter, 1, &mut rng);
    let x = rng.bf16s(tokens * hidden, 1.0);
    let ids = [2i32, -1, 0, 5, 1, 2, 6, 3, 2, 4, 0, 1];
    let w: Vec<f32> = (0..ids.len()).map(|_| bf(0.05 + rng.uniform() as f32)).collect();
    let (dgu, ddn, dx, dids, dw) = (gu.upload(&s), dn.upload(&s), up(&s, &x), up(&s, &ids), up(&s, &w));
    let mut m = nan_bf16(&s, ids.len() * inter);
    g.ks.moe_gate_up_batch(&s, &dgu.view(), None, &dx, hidden, (tokens, topk), &dids, &mut m).unwrap();
    let mut part = nan_f32(&s, ids.len() * hidden);
    g.ks.moe_down_batch(&s, &ddn.view(), None, &m, (tokens, topk), &dids, &dw, &mut part).unwrap();
    let (got, got_part) = (to_f32(&down(&s, &m)), down(&s, &part));
    for (slot, &e) in ids.iter().enumerate() {
        let row = &got[slot * inter..(slot + 1) * inter];
        let prow = &got_part[slot * hidden..(slot + 1) * hidden];
        if !(0..experts as i32).contains(&e) {
            assert!(row.iter().all(|&v| v == 0.0), "slot {slot} (id {e}) must be a zero row");
            assert!(prow.iter().all(|v| v.is_nan()), "slot {slot} (id {e}): down must not write its row");
            continue;
        }
        let t = slot / topk;
        let y = matvec(&gu.dequant_expert(e as usize), 2 * inter, hidden, &to_f32(&x[t * hidden..(t + 1) * hidden]));
        let want: Vec<f32> = (0..inter).map(|j| bf(bf(silu(bf(y[j]) as f64) as f32) * bf(y[inter + j]))).collect();
        assert_close(&format!("batch gate_up slot {slot} (expert {e})"), row, &want, 1e-2);
        let yd = matvec(&dn.dequant_expert(e as usize), hidden, inter, row);
        let want_d: Vec<f32> = yd.iter().map(|v| w[slot] * v).collect();
        assert_close(&format!("batch down slot {slot} (expert {e})"), prow, &want_d, 1e-4);
    }
}

fn ref_route(logits: &[f32], experts: usize, topk: usize) -> (Vec<i32>, Vec<f32>) {
    let mut order: Vec<usize> = (0..experts).collect();
    order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap().then(a.cmp(&b)));
    let sel = &order[..topk];
    let top = logits[sel[0]] as f64;
    let z: f64 = sel.iter().map(|&e| (logits[e] as f64 - top).exp()).sum();
    let w = sel
        .iter()
        .map(|&e| bf(((logits[e] as f64 - top).exp() / z) as f32))
        .collect();
    (sel.iter().map(|&e| e as i32).collect(), w)
}

#[test]
fn router_topk_renormalised() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(440);
    for &(tokens, experts, topk, shared) in &[
        (5usize, 256usize, 8usize, true),
        (3, 40, 1, false),
        (9, 512, 32, true),
        (2, 7, 7, false),
    ] {
        let ld = experts + shared as usize + 3;
        let logits = rng.bf16s(tokens * ld, 2.0);
        let dl = up(&s, &logits);
        let mut ids = up(&s, &vec![-7i32; tokens * topk]);
        let mut w = nan_f32(&s, tokens * topk + if shared { tokens } else { 0 });
        g.ks.moe_route(&s, &dl, ld, tokens, experts, topk, shared, &mut ids, &mut w)
            .unwrap();
        let (gi, gw) = (down(&s, &ids), down(&s, &w));
        for t in 0..tokens {
            let row = to_f32(&logits[t * ld..t * ld + experts]);
            let (ri, rw) = ref_route(&row, experts, topk);
            assert_eq!(
                &gi[t * topk..(t + 1) * topk],
                &ri[..],
                "ids of token {t} (E={experts})"
            );
            for j in 0..topk {
                let (a, b) = (gw[t * topk + j], rw[j]);
                assert!(
                    (a - b).abs() <= b.abs() / 128.0 + 1e-7,
                    "weight {j} of token {t}: {a} vs {b}"
                );
            }
            if shared {
                let want = bf(sigmoid(logits[t * ld + experts].to_f32() as f64) as f32);
                let got = gw[tokens * topk + t];
                assert!(
                    (got - want).abs() <= want / 128.0,
                    "shared gate of token {t}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn router_skips_nan_logits() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut logits = vec![bf16::from_f32(0.0); 64];
    logits[3] = bf16::NAN;
    logits[10] = bf16::from_f32(1.0);
    logits[20] = bf16::from_f32(2.0);
    let dl = up(&s, &logits);
    let mut ids = up(&s, &[0i32; 3]);
    let mut w = nan_f32(&s, 3);
    g.ks.moe_route(&s, &dl, 64, 1, 64, 3, false, &mut ids, &mut w)
        .unwrap();
    assert_eq!(
        down(&s, &ids),
        vec![20, 10, 0],
        "NaN expert 3 must not be chosen"
    );
    let w = down(&s, &w);
    assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-2);
}

/// One token's experts routed by the expert kernels from its logits (the decode path) against
/// the same kernels on the routing launch's table: the same bits, gate_up and down alike.
#[test]
fn experts_routed_from_logits_equal_the_route_table() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(450);
    for (enc, experts, topk, shared, inter, hidden) in [(Enc::Nvfp4, 256usize, 8usize, true, 512usize, 2048usize), (Enc::Q8, 64, 4, false, 64, 256)] {
        let segs = if enc == Enc::Nvfp4 { 2 } else { 1 };
        let gu = HostMat::random(enc, experts, 2 * inter, hidden, segs, &mut rng).upload(&s);
        let dn = HostMat::random(enc, experts, hidden, inter, 1, &mut rng).upload(&s);
        let sgu = HostMat::random(enc, 1, 2 * inter, hidden, segs, &mut rng).upload(&s);
        let sdn = HostMat::random(enc, 1, hidden, inter, 1, &mut rng).upload(&s);
        let (sguv, sdnv) = (sgu.view(), sdn.view());
        let name = format!("routed in the experts {enc:?} E={experts} top{topk} shared={shared}");
        let slots = topk + shared as usize;
        let x = up(&s, &rng.bf16s(hidden, 1.0));
        let logits = up(&s, &rng.bf16s(experts + shared as usize, 2.0));
        let (mut ids, mut w) = (up(&s, &vec![-1i32; topk]), nan_f32(&s, slots));
        g.ks.moe_route(&s, &logits, experts + 1, 1, experts, topk, shared, &mut ids, &mut w).unwrap();
        let resid = rng.bf16s(hidden, 2.0);
        let run = |routing: &Routing| {
            let mut m = nan_bf16(&s, slots * inter);
            g.ks.moe_gate_up(&s, &gu.view(), shared.then_some(&sguv), &x, hidden, (1, topk), routing, &mut m).unwrap();
            let mut y = up(&s, &resid);
            g.ks.moe_down(&s, &dn.view(), shared.then_some(&sdnv), &m, (1, topk), routing, &mut y, hidden, true).unwrap();
            (down(&s, &m), down(&s, &y))
        };
        let (m_ref, y_ref) = run(&Routing::Table { ids: ids.slice(..), w: w.slice(..) });
        let (m, y) = run(&Routing::Logits(logits.slice(..)));
        assert!(m_ref.iter().all(|v| v.is_finite()) && y_ref.iter().all(|v| v.is_finite()), "{name}: reference not finite");
        assert_eq!(m, m_ref, "{name}: gate_up");
        assert_eq!(y, y_ref, "{name}: down into the residual");
    }
}

/// One token's down on the one-token tensor-core kernel (NVFP4, I whole 128-column blocks):
/// ids -1 and E in the routing give gate_up zero rows and add nothing in down.
#[test]
fn one_token_experts_skip_invalid_ids() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(460);
    let (experts, inter, hidden) = (6, 128, 256);
    let gu = HostMat::random(Enc::Nvfp4, experts, 2 * inter, hidden, 2, &mut rng);
    let dn = HostMat::random(Enc::Nvfp4, experts, hidden, inter, 1, &mut rng);
    let x = rng.bf16s(hidden, 1.0);
    let ids = [3i32, -1, 0, 6];
    let w: Vec<f32> = (0..ids.len()).map(|_| bf(0.05 + rng.uniform() as f32)).collect();
    let (dgu, ddn, dx, dids, dw) = (gu.upload(&s), dn.upload(&s), up(&s, &x), up(&s, &ids), up(&s, &w));
    let table = Routing::Table { ids: dids.slice(..), w: dw.slice(..) };
    let mut m = nan_bf16(&s, ids.len() * inter);
    g.ks.moe_gate_up(&s, &dgu.view(), None, &dx, hidden, (1, ids.len()), &table, &mut m).unwrap();
    let got = to_f32(&down(&s, &m));
    let mut want = vec![0f32; hidden];
    for (slot, &e) in ids.iter().enumerate() {
        let row = &got[slot * inter..(slot + 1) * inter];
        if !(0..experts as i32).contains(&e) {
            assert!(row.iter().all(|&v| v == 0.0), "slot {slot} (id {e}) must be a zero row");
            continue;
        }
        let y = matvec(&gu.dequant_expert(e as usize), 2 * inter, hidden, &to_f32(&x));
        let want_m: Vec<f32> = (0..inter).map(|j| bf(bf(silu(bf(y[j]) as f64) as f32) * bf(y[inter + j]))).collect();
        assert_close(&format!("one-token gate_up slot {slot} (expert {e})"), row, &want_m, 1e-2);
        let yd = matvec(&dn.dequant_expert(e as usize), hidden, inter, row);
        for n in 0..hidden {
            want[n] += w[slot] * yd[n];
        }
    }
    let mut y = nan_f32(&s, hidden);
    g.ks.moe_down(&s, &ddn.view(), None, &m, (1, ids.len()), &table, &mut y, hidden, false).unwrap();
    assert_close("one-token down, invalid ids skipped", &down(&s, &y), &want, 1e-4);
}
