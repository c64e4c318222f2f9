"""The Hugging Face transformers baseline for `ninfer bench`: the same figures, measured on a
`Qwen3_5MoeForCausalLM` of the same shape with random bf16 weights, on the same device.

What each figure means (python/ninfer/bench.py, docs/performance.md "Method"):
- ppN: one forward pass over an N-token random prompt (with the cache, logits of the last
  position only, as a prefill does); N over the time it takes.
- tg128: after a 512-token prompt, 128 greedy tokens through `model.generate`; 127 tokens over the
  time from the first generated token to the last. That time is the time of a 128-token generate
  minus the time of a 1-token generate on the same prompt, which removes the prefill and the
  first token without hooking into generate. tg128 xC: C such sequences in one batch, aggregate.
- One warm-up run, then `--reps` runs: median, min and max. The roofline fraction is the bf16
  weight bytes one decode step reads (every tensor but the token table, of which one row per
  sequence, and of the expert banks the expected distinct experts) times steps per second, over
  the device's measured copy bandwidth, exactly as bench computes it for an artifact.

The model is built directly on the device in bf16 (70 GB at full size never pass through host
memory) with transformers' own random init; speed does not depend on the values. A figure that
fails (out of memory, say) is reported as failed, and figures that would start after `--budget-s`
seconds are reported as skipped, so one slow path cannot cost the others.

Usage: python scripts/hf_baseline.py [--preset qwen3.6-35b-a3b|tiny] [--device cuda|cpu] [--json]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import statistics
import sys
import time
from typing import Any

import torch
import transformers
from transformers import GenerationConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

PERIOD = ["linear_attention"] * 3 + ["full_attention"]

# The text shape of Qwen3.6-35B-A3B (model-spec.md 1.1, the `qwen3.6-35b-a3b` preset of synth.py).
QWEN36 = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, layer_types=PERIOD * 10,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, mrope_section=[11, 11, 10],
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, max_position_embeddings=262144,
)
# A few MB, every feature of the real one (both layer kinds, GQA, GDN value/key ratio 2, top-k of
# several experts, a shared expert): for proving the script on a CPU.
TINY = dict(QWEN36, vocab_size=4096, hidden_size=256, num_hidden_layers=4, layer_types=PERIOD,
            num_attention_heads=4, head_dim=64, mrope_section=[3, 3, 2], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
            num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
            shared_expert_intermediate_size=128, max_position_embeddings=32768)
PRESETS = {"qwen3.6-35b-a3b": QWEN36, "tiny": TINY}


def make_config(fields: dict[str, Any]) -> Qwen3_5MoeTextConfig:
    f = dict(fields)
    section = f.pop("mrope_section")
    # rope_theta must be given: the library default is 1e4, the model's 1e7 (model-spec.md 1.1).
    return Qwen3_5MoeTextConfig(**f, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                                 "mrope_section": section, "mrope_interleaved": True})


def build_model(fields: dict[str, Any], device: str, attn: str, experts: str | None) -> Qwen3_5MoeForCausalLM:
    torch.manual_seed(0)
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16, "attn_implementation": attn}
    if experts:
        kwargs["experts_implementation"] = experts
    # Allocating and initialising under the device context puts every weight straight on it.
    with torch.device(device):
        model = Qwen3_5MoeForCausalLM._from_config(make_config(fields), **kwargs)
    # No EOS: every sequence decodes exactly the tokens asked for, as bench's ignore_eos does.
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    return model.eval()


def fast_kernels() -> dict[str, str]:
    """Which implementation transformers bound for each GDN kernel: the optimized package
    (flash-linear-attention `fla`, `causal_conv1d`) or its reference PyTorch code (much slower).
    This version keeps the choice in the wrapper's closure; if a later one does not, whether the
    package imports decides."""
    mod = importlib.import_module("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    out = {}
    for attr, package in [("torch_chunk_gated_delta_rule", "fla"), ("torch_recurrent_gated_delta_rule", "fla"),
                          ("causal_conv1d_fn", "causal_conv1d"), ("causal_conv1d_update", "causal_conv1d")]:
        fn = getattr(mod, attr, None)
        try:
            scope = inspect.getclosurevars(fn).nonlocals if fn is not None else {}
        except (TypeError, ValueError):
            scope = {}
        fast = scope.get("is_new_implementation")
        if fast is None:
            try:
                importlib.import_module(package)
                fast = True
            except Exception:
                fast = False
        out[scope.get("func_name", attr)] = package if fast else "torch reference"
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def copy_bandwidth(device: str) -> float:
    """Read + write bytes/s of a large copy on the device: 1 GiB on a GPU, 256 MiB on the CPU."""
    n = (1 << 30) if device.startswith("cuda") else (1 << 28)
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = max(best, 2 * n / (time.perf_counter() - t))
    del src, dst
    return best


def bytes_per_decode_step(model: torch.nn.Module, batch: int) -> float:
    cfg = model.config
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    distinct = e * (1 - (1 - k / e) ** batch)
    total = 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight"):
            total += batch * nbytes / p.shape[0]
        elif ".mlp.experts." in name:
            total += nbytes * distinct / e
        else:
            total += nbytes
    return total


def random_ids(vocab: int, rows: int, n: int, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 150000), (rows, n), generator=gen).to(device)


@torch.inference_mode()
def prefill(model: torch.nn.Module, n: int, seed: int, device: str) -> float:
    ids = random_ids(model.config.vocab_size, 1, n, seed, device)
    sync(device)
    t = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    sync(device)
    dt = time.perf_counter() - t
    if not torch.isfinite(out.logits).all():
        raise FloatingPointError("non-finite logits")
    return n / dt


@torch.inference_mode()
def decode(model: torch.nn.Module, streams: int, prompt: int, tokens: int, seed: int, device: str) -> float:
    ids = random_ids(model.config.vocab_size, streams, prompt, seed, device)
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        sync(device)
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync(device)
        if out.shape[1] != prompt + n:
            raise RuntimeError(f"generate made {out.shape[1] - prompt} tokens, not {n}")
        return time.perf_counter() - t

    first = gen(1)
    span = gen(tokens) - first
    if span <= 0:
        raise RuntimeError("decode span not positive (timer resolution)")
    return streams * (tokens - 1) / span


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    device = args.device
    model = build_model(PRESETS[args.preset], device, args.attn, args.experts)
    params = sum(p.numel() for p in model.parameters())
    result: dict[str, Any] = {
        "artifact": f"transformers:{args.preset}", "device": device, "bandwidth_gb_s": copy_bandwidth(device) / 1e9,
        "figures": [], "engine": "transformers", "transformers_version": transformers.__version__,
        "torch_version": torch.__version__, "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
        "parameters": params, "build_s": time.perf_counter() - start,
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "gdn_kernels": fast_kernels(),
    }

    def left() -> float:
        return args.budget_s - (time.perf_counter() - start)

    def measure(name: str, fn, bytes_per_step: float | None = None, streams: int = 1) -> None:
        fig: dict[str, Any] = {"name": name, "unit": "tok/s", "median": None, "low": None, "high": None,
                               "reps": 0, "roofline": None, "note": None}
        result["figures"].append(fig)
        values: list[float] = []
        last = 0.0
        try:
            # One warm-up, then reps; a run starts only if the previous one's time still fits.
            for r in range(args.reps + 1):
                if left() <= last:
                    fig["note"] = "skipped (time budget)" if not values else f"time budget: {len(values)} of {args.reps} reps"
                    break
                t = time.perf_counter()
                v = fn(r)
                last = time.perf_counter() - t
                if r > 0:
                    values.append(v)
        except Exception as e:  # out of memory, a missing kernel: report it and go on
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            fig["note"] = f"failed: {type(e).__name__}: {reason[:160]}"
            values = []
        finally:
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        if values:
            med = statistics.median(values)
            fig.update(median=med, low=min(values), high=max(values), reps=len(values))
            if bytes_per_step is not None:
                fig["roofline"] = bytes_per_step * (med / streams) / (result["bandwidth_gb_s"] * 1e9)

    for n in args.prefill:
        measure(f"pp{n}", lambda s, n=n: prefill(model, n, s, device))
    for c in args.concurrency:
        label = f"tg{args.tg_tokens}" + (f" x{c}" if c > 1 else "")
        measure(label, lambda s, c=c: decode(model, c, args.tg_prompt, args.tg_tokens, 1000 * s, device),
                bytes_per_decode_step(model, c), c)
    if device.startswith("cuda"):
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    result["total_s"] = time.perf_counter() - start
    return result


def format_result(r: dict[str, Any]) -> str:
    """The layout of `ninfer bench`, so the two tables can be read side by side."""
    lines = [f"transformers {r['transformers_version']} (torch {r['torch_version']}) baseline {r['artifact']} on "
             f"{r['gpu'] or r['device']} (copy bandwidth {r['bandwidth_gb_s']:.1f} GB/s)",
             f"{r['parameters'] / 1e9:.2f} B parameters in bf16, built in {r['build_s']:.1f} s; attention "
             f"{r['attn_implementation']}, experts {r['experts_implementation']}",
             "GDN fast path: " + ("yes" if "torch reference" not in r["gdn_kernels"].values() else "no") + " ("
             + ", ".join(f"{k}: {v}" for k, v in r["gdn_kernels"].items()) + ")",
             f"{'test':<12} {'median':>12} {'min':>12} {'max':>12}  {'roofline':>8}"]
    for f in r["figures"]:
        if f["median"] is None:
            lines.append(f"{f['name']:<12} {f['note']}")
            continue
        roof = f"{f['roofline']:.3f}" if f["roofline"] is not None else "-"
        note = f"; {f['note']}" if f["note"] else ""
        lines.append(f"{f['name']:<12} {f['median']:>12.1f} {f['low']:>12.1f} {f['high']:>12.1f}  {roof:>8}   "
                     f"{f['unit']}, {f['reps']} reps{note}")
    tail = f"total {r['total_s']:.0f} s"
    if "peak_memory_gb" in r:
        tail += f", peak GPU memory {r['peak_memory_gb']:.1f} GB"
    return "\n".join(lines + [tail])


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3.6-35b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--reps", type=int, default=3, help="measured repetitions per figure (after one warm-up)")
    ap.add_argument("--prefill", type=_ints, default=(512, 4096, 16384), help="prompt lengths for ppN")
    ap.add_argument("--concurrency", type=_ints, default=(1, 4, 16), help="sequences decoded at once for tg")
    ap.add_argument("--tg-prompt", type=int, default=512, help="prompt length before decoding")
    ap.add_argument("--tg-tokens", type=int, default=128, help="tokens decoded per sequence")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="no run starts after this many seconds from the start (model build included)")
    ap.add_argument("--attn", default="sdpa", help="transformers attention implementation (sdpa, eager, ...)")
    ap.add_argument("--experts", default=None, help="transformers experts implementation (default: its choice)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.tg_tokens < 2:
        ap.error("--tg-tokens must be at least 2")
    r = run(args)
    print(json.dumps(r, indent=1) if args.json else format_result(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
