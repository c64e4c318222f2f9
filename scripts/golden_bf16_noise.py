"""How far Hugging Face transformers itself, run in bfloat16, lands from the f32 goldens.

The GPU backend keeps activations in bf16, so its logits differ from the f32 goldens of
tests/fixtures/golden by bf16 noise; tests/test_gpu.py bounds that difference. This script
measures the same noise for transformers: each golden model loaded in bf16, every golden prompt
run in one forward, each row's relative L2 error against the golden logits, and the median,
90th percentile and maximum over all rows. `--gdn-chunk` reruns with the GDN prompt path cut
into chunks of other sizes (or token by token, `0`): the rounding order alone moves the figures.

Needs torch and transformers >= 5.17 (CPU is enough).

Usage: python scripts/golden_bf16_noise.py [--models tiny-a tiny-b ...] [--gdn-chunk 64 32 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as qwen
from transformers import Qwen3_5MoeForCausalLM

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "golden"
CHUNKED = qwen.torch_chunk_gated_delta_rule


def use_gdn_chunk(size: int) -> None:
    """Points transformers' GDN prompt path at chunks of `size` tokens, or the recurrence (0)."""
    if size == 0:
        qwen.torch_chunk_gated_delta_rule = lambda *a, chunk_size=64, **k: qwen.torch_recurrent_gated_delta_rule(*a, **k)
    else:
        qwen.torch_chunk_gated_delta_rule = lambda *a, chunk_size=64, **k: CHUNKED(*a, chunk_size=size, **k)


def row_errors(model_dir: Path) -> np.ndarray:
    meta = json.loads((model_dir / "golden.json").read_text())
    golden = np.load(model_dir / "golden.npz")
    model = Qwen3_5MoeForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    errs = []
    for key, ids in meta["prompts"].items():
        with torch.no_grad():
            ours = model(torch.tensor([ids])).logits[0].float().numpy()
        want = golden[f"{key}.logits"]
        errs.append(np.linalg.norm(ours - want, axis=-1) / np.linalg.norm(want, axis=-1))
    return np.concatenate(errs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=sorted(p.name for p in GOLDEN.iterdir() if p.is_dir()))
    ap.add_argument("--gdn-chunk", nargs="+", type=int, default=[64], help="GDN chunk sizes to try (0: token by token)")
    args = ap.parse_args()
    for name in args.models:
        for size in args.gdn_chunk:
            use_gdn_chunk(size)
            e = row_errors(GOLDEN / name)
            how = f"GDN chunk {size}" if size else "GDN token by token"
            print(f"{name} bf16, {how}: median {np.median(e):.2e}, p90 {np.quantile(e, 0.9):.2e}, max {e.max():.2e} over {e.size} rows")


if __name__ == "__main__":
    main()
