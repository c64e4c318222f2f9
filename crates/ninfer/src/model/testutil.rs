//! Test support: a tiny random qwen3_5_moe artifact with the real block structure (3 GDN layers
//! then 1 attention layer, grouped q/k heads in both mixers, 8 experts top-2, optional shared
//! expert and MTP block), written with the artifact writer into a temporary directory.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::json;

use crate::artifact::{ArtifactWriter, Encoding};

pub(crate) const HIDDEN: usize = 64;
pub(crate) const VOCAB: usize = 97;
const LAYERS: usize = 4;
const HQ: usize = 4;
const HKV: usize = 2;
const HEAD_DIM: usize = 16;
const GDN_HK: usize = 2;
const GDN_HV: usize = 4;
const GDN_D: usize = 16;
const KERNEL: usize = 4;
const EXPERTS: usize = 8;
const WIDTH: usize = 32;

pub(crate) struct TinyOpts {
    /// Shared expert width; 0 = no shared expert (its tensors are not written).
    pub shared: usize,
    pub mtp: bool,
    /// A tensor to leave out (load-error tests).
    pub omit: Option<&'static str>,
    /// A tensor to write with a wrong shape (load-error tests).
    pub misshape: Option<&'static str>,
}

impl Default for TinyOpts {
    fn default() -> Self {
        TinyOpts { shared: WIDTH, mtp: true, omit: None, misshape: None }
    }
}

/// Deterministic pseudo-random values in [-1, 1).
pub(crate) fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Largest absolute difference divided by the largest absolute reference value.
pub(crate) fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let m = want.iter().fold(0f32, |m, e| m.max(e.abs()));
    got.iter().zip(want).fold(0f32, |e, (x, y)| e.max((x - y).abs())) / m
}

/// Token ids in range, deterministic.
pub(crate) fn tokens(seed: u64, n: usize) -> Vec<u32> {
    noise(seed, n).iter().map(|e| ((e + 1.0) * 0.5 * VOCAB as f32) as u32 % VOCAB as u32).collect()
}

pub(crate) fn tmp_path(tag: &str) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("ninfer-model-{}-{tag}-{n}.ninfer", std::process::id()))
}

pub(crate) fn config_json(shared: usize) -> serde_json::Value {
    json!({
        "hidden_size": HIDDEN, "num_layers": LAYERS,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
        "num_attention_heads": HQ, "num_kv_heads": HKV, "head_dim": HEAD_DIM, "rotary_dim": 4, "rope_theta": 1e7,
        "linear_num_key_heads": GDN_HK, "linear_num_value_heads": GDN_HV,
        "linear_key_head_dim": GDN_D, "linear_value_head_dim": GDN_D, "linear_conv_kernel": KERNEL,
        "num_experts": EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": WIDTH,
        "shared_expert_intermediate_size": shared, "eos_token_ids": [1], "max_position_embeddings": 4096
    })
}

struct Gen<'a> {
    w: ArtifactWriter,
    opts: &'a TinyOpts,
    seed: u64,
}

impl Gen<'_> {
    /// Adds a tensor of uniform values in ±`scale` (plus `offset`), as f32 or `enc`.
    fn put(&mut self, name: &str, shape: &[usize], scale: f32, offset: f32, enc: Encoding, component: &str) {
        if self.opts.omit == Some(name) {
            return;
        }
        self.seed += 1;
        let n: usize = shape.iter().product();
        let vals: Vec<f32> = noise(self.seed, n).iter().map(|e| e * scale + offset).collect();
        let shape = if self.opts.misshape == Some(name) { vec![n] } else { shape.to_vec() };
        self.w.add_f32(name, enc, &shape, component, &vals).expect("tiny tensor");
    }

    fn mat(&mut self, name: &str, rows: usize, cols: usize, component: &str) {
        self.put(name, &[rows, cols], 1.7 / (cols as f32).sqrt(), 0.0, Encoding::F32, component);
    }

    fn norm(&mut self, name: &str, len: usize, component: &str) {
        self.put(name, &[len], 0.4, 0.0, Encoding::F32, component);
    }

    fn layer(&mut self, p: &str, full: bool, component: &str) {
        let h = HIDDEN;
        self.norm(&format!("{p}.attn_norm"), h, component);
        self.norm(&format!("{p}.moe_norm"), h, component);
        if full {
            self.mat(&format!("{p}.attn.q"), 2 * HQ * HEAD_DIM, h, component);
            self.mat(&format!("{p}.attn.k"), HKV * HEAD_DIM, h, component);
            self.mat(&format!("{p}.attn.v"), HKV * HEAD_DIM, h, component);
            self.mat(&format!("{p}.attn.o"), h, HQ * HEAD_DIM, component);
            self.norm(&format!("{p}.attn.q_norm"), HEAD_DIM, component);
            self.norm(&format!("{p}.attn.k_norm"), HEAD_DIM, component);
        } else {
            let (kd, vd) = (GDN_HK * GDN_D, GDN_HV * GDN_D);
            self.mat(&format!("{p}.gdn.qkv"), 2 * kd + vd, h, component);
            self.mat(&format!("{p}.gdn.z"), vd, h, component);
            self.mat(&format!("{p}.gdn.b"), GDN_HV, h, component);
            self.mat(&format!("{p}.gdn.a"), GDN_HV, h, component);
            self.put(&format!("{p}.gdn.conv"), &[2 * kd + vd, KERNEL], 0.6, 0.0, Encoding::F32, component);
            self.put(&format!("{p}.gdn.A_log"), &[GDN_HV], 1.0, -0.5, Encoding::F32, component);
            self.put(&format!("{p}.gdn.dt_bias"), &[GDN_HV], 1.0, 0.0, Encoding::F32, component);
            self.put(&format!("{p}.gdn.norm"), &[GDN_D], 0.4, 1.0, Encoding::F32, component);
            // One quantized matrix, so loading goes through a real dequantizer.
            self.put(&format!("{p}.gdn.out"), &[h, vd], 1.7 / (vd as f32).sqrt(), 0.0, Encoding::Q8G32, component);
        }
        self.put(&format!("{p}.moe.router"), &[EXPERTS, h], 2.0 / (h as f32).sqrt(), 0.0, Encoding::F32, component);
        self.put(&format!("{p}.moe.experts.gate_up"), &[EXPERTS, 2 * WIDTH, h], 1.7 / (h as f32).sqrt(), 0.0, Encoding::F32, component);
        self.put(&format!("{p}.moe.experts.down"), &[EXPERTS, h, WIDTH], 1.7 / (WIDTH as f32).sqrt(), 0.0, Encoding::F32, component);
        let s = self.opts.shared;
        if s > 0 {
            self.mat(&format!("{p}.moe.shared.gate_up"), 2 * s, h, component);
            self.mat(&format!("{p}.moe.shared.down"), h, s, component);
            self.mat(&format!("{p}.moe.shared_gate"), 1, h, component);
        }
    }
}

/// Writes a tiny random model and returns its path (the caller removes it).
pub(crate) fn write_tiny(tag: &str, opts: &TinyOpts) -> PathBuf {
    let path = tmp_path(tag);
    let mut w = ArtifactWriter::create(&path, 1 << 20).expect("create tiny artifact");
    w.set_meta("qwen3_5_moe", "tiny-test", json!({}));
    w.set_component("text", config_json(opts.shared));
    if opts.mtp {
        w.set_component("mtp", json!({"num_layers": 1}));
    }
    let mut g = Gen { w, opts, seed: 1000 };
    g.put("embed", &[VOCAB, HIDDEN], 1.0, 0.0, Encoding::F32, "text");
    for i in 0..LAYERS {
        g.layer(&format!("layers.{i}"), i == LAYERS - 1, "text");
    }
    g.norm("final_norm", HIDDEN, "text");
    g.mat("head", VOCAB, HIDDEN, "text");
    if opts.mtp {
        g.norm("mtp.norm_emb", HIDDEN, "mtp");
        g.norm("mtp.norm_hidden", HIDDEN, "mtp");
        g.mat("mtp.fc", HIDDEN, 2 * HIDDEN, "mtp");
        g.layer("mtp.layers.0", true, "mtp");
        g.norm("mtp.final_norm", HIDDEN, "mtp");
    }
    g.w.finish().expect("finish tiny artifact")
}
