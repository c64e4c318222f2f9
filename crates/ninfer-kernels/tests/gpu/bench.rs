//! Timings of the decode-critical kernels at the model's shapes (ignored by default; run with
//! `--ignored`). Each prints microseconds per launch and, for weight streams, GB/s; each asserts
//! only that its output is finite.

use std::sync::Arc;

use ninfer_kernels::cudarc::driver::{sys::CUevent_flags, CudaStream};
use ninfer_kernels::{
    attention_workspace_len, bf16, AttentionBatch, AttnTiles, BATCH_MAX_TOKENS, DeltaForm, GdnDims, HeadLayout, MatrixView, PagedKv, Routing,
    SamplingRow, SeqSlots, Weights,
};

use crate::common::*;
use crate::mats::*;

/// Mean milliseconds of `f` over `iters` launches after three warm-ups.
fn time_ms(s: &Arc<CudaStream>, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let start = s
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    for _ in 0..iters {
        f();
    }
    let end = s
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    end.synchronize().unwrap();
    start.elapsed_ms(&end).unwrap() as f64 / iters as f64
}

/// `time_ms` of `f(i)` with `i` cycling through `0..copies`: each launch reads the next of
/// `copies` copies of its weights, so that none finds them in L2 (as in a decode step).
fn time_rotating(s: &Arc<CudaStream>, copies: usize, iters: usize, mut f: impl FnMut(usize)) -> f64 {
    let mut turn = 0;
    time_ms(s, iters, || {
        turn = (turn + 1) % copies;
        f(turn)
    })
}

fn report(name: &str, ms: f64, bytes: f64) {
    if bytes > 0.0 {
        println!(
            "BENCH {name}: {:.1} us, {:.0} GB/s",
            ms * 1e3,
            bytes / ms / 1e6
        );
    } else {
        println!("BENCH {name}: {:.1} us", ms * 1e3);
    }
}

fn finite_f32(v: &[f32]) {
    assert!(v.iter().all(|x| x.is_finite()));
}

#[test]
#[ignore]
fn bench_gemv_decode() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(1000);
    let bytes_per = |e: Enc| match e {
        Enc::Bf16 => 2.0,
        Enc::Q8 => 1.0625,
        Enc::Q6 => 0.78125,
        Enc::Q4 => 0.5625,
        Enc::Nvfp4 => 0.5625,
    };
    let shapes = [
        (Enc::Q8, 8192, 2048, 1),
        (Enc::Q8, 2048, 4096, 1),
        (Enc::Q8, 8192, 2048, 4),
        (Enc::Q8, 2048, 4096, 4),
        (Enc::Q8, 8192, 2048, 8),
        (Enc::Q8, 8192, 2048, 16),
        (Enc::Q8, 2048, 4096, 16),
        (Enc::Bf16, 257, 2048, 16),
        (Enc::Nvfp4, 8192, 2048, 1),
        (Enc::Bf16, 4096, 2048, 1),
        (Enc::Q4, 8192, 2048, 1),
        (Enc::Q6, 248_320, 2048, 1),
        (Enc::Q6, 248_320, 2048, 2),
        (Enc::Q6, 248_320, 2048, 4),
        (Enc::Q6, 248_320, 2048, 8),
        (Enc::Q6, 248_320, 2048, 16),
    ];
    for (enc, n, k, b) in shapes {
        // Enough copies of the matrix to overflow the 50 MB L2 of an H100/H200, launched in
        // turn, so that each launch streams its weights from memory as in a decode step.
        let bytes = n as f64 * k as f64 * bytes_per(enc);
        let copies = ((128e6 / bytes).ceil() as usize).clamp(1, 8);
        let host = HostMat::random(enc, 1, n, k, 1, &mut rng);
        let ms: Vec<_> = (0..copies).map(|_| host.upload(&s)).collect();
        let x = up(&s, &rng.bf16s(b * k, 1.0));
        let mut y = nan_f32(&s, b * n);
        let ms = time_rotating(&s, copies, 24, |i| g.ks.gemv(&s, &ms[i].view(), &x, b, k, &mut y, n).unwrap());
        finite_f32(&down(&s, &y));
        report(&format!("gemv {enc:?} {n}x{k} b={b}"), ms, bytes);
    }
}

#[test]
#[ignore]
fn bench_gemv_norm() {
    // The GDN input projection of a decode step (z|qkv|b|a, q8_g32) of 1, 4 and 16 rows: the
    // layer's norm and the product as two launches, and as one.
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(1003);
    let (n, k) = (12_352, 2048);
    let host = HostMat::random(Enc::Q8, 1, n, k, 1, &mut rng);
    let ms: Vec<_> = (0..8).map(|_| host.upload(&s)).collect();
    for b in [1usize, 4, 16] {
        let (x, w) = (up(&s, &rng.bf16s(b * k, 1.0)), up(&s, &rng.bf16s(k, 0.1)));
        let mut a = nan_bf16(&s, b * k);
        let mut y = nan_f32(&s, b * n);
        let rows = ninfer_kernels::Rows::dense(b, k);
        let two = time_rotating(&s, ms.len(), 24, |i| {
            g.ks.rms_norm(&s, &x, rows, &w, &mut a, rows, 1e-6).unwrap();
            g.ks.gemv(&s, &ms[i].view(), &a, b, k, &mut y, n).unwrap()
        });
        let one = time_rotating(&s, ms.len(), 24, |i| g.ks.gemv_norm(&s, &ms[i].view(), &x, (b, n), (&w, 1e-6), &mut y, None).unwrap());
        let bytes = n as f64 * k as f64 * 1.0625;
        report(&format!("rms_norm + gemv Q8 {n}x{k} b={b}"), two, bytes);
        report(&format!("gemv_norm Q8 {n}x{k} b={b}"), one, bytes);
        finite_f32(&down(&s, &y));
    }
}

#[test]
#[ignore]
fn bench_gemv_gnorm() {
    // The GDN output projection of a decode step (2048 x 4096, q8_g32) plain and with its gated
    // norm built in: at head widths that give each warp 4 heads in turn (the model's 32 x 128),
    // 1 (8 x 512) and 8 (64 x 64), and with a quarter of the rows (a quarter of the blocks
    // reading the same input row). Where the fused launch's time beyond the plain one goes:
    // heads built in turn, or every block reading the same row at once.
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(1004);
    let k = 4096;
    let (x, z) = (up(&s, &rng.bf16s(k, 1.0)), up(&s, &rng.bf16s(k, 1.0)));
    for n in [2048, 512] {
        let host = HostMat::random(Enc::Q8, 1, n, k, 1, &mut rng);
        let ms: Vec<_> = (0..8).map(|_| host.upload(&s)).collect();
        let mut y = nan_bf16(&s, n);
        let bytes = n as f64 * k as f64 * 1.0625;
        let plain = time_rotating(&s, ms.len(), 24, |i| g.ks.gemv(&s, &ms[i].view(), &x, 1, k, &mut y, n).unwrap());
        report(&format!("gemv Q8 {n}x{k} b=1, bf16 out"), plain, bytes);
        for dim in [128, 512, 64] {
            let w = up(&s, &rng.bf16s(dim, 0.1));
            let fused = time_rotating(&s, ms.len(), 24, |i| {
                g.ks.gemv_gnorm(&s, &ms[i].view(), &x, (&z, 1, k), (&w, dim, 1e-6), &mut y, false).unwrap()
            });
            report(&format!("gemv_gnorm Q8 {n}x{k} b=1, {} heads of {dim}", k / dim), fused, bytes);
        }
        finite_f32(&to_f32(&down(&s, &y)));
    }
}

#[test]
#[ignore]
fn bench_moe_decode() {
    // One token through one layer's experts, routed by the kernels from the logits as a decode
    // step runs them, with the logits rotating over 16 rows so that each launch picks other
    // experts and streams their weights from memory (the same row every time would keep its
    // nine experts in L2). gate_up alone, then gate_up and down in turn, as down must follow
    // gate_up (experts.cu).
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(1001);
    let (e, i, h, k, rows) = (256, 512, 2048, 8, 16);
    for enc in [Enc::Nvfp4, Enc::Q8] {
        let gu = HostMat::random(enc, e, 2 * i, h, 1, &mut rng).upload(&s);
        let dn = HostMat::random(enc, e, h, i, 1, &mut rng).upload(&s);
        let sgu = HostMat::random(enc, 1, 2 * i, h, 1, &mut rng).upload(&s);
        let sdn = HostMat::random(enc, 1, h, i, 1, &mut rng).upload(&s);
        let (sguv, sdnv) = (sgu.view(), sdn.view());
        let x = up(&s, &rng.bf16s(h, 1.0));
        let logits: Vec<_> = (0..rows).map(|_| up(&s, &rng.bf16s(e + 1, 2.0))).collect();
        let mut m = nan_bf16(&s, (k + 1) * i);
        let mut y = nan_f32(&s, h);
        let per = if enc == Enc::Nvfp4 { 0.5625 } else { 1.0625 };
        let bytes = (k + 1) as f64 * (2 * i * h) as f64 * per;
        let route = |r: usize| Routing::Logits(logits[r].slice(..));
        let gate_up = |route: &Routing, m: &mut _| {
            g.ks.moe_gate_up(&s, &gu.view(), Some(&sguv), &x, h, (1, k), route, m).unwrap();
        };
        let ms = time_rotating(&s, rows, 48, |r| gate_up(&route(r), &mut m));
        report(&format!("moe_gate_up {enc:?} E={e} top{k}+shared"), ms, bytes);
        let ms = time_rotating(&s, rows, 48, |r| {
            let route = route(r);
            gate_up(&route, &mut m);
            g.ks.moe_down(&s, &dn.view(), Some(&sdnv), &m, (1, k), &route, &mut y, h, false).unwrap();
        });
        report(&format!("moe_gate_up + moe_down {enc:?} E={e} top{k}+shared"), ms, bytes * 1.5);
        finite_f32(&down(&s, &y));
    }
}

#[test]
#[ignore]
fn bench_moe_prompt() {
    // A pass of T tokens through one layer's experts (top-8 of 256 plus the shared expert):
    // per-slot kernels against the grouped ones. Launches cycle through eight routings, so that
    // a small batch's experts are not all still in L2 from the launch before.
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(1002);
    let (e, i, h, k) = (256, 512, 2048, 8);
    let gu = HostMat::random(Enc::Nvfp4, e, 2 * i, h, 1, &mut rng).upload(&s);
    let dn = HostMat::random(Enc::Nvfp4, e, h, i, 1, &mut rng).upload(&s);
    let sgu = HostMat::random(Enc::Nvfp4, 1, 2 * i, h, 1, &mut rng).upload(&s);
    let sdn = HostMat::random(Enc::Nvfp4, 1, h, i, 1, &mut rng).upload(&s);
    let (gu, dn, sguv, sdnv) = (gu.view(), dn.view(), sgu.view(), sdn.view());
    const ROUTINGS: usize = 8;
    for t in [2usize, 4, 8, 16, 64, 512] {
        let x = up(&s, &rng.bf16s(t * h, 1.0));
        let ids: Vec<_> = (0..ROUTINGS)
            .map(|_| up(&s, &(0..t).flat_map(|_| rng.distinct(e, k)).map(|v| v as i32).collect::<Vec<_>>()))
            .collect();
        let slots = t * (k + 1);
        let w = up(&s, &vec![0.1f32; slots]);
        let mut m = nan_bf16(&s, slots * i);
        let mut y = up(&s, &rng.bf16s(t * h, 1.0));
        let mut part = nan_f32(&s, slots * h);
        let table = |r: usize| Routing::Table { ids: ids[r].slice(..), w: w.slice(..) };
        let gate_up = time_rotating(&s, ROUTINGS, 16, |r| {
            g.ks.moe_gate_up(&s, &gu, Some(&sguv), &x, h, (t, k), &table(r), &mut m).unwrap();
        });
        let per_slot = time_rotating(&s, ROUTINGS, 16, |r| {
            g.ks.moe_gate_up(&s, &gu, Some(&sguv), &x, h, (t, k), &table(r), &mut m).unwrap();
            g.ks.moe_down(&s, &dn, Some(&sdnv), &m, (t, k), &table(r), &mut y, h, true).unwrap();
        });
        let grouped = time_rotating(&s, ROUTINGS, 16, |r| {
            g.ks.moe_gate_up_grouped(&s, &gu, Some(&sguv), &x, h, t, k, &ids[r], &mut m).unwrap();
            g.ks.moe_down_grouped(&s, &dn, Some(&sdnv), &m, t, k, &ids[r], &w, &mut part).unwrap();
            g.ks.moe_combine(&s, &part, &ids[r], t, k, e, true, &mut y, h, h).unwrap();
        });
        if t <= BATCH_MAX_TOKENS {
            let batch = time_rotating(&s, ROUTINGS, 16, |r| {
                g.ks.moe_gate_up_batch(&s, &gu, Some(&sguv), &x, h, (t, k), &ids[r], &mut m).unwrap();
            });
            let batch_all = time_rotating(&s, ROUTINGS, 16, |r| {
                g.ks.moe_gate_up_batch(&s, &gu, Some(&sguv), &x, h, (t, k), &ids[r], &mut m).unwrap();
                g.ks.moe_down_batch(&s, &dn, Some(&sdnv), &m, (t, k), &ids[r], &w, &mut part).unwrap();
                g.ks.moe_combine(&s, &part, &ids[r], t, k, e, true, &mut y, h, h).unwrap();
            });
            let batch_gu_dn = time_rotating(&s, ROUTINGS, 16, |r| {
                g.ks.moe_gate_up_batch(&s, &gu, Some(&sguv), &x, h, (t, k), &ids[r], &mut m).unwrap();
                g.ks.moe_down_batch(&s, &dn, Some(&sdnv), &m, (t, k), &ids[r], &w, &mut part).unwrap();
            });
            report(&format!("moe experts T={t} batch gate_up alone"), batch, 0.0);
            report(&format!("moe experts T={t} batch gate_up + down"), batch_gu_dn, 0.0);
            report(&format!("moe experts T={t} batch (gate_up, down, combine)"), batch_all, 0.0);
        }
        report(&format!("moe experts T={t} per-slot"), per_slot, 0.0);
        report(&format!("moe experts T={t} per-slot, gate_up alone"), gate_up, 0.0);
        report(&format!("moe experts T={t} grouped"), grouped, 0.0);
    }
}

#[test]
#[ignore]
fn bench_attention_gdn_sample() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(1002);
    let (hq, hkv, d, page) = (16, 2, 256, 64);
    for &(ctx, q_len) in &[(512usize, 1usize), (4096, 1), (32768, 1), (2048, 2048)] {
        let pages = ctx.div_ceil(page);
        let kc = up(&s, &rng.bf16s(pages * page * hkv * d, 1.0));
        let vc = up(&s, &rng.bf16s(pages * page * hkv * d, 1.0));
        let bt = up(&s, &(0..pages as i32).collect::<Vec<_>>());
        let (cu, kl) = (up(&s, &[0, q_len as i32]), up(&s, &[ctx as i32]));
        let q = up(&s, &rng.bf16s(q_len * hq * 2 * d, 1.0));
        let gate = q.slice(d..);
        let kv = PagedKv {
            k: kc.slice(..),
            v: vc.slice(..),
            page_size: page,
            kv_heads: hkv,
            dim: d,
        };
        let batch = AttentionBatch {
            seqs: 1,
            tokens: q_len,
            max_q_len: q_len,
            max_kv_len: ctx,
            cu_q: cu.slice(..),
            kv_len: kl.slice(..),
            block_table: bt.slice(..),
            bt_stride: pages,
        };
        let layout = HeadLayout {
            heads: hq,
            ld: hq * 2 * d,
            head_stride: 2 * d,
        };
        let mut out = nan_bf16(&s, q_len * hq * d);
        let scale = 1.0 / (d as f32).sqrt();
        // Decode: the launcher's split count (at most 128), then fewer, capped by the workspace
        // it is given (the split-KV partials and their combine cost against the parallelism).
        let caps: &[usize] = if q_len == 1 { &[128, 32, 8, 2] } else { &[128] };
        for (&cap, tiles) in caps.iter().flat_map(|c| [(c, AttnTiles::Simt), (c, AttnTiles::Mma)]) {
            let mut ws = nan_f32(&s, attention_workspace_len(q_len, hq, d, cap));
            let ms = time_ms(&s, 10, || {
                g.ks.attention_split_kv(
                    tiles,
                    &s,
                    &q,
                    layout,
                    Some(&gate),
                    &kv,
                    &batch,
                    scale,
                    &mut out,
                    &mut ws,
                )
                .unwrap()
            });
            let name = match cap {
                128 => format!("attention {tiles:?} ctx={ctx} q={q_len}"),
                _ => format!("attention {tiles:?} ctx={ctx} q={q_len} splits<={cap}"),
            };
            let bytes = if q_len == 1 { (2 * ctx * hkv * d * 2) as f64 } else { 0.0 };
            report(&name, ms, bytes);
            assert!(down(&s, &out).iter().all(|v| v.is_finite()));
        }
    }

    let dims = GdnDims {
        hk: 16,
        hv: 32,
        dk: 128,
        dv: 128,
    };
    let c = dims.conv_channels();
    for &t in &[1usize, 8, 16, 32, 512, 4096] {
        let qkv = up(&s, &rng.bf16s(t * c, 0.5));
        let ba = up(&s, &rng.bf16s(t * 64, 1.0));
        let (al, dt) = (up(&s, &rng.f32s(32, 0.5)), up(&s, &rng.f32s(32, 0.5)));
        let mut st = up(&s, &vec![0f32; 32 * 128 * 128]);
        let (cu, sl) = (up(&s, &[0, t as i32]), up(&s, &[0i32]));
        let batch = SeqSlots {
            seqs: 1,
            tokens: t,
            cu: cu.slice(..),
            slots: sl.slice(..),
        };
        let mut o = nan_bf16(&s, t * 32 * 128);
        let (bv, av) = (ba.slice(..), ba.slice(32..));
        for form in [DeltaForm::Recurrent, DeltaForm::Chunked] {
            let ms = time_ms(&s, 10, || {
                g.ks.gdn_delta(
                    form, &s, &qkv, c, &bv, &av, 64, &al, &dt, &mut st, 1, &batch, dims, &mut o,
                )
                .unwrap()
            });
            report(
                &format!("gdn {form:?} tokens={t}"),
                ms,
                if t == 1 {
                    2.0 * 32.0 * 128.0 * 128.0 * 4.0
                } else {
                    0.0
                },
            );
            assert!(down(&s, &o).iter().all(|v| v.is_finite()));
        }
        // The conv at the two lengths a decode and a prompt chunk have.
        if t != 1 && t != 512 {
            continue;
        }
        let w = up(&s, &rng.bf16s(c * 4, 0.5));
        let mut cs = up(&s, &vec![ninfer_kernels::bf16::ZERO; 3 * c]);
        let mut y = nan_bf16(&s, t * c);
        let ms = time_ms(&s, 10, || {
            g.ks.gdn_conv(&s, &qkv, c, &w, c, &mut cs, 1, &batch, &mut y, c)
                .unwrap()
        });
        report(&format!("gdn_conv tokens={t}"), ms, 0.0);
    }

    let vocab = 248_320;
    for rows in [1usize, 16] {
        let l = up(&s, &rng.f32s(rows * vocab, 3.0));
        let mut out = up(&s, &vec![0i32; rows]);
        let mut ws = up(&s, &vec![0u32; g.ks.sample_workspace_len(rows).unwrap()]);
        let ms = time_ms(&s, 20, || g.ks.argmax(&s, &l, rows, vocab, vocab, &mut out).unwrap());
        report(&format!("argmax rows={rows}"), ms, 0.0);
        let p: Vec<SamplingRow> = (0..rows)
            .map(|_| SamplingRow {
                temperature: 0.7,
                top_p: 0.9,
                min_p: 0.0,
                u: 0.5,
                top_k: 40,
                pad: [0; 3],
            })
            .collect();
        let p = up(&s, &p);
        let ms = time_ms(&s, 20, || {
            g.ks.sample(&s, &l, rows, vocab, vocab, &p, &mut out, &mut ws)
                .unwrap()
        });
        report(&format!("sample top-k 40 top-p 0.9 rows={rows}"), ms, 0.0);
        let p1: Vec<SamplingRow> = (0..rows)
            .map(|_| SamplingRow {
                temperature: 1.0,
                top_p: 0.95,
                min_p: 0.0,
                u: 0.5,
                top_k: 0,
                pad: [0; 3],
            })
            .collect();
        let p1 = up(&s, &p1);
        let ms = time_ms(&s, 20, || {
            g.ks.sample(&s, &l, rows, vocab, vocab, &p1, &mut out, &mut ws)
                .unwrap()
        });
        report(&format!("sample top-p 0.95 rows={rows}"), ms, 0.0);
        assert!(down(&s, &out)
            .iter()
            .all(|&t| (0..vocab as i32).contains(&t)));
    }
}

/// The output head's one-row product (248,320 x 2,048 q6_g64, the model's shape) back to back,
/// and right after a one-row bf16 product over 16 GiB or over 64 MiB of weights: both leave
/// L2 holding other lines, but only the 16 GiB one walks through more 2 MiB pages (8,192) than
/// the GPU's address translation caches hold, as a decode step does across its 20 GB of
/// weights. A head slower after the larger product pays for page walks, not for bytes.
#[test]
#[ignore]
fn bench_head_after_far_reads() {
    let Some(g) = gpu() else { return };
    let s = g.stream();
    let mut rng = Rng::new(1003);
    let (n, k) = (248_320, 2048);
    let bytes = n as f64 * k as f64 * 0.78125;
    let w = HostMat::random(Enc::Q6, 1, n, k, 1, &mut rng).upload(&s);
    let x = up(&s, &rng.bf16s(k, 1.0));
    let mut y = nan_f32(&s, n);
    let warm = time_ms(&s, 16, || g.ks.gemv(&s, &w.view(), &x, 1, k, &mut y, n).unwrap());
    report("head q6_g64 248320x2048 b=1, back to back", warm, bytes);
    for (name, rows) in [("16 GiB", 4usize << 20), ("64 MiB", 16 << 10)] {
        let far = s.alloc_zeros::<bf16>(rows * k).unwrap();
        let fv = MatrixView { weights: Weights::Bf16 { data: far.slice(..) }, experts: 1, rows, cols: k };
        let mut fy = s.alloc_zeros::<f32>(rows).unwrap();
        let iters = 8;
        let mut total = 0.0;
        for _ in 0..iters {
            g.ks.gemv(&s, &fv, &x, 1, k, &mut fy, rows).unwrap();
            let start = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
            g.ks.gemv(&s, &w.view(), &x, 1, k, &mut y, n).unwrap();
            let end = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
            end.synchronize().unwrap();
            total += start.elapsed_ms(&end).unwrap() as f64;
        }
        report(&format!("head q6_g64 248320x2048 b=1, after a product over {name}"), total / iters as f64, bytes);
    }
    finite_f32(&down(&s, &y));
}
