"""Builds the demo model bundled in the wheel: python/ninfer/models/demo.ninfer.

By default the demo is ninfer-tiny, the small `qwen3_5_moe` trained by scripts/train_tiny.py on
Python source code (checkpoint in tests/fixtures/ninfer-tiny/), converted with the
`qwen3_6_35b_a3b_nvfp4` recipe: `ninfer generate "def fibonacci(n):"` writes plausible Python on
any machine. docs/quality.md gives its perplexities.

With `--random` (or when that checkpoint is missing) it is instead a tiny model of the same block
structure (3 Gated DeltaNet layers + 1 gated attention layer, routed experts top-2 with a shared
expert) with RANDOM weights, whose text is noise. Its tokenizer is a small byte-level BPE trained
here on the Python standard library's sources, holding the Qwen special tokens by name so the
Qwen3.6 chat template works on it; scripts/train_tiny.py trains its tokenizer with the same code.

Needs numpy, the built `ninfer` package and, for `--random`, the `tokenizers` Python package (a
development dependency, not a runtime one). Run from the repository root:
`python scripts/make_demo_model.py`. The random model is deterministic for a given Python version
(the corpus is that version's standard library).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
TINY = ROOT / "tests" / "fixtures" / "ninfer-tiny"

# model-spec.md §5.1, in id order.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
]


def stdlib_files(limit_bytes: int) -> list[str]:
    """Python sources of the standard library, in a fixed order, up to `limit_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or "test" in p.parts:
            continue
        size = p.stat().st_size
        if total + size > limit_bytes:
            break
        out.append(str(p))
        total += size
    return out


def train_tokenizer(vocab_size: int, files: list[str]) -> str:
    """Byte-level BPE over `files`; the Qwen special tokens are appended after the merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    tok.add_special_tokens(QWEN_SPECIAL_TOKENS)
    return tok.to_str()


def save_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Minimal safetensors writer (F32), kept here so the script needs no torch."""
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for b in blobs:
            f.write(b)


def random_checkpoint(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Weights with std 1/sqrt(fan_in), random norms and decays (model-spec.md §6.3 pitfalls)."""
    rng = np.random.default_rng(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    hk, hv, dk, dv = (cfg[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"))
    E, I, Is = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    conv = 2 * hk * dk + hv * dv

    def mat(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1])

    def norm(n: int, centre: float = 0.0) -> np.ndarray:
        return (centre + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32),
         "model.norm.weight": norm(H), "lm_head.weight": mat(V, H)}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(H)
        t[p + "post_attention_layernorm.weight"] = norm(H)
        if kind == "linear_attention":
            a = p + "linear_attn."
            t[a + "in_proj_qkv.weight"] = mat(conv, H)
            t[a + "in_proj_z.weight"] = mat(hv * dv, H)
            t[a + "in_proj_b.weight"] = mat(hv, H)
            t[a + "in_proj_a.weight"] = mat(hv, H)
            t[a + "conv1d.weight"] = (0.5 * rng.standard_normal((conv, 1, 4))).astype(np.float32)
            t[a + "A_log"] = np.log(rng.uniform(0.5, 8, hv)).astype(np.float32)
            t[a + "dt_bias"] = rng.standard_normal(hv).astype(np.float32)
            t[a + "norm.weight"] = norm(dv, 1.0)
            t[a + "out_proj.weight"] = mat(H, hv * dv)
        else:
            a = p + "self_attn."
            t[a + "q_proj.weight"] = mat(2 * hq * d, H)
            t[a + "k_proj.weight"] = mat(hkv * d, H)
            t[a + "v_proj.weight"] = mat(hkv * d, H)
            t[a + "o_proj.weight"] = mat(H, hq * d)
            t[a + "q_norm.weight"] = norm(d)
            t[a + "k_norm.weight"] = norm(d)
        m = p + "mlp."
        t[m + "gate.weight"] = 2 * mat(E, H)
        t[m + "experts.gate_up_proj"] = mat(E, 2 * I, H)
        t[m + "experts.down_proj"] = mat(E, H, I)
        t[m + "shared_expert.gate_proj.weight"] = mat(Is, H)
        t[m + "shared_expert.up_proj.weight"] = mat(Is, H)
        t[m + "shared_expert.down_proj.weight"] = mat(H, Is)
        t[m + "shared_expert_gate.weight"] = mat(1, H)
    return t


def demo_config(vocab: int, eos: list[int]) -> dict:
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab, "hidden_size": 128, "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "eos_token_id": eos,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [4, 2, 2], "mrope_interleaved": True},
    }


def random_source(dst: Path, vocab: int, seed: int) -> None:
    """Writes the random-weights checkpoint directory `dst`."""
    from ninfer.chat import default_template

    tok_json = train_tokenizer(vocab, stdlib_files(8 << 20))
    added = {t["content"]: t["id"] for t in json.loads(tok_json)["added_tokens"]}
    eos = [added["<|im_end|>"], added["<|endoftext|>"]]
    cfg = demo_config(vocab, eos)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    (dst / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos, "pad_token_id": eos[1], "do_sample": True, "temperature": 0.7, "top_p": 0.95, "top_k": 20}))
    (dst / "tokenizer.json").write_text(tok_json)
    (dst / "chat_template.jinja").write_text(default_template())
    save_safetensors(dst / "model.safetensors", random_checkpoint(cfg, seed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", default=str(ROOT / "python/ninfer/models/demo.ninfer"))
    ap.add_argument("--source", default=str(TINY), help="trained checkpoint to convert (default: ninfer-tiny)")
    ap.add_argument("--random", action="store_true", help="build the random-weights model instead")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary of the random model")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random model")
    args = ap.parse_args()

    from ninfer.convert import convert

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    src = Path(args.source)
    with tempfile.TemporaryDirectory() as tmp:
        if args.random or not (src / "model.safetensors").exists():
            src, name = Path(tmp) / "ninfer-demo", "ninfer-demo (random weights)"
            src.mkdir()
            random_source(src, args.vocab, args.seed)
        else:
            name = "ninfer-tiny"
        report = convert(src, out, "qwen3_6_35b_a3b_nvfp4", name=name, overwrite=True, progress=False)
    for extra in ("conversion_json", "sha256sums"):
        Path(report["paths"][extra]).unlink(missing_ok=True)
    print(f"wrote {out}: {name} ({out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
