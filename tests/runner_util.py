"""Helpers shared by the tests that drive `ninfer._core.Runner` step by step (golden and GPU parity)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np


@contextmanager
def slot(runner: Any) -> Iterator[Any]:
    s = runner.alloc_slot()
    try:
        yield s
    finally:
        runner.free_slot(s)


def step(runner: Any, s: Any, ids: list[int], vocab: int, all_logits: bool = False) -> np.ndarray:
    """Feeds `ids` to the slot; all positions' logits [len(ids), V], or the last position's [V]."""
    out = np.frombuffer(runner.step(s, list(ids), all_logits=all_logits), dtype=np.float32)
    if all_logits:
        return out.reshape(len(ids), vocab)
    return out.reshape(-1, vocab)[-1]
