"""Build the small random golden models and record Hugging Face transformers' logits for them.

For each model in MODELS this writes tests/fixtures/golden/<name>/:
- a Hugging Face checkpoint (config.json, generation_config.json, model.safetensors in bfloat16; as
  transformers 5.x saves it, the routed experts come per expert, `mlp.experts.<e>.gate_proj.weight`);
- golden.npz: transformers' logits in float32 on those bf16-rounded weights, for every position of
  every prompt, and the logits of 16 greedy steps decoded with the model's cache;
- golden.json: the prompts, the greedy token ids, versions;
- golden_nvfp4.npz (when the converter is available): the same records for transformers run on the
  weights of the `qwen3_6_35b_a3b_nvfp4` recipe, read back dequantized from the converted artifact.
tests/test_golden.py checks the CPU backend against these files without torch (DESIGN.md section 8.2).

The configs follow model-spec.md section 6.3: real ratios, both layer kinds, randomised norm weights,
decays and routers so that (1 + w) norms, head mappings and expert order all change the output.
Every matrix's last dimension is a multiple of 32 (64 for the head) so the quantized recipe applies.

Needs torch, transformers >= 5.17 and safetensors; the NVFP4 part also needs the built `ninfer`
package (its converter and `_core.Artifact`).

Usage: python scripts/make_golden.py [--only NAME ...] [--skip-nvfp4]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "tests" / "fixtures" / "golden"
NVFP4_RECIPE = "qwen3_6_35b_a3b_nvfp4"
DECODE_STEPS = 16
NPZ = {"bf16": "golden.npz", NVFP4_RECIPE: "golden_nvfp4.npz"}
# Smallest accepted gap between the two best logits of a greedy step, relative to the logit norm
# (about 2e-3 in absolute terms here, where two float32 computations of the same logits that sum
# in different orders differ by ~1e-4).
MIN_MARGIN = 1e-4
MAX_PROMPT_TRIES = 40

PERIOD = ["linear_attention"] * 3 + ["full_attention"]

# name -> (seed, prompt lengths, config fields). rope: theta 1e7 and partial factor 0.25 as in the real
# model (model-spec.md 1.1); mrope_section sums to head_dim * 0.25 / 2.
MODELS: dict[str, tuple[int, list[int], dict[str, Any]]] = {
    # The reference shape: GQA 2, GDN value/key ratio 2, one shared expert.
    "tiny-a": (1001, [1, 7, 100], dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, layer_types=PERIOD,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, mrope_section=[2, 1, 1],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )),
    # Odd head counts (GQA 3, GDN ratio 3), two 3+1 periods, no shared expert (transformers builds a
    # zero-width one whose output is exactly zero; the checkpoint leaves its tensors out).
    "tiny-b": (2002, [1, 7, 100], dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=8, layer_types=PERIOD * 2,
        num_attention_heads=3, num_key_value_heads=1, head_dim=64, mrope_section=[4, 2, 2],
        linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=32,
        linear_value_head_dim=32, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
        shared_expert_intermediate_size=0,
    )),
    # Long prompts crossing the GDN chunk size 64 twice (150 tokens); no GQA, GDN ratio 1, top-4 of 16.
    "tiny-c": (3003, [1, 7, 100, 150], dict(
        vocab_size=384, hidden_size=64, num_hidden_layers=4, layer_types=PERIOD,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, mrope_section=[4, 2, 2],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32,
        linear_value_head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    )),
}


def make_config(fields: dict[str, Any]) -> Qwen3_5MoeTextConfig:
    f = dict(fields)
    section = f.pop("mrope_section")
    vocab = f["vocab_size"]
    return Qwen3_5MoeTextConfig(
        **f,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=vocab - 1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": section, "mrope_interleaved": True},
    )


def eager(model: Qwen3_5MoeForCausalLM) -> Qwen3_5MoeForCausalLM:
    """Reference paths: eager attention and the per-expert loop (model-spec.md 2.7)."""
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    return model.eval()


def randomise(model: Qwen3_5MoeForCausalLM, gen: torch.Generator) -> None:
    """Give every parameter a value that matters. Matrices get std 1/sqrt(fan_in) so each block's
    output is of the order of its input; the router is twice as sharp so top-k picks are clear."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() == 0:
                continue
            r = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 7.5 + 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(r)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.3 * r)
            elif p.ndim == 1:
                p.copy_(0.3 * r)
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * r)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(r)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(2.0 * r / math.sqrt(p.shape[-1]))
            else:
                p.copy_(r / math.sqrt(p.shape[-1]))


def save_checkpoint(name: str, seed: int, fields: dict[str, Any], out: Path) -> None:
    cfg = make_config(fields)
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg)
    randomise(model, torch.Generator().manual_seed(seed))
    vocab = cfg.vocab_size
    model.generation_config = GenerationConfig(eos_token_id=[vocab - 2, vocab - 1], do_sample=False)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    # A model without a shared expert has no shared-expert tensors in its checkpoint.
    st = out / "model.safetensors"
    tensors = load_file(st)
    kept = {k: v.contiguous() for k, v in tensors.items()
            if v.numel() > 0 and not (cfg.shared_expert_intermediate_size == 0 and ".shared_expert" in k)}
    save_file(kept, st, metadata={"format": "pt"})
    st.chmod(0o644)
    print(f"{name}: {len(kept)} tensors, {sum(v.numel() for v in kept.values())} parameters")


def load_reference(src: Path) -> Qwen3_5MoeForCausalLM:
    """The bf16 checkpoint, computed in float32."""
    return eager(Qwen3_5MoeForCausalLM.from_pretrained(src, dtype=torch.float32)).float()


def prompts_for(seed: int, lengths: list[int], vocab: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {f"p{n}": torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths}


@torch.no_grad()
def record(model: Qwen3_5MoeForCausalLM, prompts: dict[str, list[int]]) -> tuple[dict[str, np.ndarray],
                                                                                dict[str, list[int]]]:
    """Logits at every prompt position (one uncached pass) and DECODE_STEPS greedy steps: step 0 is
    the prefill's last position, each later step feeds the previous argmax through the cache."""
    arrays: dict[str, np.ndarray] = {}
    greedy: dict[str, list[int]] = {}
    for key, ids in prompts.items():
        x = torch.tensor([ids])
        arrays[f"{key}.logits"] = model(x).logits[0].float().numpy()
        out = model(x, use_cache=True)
        cache = out.past_key_values
        step_logits = [out.logits[0, -1].float()]
        toks = [int(step_logits[-1].argmax())]
        for _ in range(DECODE_STEPS - 1):
            out = model(torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            step_logits.append(out.logits[0, -1].float())
            toks.append(int(step_logits[-1].argmax()))
        arrays[f"{key}.greedy_logits"] = torch.stack(step_logits).numpy()
        greedy[key] = toks
    return arrays, greedy


def margins(arrays: dict[str, np.ndarray]) -> float:
    """Smallest gap between the two best logits over all greedy steps, relative to the logit norm: a
    backend within relative error e of the reference can only flip a token if this is below ~2e."""
    worst = math.inf
    for key, a in arrays.items():
        if key.endswith(".greedy_logits"):
            top = np.sort(a, axis=-1)[:, -2:]
            worst = min(worst, float(((top[:, 1] - top[:, 0]) / np.linalg.norm(a, axis=-1)).min()))
    return worst


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    np.savez_compressed(path, **{k: v.astype(np.float32) for k, v in arrays.items()})


def dequantized_checkpoint(src: Path, work: Path) -> tuple[Path, dict[str, str], str]:
    """Convert `src` with the NVFP4 recipe, read every logical tensor back dequantized and write it
    under the checkpoint names it came from (rows split evenly over `sources`, in order) as a float32
    checkpoint in `work`. Returns that directory, the encodings used and "changed/total" tensors."""
    from ninfer._core import Artifact
    from ninfer.convert import convert

    report = convert(str(src), str(work / "model.ninfer"), recipe=NVFP4_RECIPE, progress=False)
    art = Artifact(report["paths"]["artifact"])
    original = load_file(src / "model.safetensors")
    weights: dict[str, torch.Tensor] = {}
    encodings: dict[str, str] = {}
    for logical, entry in report["tensors"].items():
        shape = entry["shape"]
        data = np.frombuffer(art.tensor_f32(logical), dtype="<f4").reshape(shape)
        sources = entry["sources"]
        rows = data.reshape(-1, shape[-1]) if len(shape) > 1 else data.reshape(-1, 1)
        if rows.shape[0] % len(sources):
            raise ValueError(f"{logical}: {rows.shape[0]} rows do not split over {len(sources)} sources")
        for name, part in zip(sources, np.split(rows, len(sources))):
            weights[name] = torch.from_numpy(part.copy()).reshape(original[name].shape)
        encodings[logical] = entry["encoding"]
    if set(weights) != set(original):
        raise ValueError(f"converter output does not match the checkpoint: {sorted(set(weights) ^ set(original))}")
    changed = sum(int(not torch.equal(original[k].float(), v)) for k, v in weights.items())
    out = work / "hf"
    out.mkdir()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_bytes((src / "config.json").read_bytes())
    return out, encodings, f"{changed}/{len(weights)}"


def make_model(name: str, with_nvfp4: bool) -> None:
    seed, lengths, fields = MODELS[name]
    src = OUT_DIR / name
    save_checkpoint(name, seed, fields, src)
    (src / "golden_nvfp4.npz").unlink(missing_ok=True)
    models = {"bf16": load_reference(src)}
    used: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        if with_nvfp4:
            hf, encodings, changed = dequantized_checkpoint(src, Path(tmp))
            models[NVFP4_RECIPE] = load_reference(hf)
            used = sorted(set(encodings.values()))
            print(f"{name}: {changed} checkpoint tensors changed by {NVFP4_RECIPE} ({used})")
    vocab = models["bf16"].config.vocab_size
    # Prompts whose greedy continuations have no near-tie, for every recipe: a backend that is correct
    # to rounding must not be failed by a coin flip between two almost equal logits.
    for attempt in range(MAX_PROMPT_TRIES):
        prompts = prompts_for(seed + attempt, lengths, vocab)
        results = {recipe: record(model, prompts) for recipe, model in models.items()}
        worst = min(margins(arrays) for arrays, _ in results.values())
        if worst >= MIN_MARGIN:
            break
        print(f"{name}: prompt seed {seed + attempt} has a top-2 margin of {worst:.1e}, trying the next")
    else:
        raise RuntimeError(f"{name}: no prompts with top-2 margin >= {MIN_MARGIN} in {MAX_PROMPT_TRIES} tries")
    meta: dict[str, Any] = {
        "model": name, "seed": seed, "prompt_seed": seed + attempt,
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "compute_dtype": "float32", "decode_steps": DECODE_STEPS,
        "prompts": prompts, "recipes": {},
    }
    for recipe, (arrays, greedy) in results.items():
        npz = NPZ[recipe]
        write_npz(src / npz, arrays)
        meta["recipes"][recipe] = {"npz": npz, "greedy": greedy, "min_top2_margin": margins(arrays)}
        if recipe != "bf16":
            meta["recipes"][recipe]["encodings"] = used
        print(f"{name} {recipe}: greedy {greedy}, min top-2 margin {margins(arrays):.2e}")
    (src / "golden.json").write_text(json.dumps(meta, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", choices=sorted(MODELS), help="models to (re)build")
    ap.add_argument("--skip-nvfp4", action="store_true",
                    help="do not build the NVFP4 goldens (when the converter is not available)")
    args = ap.parse_args()
    for name in args.only or sorted(MODELS):
        make_model(name, not args.skip_nvfp4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
