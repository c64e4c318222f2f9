"""Parity at the real widths: ninfer's CUDA backend against Hugging Face transformers on the same
GPU, on a random model with every width of Qwen3.6-35B-A3B (hidden 2048, 16 query / 2 KV heads of
256, GDN 16 key / 32 value heads of 128, 256 experts top-8 of width 512 and a shared expert of
512, the real vocabulary) and 4 layers (3 GDN, 1 attention). The goldens of test_golden.py are tiny;
kernels that tile over 2048 columns, 256 experts or 248320 logits meet those sizes only here.

Steps: build the model with transformers (the init rules of scripts/make_golden.py: unit-scale
blocks, a router sharp enough that top-k choices are clear, randomised norms and decays), save it
as a bf16 checkpoint, convert it with the `bf16` recipe, then on a 1,000-token random prompt compare
32 rows of logits (the prompt's last position, then 31 decode steps through the cache), teacher-
forced on the greedy tokens of the reference: transformers in float32 on the same bf16 weights.

Bounds (those of test_gpu.py, for the same reason): the GPU keeps activations in bf16, so it may be
as far from the f32 reference as transformers' own bf16 run, whose distance is printed as the noise
floor. Measured on an H200 for this model (eager paths): a median row error of 1.4e-2, a 90th
percentile of 3.2e-2, a largest row of 8.0e-2 (with the weights drawn on the host instead: 2.0e-2,
4.4e-2, 6.4e-2; sdpa with grouped experts the same); the bf16 run still picked the reference token
at every step with a clear margin. test_gpu's TYPICAL_TOL (5e-2 on the median, 2.5 times that
floor here, 1.4 times transformers' bf16 median on the noisiest golden model) and SPREAD_TOL (0.2
on the 90th percentile) hold the GPU to it. Greedy: the
reference's argmax at 80% or more of the steps whose two best logits are at least MARGIN (relative
to the logits' rms) apart, as in test_gpu.py; the free-running tokens are reported. The CPU
backend, in f32, lies 1.4e-6 from the reference on this model, so conversion at these widths adds
nothing. The test takes about two minutes on an H200 host, most of it writing and converting the
8.4 GB checkpoint: marked slow.

The same functions run the CPU backend on a small model of the same kinds (no GPU needed): there
ninfer computes in f32 and is held to test_golden.py's LOGIT_TOL on every row.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runner_util import slot, step

from test_golden import LOGIT_TOL, rel_err
from test_gpu import MARGIN, SKIP, SPREAD_TOL, TYPICAL_TOL, check_spread, margins

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
PERIOD = ["linear_attention"] * 3 + ["full_attention"]

# make_golden.make_config fields; mrope_section sums to head_dim * 0.25 / 2.
MIDSIZE: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=4, layer_types=PERIOD,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, mrope_section=[11, 11, 10],
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
)
# Small enough for a CPU in seconds, with the same ratios (GQA 2, GDN value/key 2, top-k of many).
SMALL: dict[str, Any] = dict(
    MIDSIZE, vocab_size=4096, hidden_size=256, num_attention_heads=4, head_dim=64, mrope_section=[3, 3, 2],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=128,
)
SEED = 4242


def _torch_missing() -> str | None:
    for mod in ("torch", "transformers", "safetensors"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    return None


def _make_golden() -> Any:
    """scripts/make_golden.py as a module: its config builder, init rules and reference paths."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    import make_golden

    return make_golden


def build_checkpoint(fields: dict[str, Any], out: Path, device: str, seed: int = SEED) -> None:
    """A seeded random bf16 checkpoint (config.json, model.safetensors) in `out`, drawn on `device`
    with make_golden's init rules. At the real widths (4.2 B parameters) the host would spend minutes
    on the library's default init and on make_golden's CPU draws; so the model is allocated without
    init (every parameter is then overwritten) and drawn in bf16 by a generator on `device`, which
    rounds as make_golden's `.to(bfloat16)` does. The values depend on the device's generator."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM

    mg = _make_golden()
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM._from_config(mg.make_config(fields), dtype=torch.bfloat16)
    model.to_empty(device=device)
    # randomise draws with default-device factories: the device context puts them on `device`.
    with torch.device(device):
        mg.randomise(model, torch.Generator(device=device).manual_seed(seed))
    model.save_pretrained(out, safe_serialization=True)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def load(src: Path, dtype: Any, device: str) -> Any:
    """The checkpoint in transformers, computing in `dtype` on `device`, on the reference paths
    (eager attention, the per-expert loop; model-spec.md 2.7)."""
    from transformers import Qwen3_5MoeForCausalLM

    # Loaded on the host and moved: a `device_map` would need the `accelerate` package.
    return _make_golden().eager(Qwen3_5MoeForCausalLM.from_pretrained(src, dtype=dtype).to(device))


def transformers_steps(model: Any, prompt: list[int], steps: int, forced: list[int] | None = None) -> tuple[np.ndarray, list[int]]:
    """Logits [steps, V] in f32 of the prompt's last position and of each decode step through the
    cache, and the tokens fed: `forced` when given (teacher forcing), else each step's argmax."""
    import torch

    dev = model.device
    rows, toks = [], []
    with torch.inference_mode():
        out = model(torch.tensor([prompt], device=dev), use_cache=True, logits_to_keep=1)
        for i in range(steps):
            row = out.logits[0, -1].float()
            rows.append(row.cpu().numpy())
            toks.append(forced[i] if forced is not None else int(row.argmax()))
            if i + 1 < steps:
                out = model(torch.tensor([[toks[-1]]], device=dev), past_key_values=out.past_key_values,
                            use_cache=True, logits_to_keep=1)
    return np.stack(rows), toks


def ninfer_steps(artifact: Path, device: str, prompt: list[int], forced: list[int], vocab: int) -> tuple[np.ndarray, int]:
    """ninfer's logits [steps, V] teacher-forced on `forced` (as transformers_steps), and how many
    tokens free-running greedy decoding keeps equal to `forced` before the first difference."""
    from ninfer._core import Runner

    runner = Runner(str(artifact), device=device, max_slots=1, max_context=len(prompt) + len(forced) + 16)
    if device == "cuda":
        assert runner.backend_name.startswith("cuda:")
    with slot(runner) as s:
        ours = np.stack([step(runner, s, prompt, vocab)] + [step(runner, s, [t], vocab) for t in forced[:-1]])
    free: list[int] = []
    with slot(runner) as s:
        logits = step(runner, s, prompt, vocab)
        while len(free) < len(forced):
            free.append(int(np.argmax(logits)))
            if free[-1] != forced[len(free) - 1]:
                break
            logits = step(runner, s, [free[-1]], vocab)
    same = next((i for i, (a, b) in enumerate(zip(free, forced)) if a != b), len(free))
    return ours, same


def run_parity(fields: dict[str, Any], tmp: Path, device: str, prompt_len: int, steps: int,
               with_bf16: bool = True) -> dict[str, Any]:
    """Builds, converts and runs the model; returns the logits of the reference (transformers f32),
    of transformers bf16 (the noise floor, when `with_bf16`) and of ninfer, with the tokens."""
    import torch
    from ninfer.convert import convert

    ckpt, art = tmp / "hf", tmp / "model.ninfer"
    tdev = "cuda" if device == "cuda" else "cpu"
    build_checkpoint(fields, ckpt, tdev)
    convert(str(ckpt), str(art), recipe="bf16", progress=False)
    prompt = np.random.default_rng(SEED).integers(0, fields["vocab_size"], prompt_len).tolist()
    model = load(ckpt, torch.float32, tdev)
    ref, gold = transformers_steps(model, prompt, steps)
    del model
    bf16 = None
    if with_bf16:
        model = load(ckpt, torch.bfloat16, tdev)
        bf16, _ = transformers_steps(model, prompt, steps, forced=gold)
        del model
    if tdev == "cuda":
        torch.cuda.empty_cache()
    ours, same = ninfer_steps(art, device, prompt, gold, fields["vocab_size"])
    return {"ref": ref, "bf16": bf16, "ours": ours, "gold": gold, "free_same": same}


def check_parity(r: dict[str, Any], what: str, max_tol: float | None = None) -> None:
    """Logit bounds (every row below `max_tol` when given, else test_gpu's median and 90th
    percentile) and greedy agreement at the steps with a clear top-2 margin."""
    ref, ours, gold = r["ref"], r["ours"], r["gold"]
    assert np.isfinite(ref).all() and np.isfinite(ours).all(), f"{what}: non-finite logits"
    if r["bf16"] is not None:
        floor = rel_err(r["bf16"], ref)
        print(f"{what} noise floor, transformers bf16 vs f32: median {np.median(floor):.2e}, "
              f"p90 {np.quantile(floor, 0.9):.2e}, max {floor.max():.2e}")
    err = rel_err(ours, ref)
    if max_tol is not None:
        print(f"{what}: row errors max {err.max():.2e} over {err.size} rows")
        assert err.max() < max_tol, f"{what}: row error {err.max():.2e} at step {int(err.argmax())}"
    else:
        check_spread(err, what)
    sure = margins(ref) >= MARGIN
    hits = int((np.argmax(ours, axis=-1)[sure] == np.asarray(gold)[sure]).sum())
    print(f"{what}: free-running {r['free_same']}/{len(gold)} tokens equal, teacher-forced {hits}/{int(sure.sum())} sure steps")
    assert sure.sum() > 0, f"{what}: no step with a clear top-2 margin"
    assert hits >= 0.8 * sure.sum(), f"{what}: reference token at {hits} of {int(sure.sum())} sure steps"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(SKIP is not None or _torch_missing() is not None, reason=SKIP or _torch_missing() or "")
def test_midsize_cuda_matches_transformers(tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    r = run_parity(MIDSIZE, tmp_path, "cuda", prompt_len=1000, steps=32)
    check_parity(r, "midsize cuda")


@pytest.mark.skipif(_torch_missing() is not None, reason=_torch_missing() or "")
def test_small_cpu_matches_transformers(tmp_path: Path) -> None:
    """The same pipeline on the CPU backend, which computes in f32: every row within LOGIT_TOL."""
    r = run_parity(SMALL, tmp_path, "cpu", prompt_len=100, steps=16, with_bf16=False)
    check_parity(r, "small cpu", max_tol=LOGIT_TOL)
