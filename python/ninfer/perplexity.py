"""Windowed perplexity of a text under a model (`ninfer perplexity FILE`).

The text is tokenized once and cut into windows of `context` tokens that overlap by
`context - stride`; each window is scored from a fresh sequence, and only the tokens not already
scored by the previous window count (the sliding-window method of the transformers perplexity
guide). With `stride == context` the windows do not overlap, and the first token of each
window after the first is not scored (it has no context inside its window). Logits come from the Rust backend
(`_core.Runner`), one window per step, all positions at once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ninfer import _core

__all__ = ["PerplexityResult", "perplexity", "perplexity_of_ids"]


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float
    tokens_scored: int
    tokens_total: int
    windows: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_total / self.seconds if self.seconds > 0 else float("inf")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def perplexity_of_ids(artifact: str | Path, ids: Sequence[int], context: int = 512, stride: int | None = None, device: str = "cpu") -> PerplexityResult:
    ids = list(ids)
    stride = stride or context
    if context < 2:
        raise ValueError("context must be at least 2 tokens")
    if not 1 <= stride <= context:
        raise ValueError(f"stride must be between 1 and the context ({context}), got {stride}")
    if len(ids) < 2:
        raise ValueError("the text must have at least 2 tokens")
    runner = _core.Runner(str(artifact), device=device, max_slots=1, max_context=context)
    start = time.perf_counter()
    nll, scored, windows, prev_end = 0.0, 0, 0, 0
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + context, len(ids))
        window = ids[begin:end]
        slot = runner.alloc_slot()
        try:
            logits = np.frombuffer(runner.step(slot, window, all_logits=True), np.float32).reshape(len(window), -1)
        finally:
            runner.free_slot(slot)
        # Position j predicts window[j+1]; score only targets past what was already scored.
        first = max(prev_end - begin, 1)
        targets = np.array(window[first:], dtype=np.int64)
        lp = _log_softmax(logits[first - 1 : len(window) - 1])
        nll -= float(lp[np.arange(len(targets)), targets].sum())
        scored += len(targets)
        windows += 1
        prev_end = end
        if end == len(ids):
            break
    seconds = time.perf_counter() - start
    mean = nll / scored
    return PerplexityResult(math.exp(mean), mean, scored, len(ids), windows, seconds)


def perplexity(artifact: str | Path, text: str, context: int = 512, stride: int | None = None, device: str = "cpu") -> PerplexityResult:
    """Tokenizes `text` with the artifact's tokenizer (special-token text stays plain text)."""
    blob = _core.Artifact(str(artifact)).resource("tokenizer.json")
    if blob is None:
        raise ValueError(f"{artifact} has no tokenizer.json; it cannot score text")
    ids = _core.Tokenizer(blob).encode(text, allow_special=False)
    return perplexity_of_ids(artifact, ids, context, stride, device)
