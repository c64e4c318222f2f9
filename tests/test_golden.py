"""Golden parity: the CPU backend against Hugging Face transformers on small random models.

The fixtures in tests/fixtures/golden/<model>/ are made by scripts/make_golden.py: a bf16 checkpoint,
transformers' float32 logits on it (golden.npz) and on the weights of the NVFP4 recipe read back
dequantized (golden_nvfp4.npz), plus prompts and greedy ids (golden.json). Each test converts the
checkpoint with ninfer's converter and runs the artifact through `ninfer._core.Runner`.
Bounds from DESIGN.md section 8.2: relative logit error below 1e-3 at every position, the same 16
greedy tokens, and a decode step equal to the longer prefill within 1e-4.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runner_util import slot, step

GOLDEN_DIR = Path(__file__).parent / "fixtures" / "golden"
MODELS = ["tiny-a", "tiny-b", "tiny-c"]
RECIPES = {"bf16": "golden.npz", "qwen3_6_35b_a3b_nvfp4": "golden_nvfp4.npz"}
GDN_CHUNK = 64  # model-spec.md section 2.4

LOGIT_TOL = 1e-3
SELF_TOL = 1e-4

CASES = [pytest.param(m, r, id=f"{m}-{r}") for m in MODELS for r in RECIPES]


def load_meta(model: str) -> dict[str, Any]:
    return json.loads((GOLDEN_DIR / model / "golden.json").read_text(encoding="utf-8"))


def load_golden(model: str, recipe: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    path = GOLDEN_DIR / model / RECIPES[recipe]
    if not path.is_file():
        pytest.skip(f"{path.name} for {model} has not been generated (run scripts/make_golden.py)")
    meta = load_meta(model)
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return meta, arrays


def rel_err(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """||ours - ref|| / ||ref|| per row (position)."""
    return np.linalg.norm(ours - ref, axis=-1) / np.linalg.norm(ref, axis=-1)


# ---------------------------------------------------------------------------------------------
# Fixture integrity (numpy only): the goldens say what the engine tests assume they say.


@pytest.mark.parametrize("model", MODELS)
def test_fixture_is_complete_and_consistent(model: str) -> None:
    meta = load_meta(model)
    cfg = json.loads((GOLDEN_DIR / model / "config.json").read_text(encoding="utf-8"))
    assert (GOLDEN_DIR / model / "model.safetensors").is_file()
    vocab = cfg["vocab_size"]
    steps = meta["decode_steps"]
    assert steps == 16
    assert {1, 7, 100} <= {len(p) for p in meta["prompts"].values()}
    for recipe, entry in meta["recipes"].items():
        _, g = load_golden(model, recipe)
        for key, ids in meta["prompts"].items():
            assert all(0 <= t < vocab for t in ids)
            logits, steps_logits = g[f"{key}.logits"], g[f"{key}.greedy_logits"]
            assert logits.shape == (len(ids), vocab) and logits.dtype == np.float32
            assert steps_logits.shape == (steps, vocab)
            assert np.isfinite(logits).all() and np.isfinite(steps_logits).all()
            # Step 0 is the prefill's last position; every step's token is its argmax.
            np.testing.assert_allclose(steps_logits[0], logits[-1], rtol=0, atol=1e-4 * np.abs(logits).max())
            assert entry["greedy"][key] == np.argmax(steps_logits, axis=-1).tolist()


def test_fixtures_cover_the_required_cases() -> None:
    configs = {m: json.loads((GOLDEN_DIR / m / "config.json").read_text(encoding="utf-8")) for m in MODELS}
    assert any(c["shared_expert_intermediate_size"] == 0 for c in configs.values())
    assert any(c["shared_expert_intermediate_size"] > 0 for c in configs.values())
    assert any(c["num_attention_heads"] % 2 == 1 and c["linear_num_value_heads"] % 2 == 1 for c in configs.values())
    assert any(c["num_hidden_layers"] == 8 for c in configs.values())
    longest = max(len(p) for m in MODELS for p in load_meta(m)["prompts"].values())
    assert longest > 2 * GDN_CHUNK and longest % GDN_CHUNK != 0


@pytest.mark.parametrize("model", MODELS)
def test_nvfp4_golden_differs_from_bf16(model: str) -> None:
    """The quantized golden must really be a different model, or it would test nothing new."""
    if not (GOLDEN_DIR / model / RECIPES["qwen3_6_35b_a3b_nvfp4"]).is_file():
        pytest.skip(f"golden_nvfp4.npz for {model} has not been generated (run scripts/make_golden.py)")
    _, ref = load_golden(model, "bf16")
    _, q = load_golden(model, "qwen3_6_35b_a3b_nvfp4")
    key = next(k for k in ref if k.endswith(".logits") and ref[k].shape[0] > 1)
    err = rel_err(q[key], ref[key])
    assert err.max() > 10 * LOGIT_TOL, "NVFP4 weights did not change the logits"
    assert err.mean() < 0.5, "NVFP4 logits are unrelated to the bf16 ones"


# ---------------------------------------------------------------------------------------------
# The engine against the goldens.


def _converter() -> Callable[..., Any]:
    if importlib.util.find_spec("ninfer.convert") is None:
        pytest.skip("ninfer.convert (the converter) is not available yet")
    module = importlib.import_module("ninfer.convert")
    if not hasattr(module, "convert"):
        pytest.skip("ninfer.convert has no `convert` function yet")
    return module.convert


def _runner_class() -> Any:
    core = importlib.import_module("ninfer._core")
    if not hasattr(core, "Runner"):
        pytest.skip("ninfer._core.Runner (the low-level step binding) is not built yet")
    return core.Runner


@pytest.fixture(scope="module")
def artifact_for(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], tuple[Path, dict[str, Any]]]:
    """Converts each (model, recipe) once; the artifact's path and the converter's report."""
    done: dict[tuple[str, str], tuple[Path, dict[str, Any]]] = {}

    def get(model: str, recipe: str) -> tuple[Path, dict[str, Any]]:
        if (model, recipe) not in done:
            convert = _converter()
            out = tmp_path_factory.mktemp(f"{model}-{recipe}") / f"{model}.ninfer"
            report = convert(str(GOLDEN_DIR / model), str(out), recipe=recipe, progress=False)
            done[(model, recipe)] = (out, report)
        return done[(model, recipe)]

    return get


@pytest.fixture(scope="module")
def runner_for(artifact_for: Callable[[str, str], tuple[Path, dict[str, Any]]]) -> Iterator[Callable[[str, str], Any]]:
    """One CPU runner per converted (model, recipe)."""
    runners: dict[tuple[str, str], Any] = {}

    def get(model: str, recipe: str) -> Any:
        if (model, recipe) not in runners:
            runner_cls = _runner_class()
            path, _ = artifact_for(model, recipe)
            runners[(model, recipe)] = runner_cls(str(path), device="cpu")
        return runners[(model, recipe)]

    yield get
    runners.clear()


@pytest.mark.parametrize(("model", "recipe"), CASES)
def test_fixture_converts(artifact_for: Callable[[str, str], tuple[Path, dict[str, Any]]], model: str,
                          recipe: str) -> None:
    """The converter takes every fixture, and the recipe's encodings are the ones the golden used."""
    meta, _ = load_golden(model, recipe)
    _, report = artifact_for(model, recipe)
    cfg = json.loads((GOLDEN_DIR / model / "config.json").read_text(encoding="utf-8"))
    names = set(report["tensors"])
    assert {"embed", "head", "final_norm"} <= names
    assert ("layers.0.moe.shared.gate_up" in names) == (cfg["shared_expert_intermediate_size"] > 0)
    assert all(f"layers.{i}.moe.experts.down" in names for i in range(cfg["num_hidden_layers"]))
    encodings = sorted({t["encoding"] for t in report["tensors"].values()})
    assert encodings == meta["recipes"][recipe].get("encodings", ["bf16"])


def _check_rows(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    err = rel_err(ours, ref)
    worst = int(np.argmax(err))
    assert err[worst] < LOGIT_TOL, f"{what}: relative error {err[worst]:.2e} at position {worst}"


@pytest.mark.parametrize(("model", "recipe"), CASES)
def test_prompt_logits_match_transformers(runner_for: Callable[[str, str], Any], model: str, recipe: str) -> None:
    meta, g = load_golden(model, recipe)
    runner = runner_for(model, recipe)
    for key, ids in meta["prompts"].items():
        ref = g[f"{key}.logits"]
        with slot(runner) as s:
            ours = step(runner, s, ids, ref.shape[-1], all_logits=True)
        _check_rows(ours, ref, f"{model}/{recipe} prompt {key}")


@pytest.mark.parametrize(("model", "recipe"), CASES)
def test_greedy_decode_matches_transformers(runner_for: Callable[[str, str], Any], model: str, recipe: str) -> None:
    meta, g = load_golden(model, recipe)
    runner = runner_for(model, recipe)
    for key, ids in meta["prompts"].items():
        ref = g[f"{key}.greedy_logits"]
        vocab = ref.shape[-1]
        ours: list[np.ndarray] = []
        tokens: list[int] = []
        with slot(runner) as s:
            logits = step(runner, s, ids, vocab)
            for _ in range(meta["decode_steps"]):
                ours.append(logits)
                tokens.append(int(np.argmax(logits)))
                if len(tokens) < meta["decode_steps"]:
                    logits = step(runner, s, [tokens[-1]], vocab)
        assert tokens == meta["recipes"][recipe]["greedy"][key], f"{model}/{recipe} prompt {key}"
        _check_rows(np.stack(ours), ref, f"{model}/{recipe} prompt {key} decode steps")


@pytest.mark.parametrize(("model", "recipe"), CASES)
def test_decode_step_equals_longer_prefill(runner_for: Callable[[str, str], Any], model: str, recipe: str) -> None:
    meta, g = load_golden(model, recipe)
    runner = runner_for(model, recipe)
    for key, ids in meta["prompts"].items():
        vocab = g[f"{key}.logits"].shape[-1]
        nxt = meta["recipes"][recipe]["greedy"][key][0]
        with slot(runner) as s:
            step(runner, s, ids, vocab)
            decoded = step(runner, s, [nxt], vocab)
        with slot(runner) as s:
            whole = step(runner, s, ids + [nxt], vocab, all_logits=True)
        err = rel_err(decoded[None], whole[-1:])[0]
        assert err < SELF_TOL, f"{model}/{recipe} prompt {key}: decode vs prefill relative error {err:.2e}"


@pytest.mark.parametrize(("model", "recipe"), CASES)
def test_chunked_prefill_matches_transformers(runner_for: Callable[[str, str], Any], model: str, recipe: str) -> None:
    """A prompt fed in pieces that do not line up with the GDN chunk continues the same sequence."""
    meta, g = load_golden(model, recipe)
    runner = runner_for(model, recipe)
    long = {k: v for k, v in meta["prompts"].items() if len(v) > GDN_CHUNK}
    assert long, "every golden model has a prompt longer than the GDN chunk"
    for key, ids in long.items():
        ref = g[f"{key}.logits"]
        cuts = [0, 37] + ([37 + GDN_CHUNK + 1] if 37 + GDN_CHUNK + 1 < len(ids) else []) + [len(ids)]
        with slot(runner) as s:
            ours = np.concatenate([step(runner, s, ids[a:b], ref.shape[-1], all_logits=True)
                                   for a, b in zip(cuts, cuts[1:])])
        _check_rows(ours, ref, f"{model}/{recipe} prompt {key} in chunks {cuts}")
