"""`ninfer perplexity` equals transformers' perplexity on the golden models (within 1e-3), computed
from the logits transformers recorded for the 100-token prompts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ninfer.convert import convert
from ninfer.perplexity import perplexity_of_ids

GOLDEN = Path(__file__).parent / "fixtures" / "golden"


def transformers_ppl(logits: np.ndarray, ids: list[int]) -> float:
    x = logits.astype(np.float64)[:-1]
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    nll = -(x[np.arange(len(ids) - 1), ids[1:]] - lse).mean()
    return math.exp(nll)


@pytest.mark.parametrize("model", ["tiny-a", "tiny-b"])
def test_perplexity_matches_transformers(tmp_path, model):
    art = tmp_path / "m.ninfer"
    convert(GOLDEN / model, art, "bf16", progress=False)
    ids = json.loads((GOLDEN / model / "golden.json").read_text())["prompts"]["p100"]
    with np.load(GOLDEN / model / "golden.npz") as z:
        want = transformers_ppl(z["p100.logits"], ids)
    got = perplexity_of_ids(art, ids, context=len(ids))
    assert got.tokens_scored == len(ids) - 1
    assert abs(got.perplexity - want) / want < 1e-3, (got.perplexity, want)


def test_windows_score_each_token_at_most_once(tmp_path):
    art = tmp_path / "m.ninfer"
    convert(GOLDEN / "tiny-a", art, "bf16", progress=False)
    ids = json.loads((GOLDEN / "tiny-a" / "golden.json").read_text())["prompts"]["p100"]
    # Overlapping windows score every token after the first; windows without overlap cannot score
    # their own first token (it has no context inside the window).
    for context, stride, scored in [(40, 25, 99), (30, 29, 99), (30, 30, 96), (100, 100, 99)]:
        r = perplexity_of_ids(art, ids, context=context, stride=stride)
        assert r.tokens_scored == scored, (context, stride)
    with pytest.raises(ValueError, match="stride"):
        perplexity_of_ids(art, ids, context=10, stride=20)
