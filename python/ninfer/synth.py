"""Synthetic artifacts: the real shapes and encodings of a model with random values
(`ninfer synth --preset qwen3.6-35b-a3b -o X.ninfer`), for measuring speed without a download.

Values are random but sane: NVFP4 codes uniform over all 16 codes with E4M3 block scales near 10
and a global scale of 1e-3 (weights of order 0.01), integer codes uniform with small f16 scales,
zero-centred norm weights near 0, decays in the usual range, and a router drawn so that expert
choice is spread (no expert wins every token). Each tensor is generated and written on its own,
so memory stays bounded by the largest tensor; the Qwen3.5/3.6 tokenizer shipped with ninfer and
our chat template go in as resources, so the artifact serves.
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ninfer import __version__, _core

__all__ = ["PRESETS", "synth"]

MODELS = Path(__file__).parent / "models"


def _qwen36_config(layers: int = 40) -> dict:
    """model-spec.md §1.1, resolved as docs/format.md §4."""
    return {
        "hidden_size": 2048, "num_layers": layers,
        "layer_types": [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)],
        "vocab_size": 248320, "rms_norm_eps": 1e-6,
        "num_attention_heads": 16, "num_kv_heads": 2, "head_dim": 256, "rotary_dim": 64, "rope_theta": 1e7,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel": 4,
        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "eos_token_ids": [248046, 248044],
        "max_position_embeddings": 262144,
    }


def _tiny_config() -> dict:
    cfg = _qwen36_config(4)
    cfg.update(hidden_size=256, num_attention_heads=4, head_dim=64, rotary_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=16,
               num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=128)
    return cfg


@dataclass(frozen=True)
class Preset:
    config: dict
    projections: str  # encoding of attention and GDN projections
    mtp: bool = True


PRESETS = {
    "qwen3.6-35b-a3b": Preset(_qwen36_config(), "q8_g32"),
    "qwen3.6-35b-a3b-bf16": Preset(_qwen36_config(), "bf16"),
    "tiny": Preset(_tiny_config(), "q8_g32"),
}


# Bulk codes (4-bit pairs, q6 and q8 values) are slices of one random pool at random offsets:
# drawn one byte at a time they ran at ~0.2 GB/s (the 21 GB preset in ~100 s on a 16-core GPU
# host; 68 s from the pool). Speed does not depend on the values, and every tensor still starts
# at its own random place in the pool.
POOL_BYTES = 1 << 27


class _Gen:
    def __init__(self, writer, seed: int):
        self.w = writer
        self.rng = np.random.default_rng(seed)
        self.bytes = 0
        self.count = 0
        self._pool: np.ndarray | None = None

    def _pooled(self, n: int) -> np.ndarray:
        """`n` uniformly random bytes: the pool read from a random offset, wrapping around."""
        if self._pool is None:
            self._pool = self.rng.integers(0, 256, POOL_BYTES, dtype=np.uint8)
        start = int(self.rng.integers(0, POOL_BYTES))
        if start + n <= POOL_BYTES:
            return self._pool[start:start + n]
        laps = (start + n) // POOL_BYTES
        return np.concatenate([self._pool[start:]] + [self._pool] * laps)[:n]

    def _add(self, name: str, enc: str, shape: list[int], comp: str, parts: list[tuple[str, list[int], bytes]]) -> None:
        self.w.add_tensor(name, enc, shape, comp, parts)
        self.bytes += sum(len(p[2]) for p in parts)
        self.count += 1

    def bf16(self, name: str, shape: list[int], std: float, mean: float = 0.0, comp: str = "text") -> None:
        x = (self.rng.standard_normal(int(np.prod(shape)), dtype=np.float32) * std + mean).astype(np.float32)
        bits = (x.view(np.uint32) >> 16).astype("<u2")
        self._add(name, "bf16", shape, comp, [("data", shape, bits.tobytes())])

    def f32(self, name: str, values: np.ndarray, comp: str = "text") -> None:
        self._add(name, "f32", list(values.shape), comp, [("data", list(values.shape), values.astype("<f4").tobytes())])

    def _codes(self, n: int) -> bytes:
        return self._pooled(n).tobytes()

    def _q8(self, n: int) -> bytes:
        """int8 values in [-127, 127] (q8_g32 has no -128)."""
        q = self._pooled(n).view(np.int8)
        return np.where(q == -128, np.int8(-127), q).tobytes()

    def _f16(self, n: int, value: float) -> bytes:
        return (value * self.rng.uniform(0.8, 1.25, n)).astype("<f2").tobytes()

    def matrix(self, name: str, enc: str, shape: list[int], comp: str = "text") -> None:
        k = shape[-1]
        lead, n = shape[:-1], int(np.prod(shape[:-1]))
        std = 1.0 / np.sqrt(k)
        if enc == "bf16":
            self.bf16(name, shape, std, comp=comp)
        elif enc == "q8_g32":
            q = self._q8(n * k)
            self._add(name, enc, shape, comp, [("q", shape, q), ("scales", lead + [k // 32], self._f16(n * k // 32, std * 1.7 / 127))])
        elif enc == "q6_g64":
            parts = [("ql", lead + [k // 2], self._codes(n * k // 2)), ("qh", lead + [k // 4], self._codes(n * k // 4)),
                     ("scales", lead + [k // 64], self._f16(n * k // 64, std * 1.7 / 31))]
            self._add(name, enc, shape, comp, parts)
        elif enc == "nvfp4":
            mats = n // shape[-2]
            # E4M3 codes 0x4E..0x56 are 7..14; the global scale brings the rms weight to 1/sqrt(k).
            scales = self.rng.integers(0x4E, 0x57, n * k // 16, dtype=np.uint8).tobytes()
            # Uniform codes have an rms magnitude of ~2.93 and the block scales average ~10.5.
            glob = np.full((mats, 1), std / (2.93 * 10.5), dtype="<f4")
            parts = [("codes", lead + [k // 2], self._codes(n * k // 2)), ("scales", lead + [k // 16], scales),
                     ("global", [mats, 1], glob.tobytes())]
            self._add(name, enc, shape, comp, parts)
        else:
            raise ValueError(f"synth has no generator for {enc}")


def _layer(g: _Gen, p: str, full: bool, cfg: dict, proj: str, comp: str) -> None:
    H = cfg["hidden_size"]
    g.bf16(f"{p}.attn_norm", [H], 0.05, comp=comp)
    g.bf16(f"{p}.moe_norm", [H], 0.05, comp=comp)
    if full:
        hq, hkv, d = cfg["num_attention_heads"], cfg["num_kv_heads"], cfg["head_dim"]
        g.matrix(f"{p}.attn.q", proj, [2 * hq * d, H], comp)
        g.matrix(f"{p}.attn.k", proj, [hkv * d, H], comp)
        g.matrix(f"{p}.attn.v", proj, [hkv * d, H], comp)
        g.matrix(f"{p}.attn.o", proj, [H, hq * d], comp)
        g.bf16(f"{p}.attn.q_norm", [d], 0.05, comp=comp)
        g.bf16(f"{p}.attn.k_norm", [d], 0.05, comp=comp)
    else:
        hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        conv = 2 * hk * dk + hv * dv
        g.matrix(f"{p}.gdn.qkv", proj, [conv, H], comp)
        g.matrix(f"{p}.gdn.z", proj, [hv * dv, H], comp)
        g.matrix(f"{p}.gdn.b", proj, [hv, H], comp)
        g.matrix(f"{p}.gdn.a", proj, [hv, H], comp)
        g.bf16(f"{p}.gdn.conv", [conv, cfg["linear_conv_kernel"]], 0.3, comp=comp)
        g.f32(f"{p}.gdn.A_log", np.log(g.rng.uniform(1, 16, hv)), comp)
        g.f32(f"{p}.gdn.dt_bias", g.rng.standard_normal(hv) * 0.5, comp)
        g.bf16(f"{p}.gdn.norm", [dv], 0.05, mean=1.0, comp=comp)
        g.matrix(f"{p}.gdn.out", proj, [H, hv * dv], comp)
    E, I, Is = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    # Router logits of std ~1 over the experts spread the top-k choice across all of them.
    g.bf16(f"{p}.moe.router", [E, H], 1.0 / np.sqrt(H), comp=comp)
    g.matrix(f"{p}.moe.experts.gate_up", "nvfp4", [E, 2 * I, H], comp)
    g.matrix(f"{p}.moe.experts.down", "nvfp4", [E, H, I], comp)
    if Is:
        g.matrix(f"{p}.moe.shared.gate_up", "nvfp4", [2 * Is, H], comp)
        g.matrix(f"{p}.moe.shared.down", "nvfp4", [H, Is], comp)
        g.bf16(f"{p}.moe.shared_gate", [1, H], 1.0 / np.sqrt(H), comp=comp)


def synth(preset: str, out: str | Path, seed: int = 0, progress: bool = True) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset `{preset}` (known: {', '.join(PRESETS)})")
    p = PRESETS[preset]
    cfg = p.config
    out = Path(out)
    start = time.perf_counter()
    w = _core.ArtifactWriter(str(out), 1 << 20)
    w.set_meta("qwen3_5_moe", f"synthetic {preset}", json.dumps({"recipe": f"synthetic:{preset}", "converter": f"ninfer {__version__}", "seed": seed}))
    w.set_component("text", json.dumps(cfg))
    if p.mtp:
        w.set_component("mtp", json.dumps({"num_layers": 1}))
    g = _Gen(w, seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    g.matrix("embed", "q8_g32", [V, H])
    # The running line rewrites itself on a terminal only; a log gets the closing line alone.
    live = progress and sys.stderr.isatty()
    for i, kind in enumerate(cfg["layer_types"]):
        _layer(g, f"layers.{i}", kind == "full_attention", cfg, p.projections, "text")
        if live:
            rate = g.bytes / 1e9 / (time.perf_counter() - start)
            print(f"\rsynth {preset}: layer {i + 1}/{len(cfg['layer_types'])}, {g.bytes / 1e9:.1f} GB, {rate:.2f} GB/s", end="", file=sys.stderr, flush=True)
    g.bf16("final_norm", [H], 0.05)
    g.matrix("head", "q6_g64", [V, H])
    if p.mtp:
        g.bf16("mtp.norm_emb", [H], 0.05, comp="mtp")
        g.bf16("mtp.norm_hidden", [H], 0.05, comp="mtp")
        g.matrix("mtp.fc", "q8_g32", [H, 2 * H], "mtp")
        _layer(g, "mtp.layers.0", True, cfg, "q8_g32", "mtp")
        g.bf16("mtp.final_norm", [H], 0.05, comp="mtp")
    w.add_resource("tokenizer.json", gzip.decompress((MODELS / "qwen3_6_tokenizer.json.gz").read_bytes()))
    from ninfer.chat import default_template

    w.add_resource("chat_template.jinja", default_template().encode())
    w.add_resource("generation_config.json", json.dumps({"eos_token_id": cfg["eos_token_ids"], "temperature": 0.7, "top_p": 0.95, "top_k": 20}).encode())
    w.finish()
    seconds = time.perf_counter() - start
    if progress:
        back = "\r" if live else ""
        print(f"{back}synth {preset}: {g.count} tensors, {g.bytes / 1e9:.2f} GB in {seconds:.0f} s -> {out}", file=sys.stderr)
    return {"path": str(out), "tensors": g.count, "bytes": g.bytes, "seconds": seconds}
