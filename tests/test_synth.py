"""`ninfer synth` (python/ninfer/synth.py): the tiny preset written, read back and served on the
CPU. The full-size presets are the same code at other widths; they are measured on a GPU
(scripts/gpu_bench.sh)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from ninfer import Engine, SamplingParams
from ninfer._core import Artifact
from ninfer.synth import PRESETS, synth


def _digest(path: Path) -> str:
    """Of every tensor's stored bytes (the file header also carries a creation id)."""
    art = Artifact(str(path))
    h = hashlib.sha256()
    for name in sorted(json.loads(art.header_json())["tensors"]):
        for part, _, data in art.tensor_parts(name):
            h.update(part.encode())
            h.update(data)
    return h.hexdigest()


def test_tiny_preset_has_the_recipe_shapes_and_serves(tmp_path: Path) -> None:
    out = tmp_path / "tiny.ninfer"
    info = synth("tiny", out, seed=3, progress=False)
    art = Artifact(str(out))
    art.verify()
    header = json.loads(art.header_json())
    cfg = PRESETS["tiny"].config
    text = header["components"]["text"]
    assert text["hidden_size"] == cfg["hidden_size"] and text["num_experts"] == cfg["num_experts"]
    assert "mtp" in header["components"]
    tensors = header["tensors"]
    assert len(tensors) == info["tensors"]
    # The reference recipe: NVFP4 experts, q8_g32 projections, q6_g64 head.
    assert tensors["layers.0.moe.experts.gate_up"]["encoding"] == "nvfp4"
    assert tensors["layers.0.gdn.qkv"]["encoding"] == "q8_g32"
    assert tensors["head"]["encoding"] == "q6_g64"
    # Weights are finite with the scale a 1/sqrt(k) init gives (rms within a factor of 3).
    k = cfg["hidden_size"]
    for name in ("layers.0.gdn.qkv", "layers.0.moe.experts.gate_up", "layers.3.attn.q"):
        w = np.frombuffer(art.tensor_f32(name), dtype="<f4")
        assert np.isfinite(w).all(), name
        rms = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
        assert 1 / 3 < rms * np.sqrt(k) < 3, (name, rms)
    # q8 values never use -128 (the encoding's range is [-127, 127]).
    (_, _, q), _ = art.tensor_parts("layers.0.gdn.qkv")
    assert np.frombuffer(q, dtype=np.int8).min() >= -127

    engine = Engine(out, device="cpu")
    done = engine.generate("hello", SamplingParams(max_tokens=6, temperature=0.0))
    assert done.completion_tokens == 6 or done.finish_reason == "stop"


def test_the_seed_fixes_every_weight(tmp_path: Path) -> None:
    a, b, c = (tmp_path / f"{n}.ninfer" for n in "abc")
    synth("tiny", a, seed=1, progress=False)
    synth("tiny", b, seed=1, progress=False)
    synth("tiny", c, seed=2, progress=False)
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)


def test_progress_into_a_log_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # stderr captured (not a terminal): no carriage-return stream of running counts, one line.
    synth("tiny", tmp_path / "t.ninfer", seed=1, progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.count("\n") == 1 and err.startswith("synth tiny: ")
