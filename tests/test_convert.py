"""`ninfer convert`: tiny qwen3_5_moe checkpoints built on the fly (BF16 with fused experts,
ModelOpt and compressed-tensors NVFP4 with per-expert tensors, both key prefixes, sharded with and
without an index) converted with both recipes and checked tensor by tensor against the source."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ninfer import _core
from ninfer.cli import main
from ninfer.convert import RECIPES, ConvertError, Recipe, convert
from ninfer.convert import encode as encode_mod
from ninfer.convert.safetensors_io import TensorStore, to_f32

LM = "model.language_model."
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)

# ---------------------------------------------------------------- tiny checkpoints


def tiny_text_config(**over: Any) -> dict[str, Any]:
    cfg = {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "vocab_size": 256,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        "mtp_num_hidden_layers": 1,
        "eos_token_id": 3,
    }
    cfg.update(over)
    return cfg


def bf16_bits(a: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """Our own writer: numpy-based savers cannot write BF16 or F8_E4M3."""
    header, blobs, off = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def _layer_values(t: dict[str, Any], P: str, full: bool, experts: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    H, E, I, Is = t["hidden_size"], t["num_experts"], t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
    w = lambda *s: rng.normal(0, 0.5, s).astype(np.float32)  # noqa: E731
    out = {f"{P}.input_layernorm.weight": w(H), f"{P}.post_attention_layernorm.weight": w(H)}
    if full:
        D, Hq, Hkv = t["head_dim"], t["num_attention_heads"], t["num_key_value_heads"]
        out.update({f"{P}.self_attn.q_proj.weight": w(2 * Hq * D, H), f"{P}.self_attn.k_proj.weight": w(Hkv * D, H),
                    f"{P}.self_attn.v_proj.weight": w(Hkv * D, H), f"{P}.self_attn.o_proj.weight": w(H, Hq * D),
                    f"{P}.self_attn.q_norm.weight": w(D), f"{P}.self_attn.k_norm.weight": w(D)})
    else:
        Kd = t["linear_num_key_heads"] * t["linear_key_head_dim"]
        Hv, dv = t["linear_num_value_heads"], t["linear_value_head_dim"]
        G = f"{P}.linear_attn"
        out.update({f"{G}.in_proj_qkv.weight": w(2 * Kd + Hv * dv, H), f"{G}.in_proj_z.weight": w(Hv * dv, H),
                    f"{G}.in_proj_b.weight": w(Hv, H), f"{G}.in_proj_a.weight": w(Hv, H),
                    f"{G}.conv1d.weight": w(2 * Kd + Hv * dv, 1, t["linear_conv_kernel_dim"]),
                    f"{G}.A_log": w(Hv), f"{G}.dt_bias": w(Hv), f"{G}.norm.weight": w(dv),
                    f"{G}.out_proj.weight": w(H, Hv * dv)})
    out[f"{P}.mlp.gate.weight"] = w(E, H)
    if experts == "fused":
        out[f"{P}.mlp.experts.gate_up_proj"] = w(E, 2 * I, H)
        out[f"{P}.mlp.experts.down_proj"] = w(E, H, I)
    else:
        for e in range(E):
            X = f"{P}.mlp.experts.{e}"
            out.update({f"{X}.gate_proj.weight": w(I, H), f"{X}.up_proj.weight": w(I, H), f"{X}.down_proj.weight": w(H, I)})
    S = f"{P}.mlp.shared_expert"
    out.update({f"{S}.gate_proj.weight": w(Is, H), f"{S}.up_proj.weight": w(Is, H), f"{S}.down_proj.weight": w(H, Is),
                f"{P}.mlp.shared_expert_gate.weight": w(1, H)})
    return out


def make_values(t: dict[str, Any], prefix: str = LM, experts: str = "fused", mtp: bool = True,
                tied: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """f32 values of every HF tensor of a tiny model, keyed by HF name."""
    rng = np.random.default_rng(seed)
    H, V = t["hidden_size"], t["vocab_size"]
    vals = {f"{prefix}embed_tokens.weight": rng.normal(0, 0.5, (V, H)).astype(np.float32)}
    for i, kind in enumerate(t["layer_types"]):
        vals.update(_layer_values(t, f"{prefix}layers.{i}", kind == "full_attention", experts, rng))
    vals[f"{prefix}norm.weight"] = rng.normal(0, 0.5, H).astype(np.float32)
    if not tied:
        vals["lm_head.weight"] = rng.normal(0, 0.5, (V, H)).astype(np.float32)
    if mtp:
        vals.update({"mtp.pre_fc_norm_embedding.weight": rng.normal(0, 0.5, H).astype(np.float32),
                     "mtp.pre_fc_norm_hidden.weight": rng.normal(0, 0.5, H).astype(np.float32),
                     "mtp.fc.weight": rng.normal(0, 0.5, (H, 2 * H)).astype(np.float32),
                     "mtp.norm.weight": rng.normal(0, 0.5, H).astype(np.float32)})
        vals.update(_layer_values(t, "mtp.layers.0", True, experts, rng))
    return vals


def nvfp4_parts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    parts = {n: b for n, _, b in _core.quantize("nvfp4", x.tobytes(), list(x.shape))}
    n, k = x.shape
    codes = np.frombuffer(parts["codes"], np.uint8).reshape(n, k // 2)
    scales = np.frombuffer(parts["scales"], np.uint8).reshape(n, k // 16)
    return codes, scales, np.frombuffer(parts["global"], np.float32)[0]


def to_storage(vals: dict[str, np.ndarray], dtype: str = "BF16", nvfp4: str | None = None,
               same_global: bool = False) -> dict[str, tuple[str, np.ndarray]]:
    """Storage form. A_log stays F32 as in real checkpoints. With `nvfp4` ("modelopt" or "ct"), the
    per-expert and shared-expert matrices of the main layers become NVFP4 in that layout
    (model-spec.md §4.2/4.3); `same_global` quantizes gate and up together (one global scale)."""
    out: dict[str, tuple[str, np.ndarray]] = {}
    quantized: set[str] = set()
    if nvfp4:
        bases = sorted({n[: -len(".weight")] for n in vals if not n.startswith("mtp.")
                        and (".experts." in n or ".shared_expert." in n) and n.endswith("_proj.weight")})
        for base in bases:
            if base.endswith("up_proj") and same_global:
                continue
            if base.endswith("gate_proj") and same_global:
                up = base[: -len("gate_proj")] + "up_proj"
                c, s, g = nvfp4_parts(np.concatenate([vals[base + ".weight"], vals[up + ".weight"]]))
                half = c.shape[0] // 2
                leaves = [(base, c[:half], s[:half], g), (up, c[half:], s[half:], g)]
            else:
                leaves = [(base, *nvfp4_parts(vals[base + ".weight"]))]
            for b, c, s, g in leaves:
                quantized.add(b + ".weight")
                if nvfp4 == "modelopt":
                    out[b + ".weight"] = ("U8", c)
                    out[b + ".weight_scale"] = ("F8_E4M3", s)
                    out[b + ".weight_scale_2"] = ("F32", np.array(g, dtype=np.float32))
                    out[b + ".input_scale"] = ("F32", np.array(0.25, dtype=np.float32))
                else:
                    out[b + ".weight_packed"] = ("U8", c)
                    out[b + ".weight_scale"] = ("F8_E4M3", s)
                    out[b + ".weight_global_scale"] = ("F32", np.array([np.float32(1) / g], dtype=np.float32))
    for name, v in vals.items():
        if name in quantized:
            continue
        if name.endswith("A_log") or dtype == "F32":
            out[name] = ("F32", v)
        elif dtype == "F16":
            out[name] = ("F16", v.astype(np.float16))
        else:
            out[name] = ("BF16", bf16_bits(v))
    return out


def make_checkpoint(path: Path, *, text: dict[str, Any] | None = None, nested: bool = True, prefix: str = LM,
                    experts: str = "fused", mtp: bool = True, tied: bool = False, dtype: str = "BF16",
                    nvfp4: str | None = None, same_global: bool = False, shards: int = 1, index: bool = False,
                    tokenizer: bool = True, config_extra: dict[str, Any] | None = None) -> dict[str, tuple[str, np.ndarray]]:
    path.mkdir(parents=True, exist_ok=True)
    t = text or tiny_text_config()
    t = {**t, "tie_word_embeddings": tied}
    config = {"model_type": "qwen3_5_moe", "text_config": t, "tie_word_embeddings": tied} if nested else {**t}
    config.update(config_extra or {})
    (path / "config.json").write_text(json.dumps(config))
    storage = to_storage(make_values(t, prefix, experts, mtp, tied), dtype, nvfp4, same_global)
    names = list(storage)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    for i, f in enumerate(files):
        write_safetensors(path / f, {n: storage[n] for n in names[i::shards]})
    if index:
        weight_map = {n: files[i % shards] for i, n in enumerate(names)}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if tokenizer:
        (path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 3], "top_k": 20}))
    return storage


def f32_of(storage: dict[str, tuple[str, np.ndarray]], name: str) -> np.ndarray:
    dtype, arr = storage[name]
    return to_f32(arr, dtype)


def parts_of(art: Any, name: str) -> dict[str, tuple[list[int], bytes]]:
    return {n: (s, b) for n, s, b in art.tensor_parts(name)}


def tensor_f32(art: Any, name: str, shape: list[int]) -> np.ndarray:
    return np.frombuffer(art.tensor_f32(name), np.float32).reshape(shape)


def e4m3(codes: np.ndarray) -> np.ndarray:
    # Independent of the converter: decode E4M3 through float16 bit placement.
    c = codes.astype(np.uint16)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, (c & 7).astype(np.float64)
    return (sign * np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e.astype(np.float64) - 7))).astype(np.float32)


def dequant_source(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """E2M1 · E4M3 block scale, before the global (exact in f32)."""
    vals = np.empty((codes.shape[0], codes.shape[1] * 2), np.float32)
    vals[:, 0::2], vals[:, 1::2] = E2M1[codes & 0xF], E2M1[codes >> 4]
    return vals * np.repeat(e4m3(scales), 16, axis=1)


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[str, np.ndarray]]]:
    d = tmp_path_factory.mktemp("bf16") / "Tiny-BF16"
    return d, make_checkpoint(d, config_extra={"_commit_hash": "a" * 40})


def n_tensors(t: dict[str, Any], mtp: bool = True) -> int:
    # Per linear layer 2 norms + 9 GDN + router + 2 banks + 3 shared = 17; per full layer 2 + 6 + 6 = 14.
    layers = sum(17 if k == "linear_attention" else 14 for k in t["layer_types"])
    return 3 + layers + (4 + 14 if mtp else 0)


# ---------------------------------------------------------------- bf16 recipe


def test_bf16_recipe_keeps_source_bytes(bf16_ckpt: tuple[Path, Any], tmp_path: Path) -> None:
    src, st = bf16_ckpt
    rep = convert(src, tmp_path / "tiny.ninfer", "bf16", progress=False)
    art = _core.Artifact(rep["paths"]["artifact"])
    header = json.loads(art.header_json())
    assert rep["totals"]["tensors"] == len(header["tensors"]) == n_tensors(tiny_text_config())
    assert rep["skipped"] == [] and rep["components"] == ["text", "mtp"]
    for logical, t in rep["tensors"].items():
        want = b"".join(st[s][1].tobytes() for s in t["sources"])
        assert parts_of(art, logical)["data"][1] == want, logical
        assert t["encoding"] == header["tensors"][logical]["encoding"] == ("f32" if logical.endswith("A_log") else "bf16")
        assert header["tensors"][logical]["component"] == ("mtp" if logical.startswith("mtp.") else "text")
    T = rep["tensors"]
    assert T["layers.3.moe.experts.gate_up"] == {"sources": [LM + "layers.3.mlp.experts.gate_up_proj"],
                                                 "encoding": "bf16", "shape": [8, 64, 64], "bytes": 8 * 64 * 64 * 2}
    S = LM + "layers.1.mlp.shared_expert."
    assert T["layers.1.moe.shared.gate_up"]["sources"] == [S + "gate_proj.weight", S + "up_proj.weight"]
    assert T["layers.1.moe.shared.gate_up"]["shape"] == [64, 64]
    assert T["layers.0.gdn.conv"]["shape"] == [128, 4]
    assert T["layers.2.gdn.A_log"]["sources"] == [LM + "layers.2.linear_attn.A_log"]
    assert T["head"]["sources"] == ["lm_head.weight"] and T["embed"]["sources"] == [LM + "embed_tokens.weight"]
    assert T["mtp.layers.0.attn.q"]["sources"] == ["mtp.layers.0.self_attn.q_proj.weight"]
    assert T["mtp.fc"]["shape"] == [64, 128] and T["mtp.final_norm"]["sources"] == ["mtp.norm.weight"]
    assert "layers.3.attn.q" in T and "layers.3.gdn.qkv" not in T and "layers.0.attn.q" not in T
    # Dequantized values are the source values.
    got = tensor_f32(art, "layers.3.moe.experts.down", [8, 64, 32])
    np.testing.assert_array_equal(got, f32_of(st, LM + "layers.3.mlp.experts.down_proj"))


def test_resolved_config_resources_and_records(bf16_ckpt: tuple[Path, Any], tmp_path: Path) -> None:
    src, _ = bf16_ckpt
    out = tmp_path / "out" / "tiny.ninfer"
    rep = convert(src, out, "bf16", progress=False)
    art = _core.Artifact(str(out))
    header = json.loads(art.header_json())
    text = header["components"]["text"]
    assert text["rotary_dim"] == 4 and text["rope_theta"] == 1e7 and text["head_dim"] == 16
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["eos_token_ids"] == [5, 3]  # generation_config.json wins over config's 3
    assert (text["num_kv_heads"], text["linear_conv_kernel"], text["max_position_embeddings"]) == (2, 4, 4096)
    assert header["components"]["mtp"] == {"num_layers": 1}
    assert header["arch"] == "qwen3_5_moe" and header["name"] == "Tiny-BF16"
    assert header["provenance"]["sources"] == [{"repo": "Tiny-BF16", "revision": "a" * 40}]
    assert art.resource("tokenizer.json") == (src / "tokenizer.json").read_bytes()
    assert art.resource("chat_template.jinja") == b"{{ messages[0]['content'] }}"
    assert art.resource("generation_config.json") == (src / "generation_config.json").read_bytes()

    record = json.loads((out.parent / "tiny.conversion.json").read_text())
    assert record["source"] == {"path": "Tiny-BF16", "revision": "a" * 40}
    assert record["recipe"] == "bf16" and record["tensors"] == rep["tensors"]
    assert record["totals"]["bytes"] == sum(t["bytes"] for t in rep["tensors"].values())
    assert record["totals"]["bytes_by_encoding"]["f32"] == 3 * 4 * 4  # three A_log vectors of 4
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    sums = out.parent / "SHA256SUMS"
    assert sums.read_text() == f"{digest}  tiny.ninfer\n" and record["sha256"] == digest

    # A second artifact adds a line; reconverting replaces the stale line instead of adding one.
    convert(src, out.parent / "other.ninfer", "bf16", progress=False)
    with pytest.raises(ConvertError, match="already exists"):
        convert(src, out, "bf16", progress=False)
    convert(src, out, "bf16", progress=False, overwrite=True)
    lines = sums.read_text().splitlines()
    assert len(lines) == 2 and lines[0].endswith("  other.ninfer")
    assert lines[1] == f"{hashlib.sha256(out.read_bytes()).hexdigest()}  tiny.ninfer"
    assert not list(out.parent.glob("*.partial"))


# ---------------------------------------------------------------- NVFP4 sources


@pytest.mark.parametrize("layout", ["modelopt", "ct"])
@pytest.mark.parametrize("same_global", [False, True])
def test_nvfp4_checkpoint_codes_copied_bit_for_bit(tmp_path: Path, layout: str, same_global: bool) -> None:
    src = tmp_path / f"Tiny-{layout}"
    st = make_checkpoint(src, experts="per_expert", nvfp4=layout, same_global=same_global)
    rep = convert(src, tmp_path / "q.ninfer", "qwen3_6_35b_a3b_nvfp4", progress=False)
    art = _core.Artifact(rep["paths"]["artifact"])
    assert rep["skipped"] == []  # input_scale is consumed, nothing is left behind
    data, E = ("weight" if layout == "modelopt" else "weight_packed"), 8

    def multiplier(base: str) -> np.float32:
        if layout == "modelopt":
            return st[base + ".weight_scale_2"][1].reshape(())[()]
        return np.float32(1) / st[base + ".weight_global_scale"][1][0]

    for layer in range(4):
        P = f"{LM}layers.{layer}.mlp."
        cases = [
            (f"layers.{layer}.moe.experts.gate_up", [[P + f"experts.{e}.gate_proj", P + f"experts.{e}.up_proj"] for e in range(E)]),
            (f"layers.{layer}.moe.experts.down", [[P + f"experts.{e}.down_proj"] for e in range(E)]),
            (f"layers.{layer}.moe.shared.gate_up", [[P + "shared_expert.gate_proj", P + "shared_expert.up_proj"]]),
            (f"layers.{layer}.moe.shared.down", [[P + "shared_expert.down_proj"]]),
        ]
        for logical, mats in cases:
            t = rep["tensors"][logical]
            bases = [b for m in mats for b in m]
            assert t["encoding"] == "nvfp4" and t["sources"] == [f"{b}.{data}" for b in bases]
            parts = parts_of(art, logical)
            assert parts["codes"][1] == b"".join(st[f"{b}.{data}"][1].tobytes() for b in bases)
            assert parts["scales"][1] == b"".join(st[f"{b}.weight_scale"][1].tobytes() for b in bases)
            g = np.array([[multiplier(b) for b in m] for m in mats], np.float32)
            if len(mats[0]) == 2 and same_global:
                g = g[:, :1]
            assert parts["global"][0] == list(g.shape)
            np.testing.assert_array_equal(np.frombuffer(parts["global"][1], np.float32).reshape(g.shape), g)
            # Dequantized artifact == dequantized source (each half with its own scale).
            want = np.stack([np.concatenate([
                dequant_source(st[f"{b}.{data}"][1], st[f"{b}.weight_scale"][1]) * multiplier(b) for b in m]) for m in mats])
            got = tensor_f32(art, logical, t["shape"]).reshape(want.shape)
            if layout == "modelopt":
                np.testing.assert_array_equal(got, want)
            else:  # dividing by weight_global_scale vs multiplying by its reciprocal: within an ulp
                np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
        if not same_global:
            assert parts_of(art, f"layers.{layer}.moe.experts.gate_up")["global"][0] == [E, 2]

    # The MTP experts arrive as per-expert BF16 and are quantized by the recipe.
    M = "mtp.layers.0.mlp.experts."
    bank = np.stack([np.concatenate([f32_of(st, f"{M}{e}.gate_proj.weight"), f32_of(st, f"{M}{e}.up_proj.weight")]) for e in range(E)])
    want = {n: b for n, _, b in _core.quantize("nvfp4", bank.tobytes(), list(bank.shape))}
    assert {n: b for n, (_, b) in parts_of(art, "mtp.layers.0.moe.experts.gate_up").items()} == want

    # The bf16 recipe keeps the NVFP4 banks as they are too, and stacks the BF16 MTP experts bit for bit.
    rep2 = convert(src, tmp_path / "b.ninfer", "bf16", progress=False)
    art2 = _core.Artifact(rep2["paths"]["artifact"])
    assert parts_of(art2, "layers.0.moe.experts.gate_up") == parts_of(art, "layers.0.moe.experts.gate_up")
    mtp_down = parts_of(art2, "mtp.layers.0.moe.experts.down")["data"]
    assert mtp_down == ([E, 64, 32], b"".join(st[f"{M}{e}.down_proj.weight"][1].tobytes() for e in range(E)))


# ---------------------------------------------------------------- quantizing a BF16 source


def test_nvfp4_recipe_on_bf16_source(bf16_ckpt: tuple[Path, Any], tmp_path: Path) -> None:
    src, st = bf16_ckpt
    rep = convert(src, tmp_path / "q.ninfer", "qwen3_6_35b_a3b_nvfp4", progress=False)
    art = _core.Artifact(rep["paths"]["artifact"])
    enc = {n: t["encoding"] for n, t in rep["tensors"].items()}
    expected = {
        "embed": "q8_g32", "head": "q6_g64", "final_norm": "bf16",
        "layers.0.gdn.qkv": "q8_g32", "layers.0.gdn.z": "q8_g32", "layers.0.gdn.a": "q8_g32",
        "layers.0.gdn.b": "q8_g32", "layers.0.gdn.out": "q8_g32", "layers.0.gdn.conv": "bf16",
        "layers.0.gdn.A_log": "f32", "layers.0.gdn.dt_bias": "bf16", "layers.0.gdn.norm": "bf16",
        "layers.3.attn.q": "q8_g32", "layers.3.attn.k": "q8_g32", "layers.3.attn.v": "q8_g32",
        "layers.3.attn.o": "q8_g32", "layers.3.attn.q_norm": "bf16", "layers.3.moe.router": "bf16",
        "layers.3.moe.shared_gate": "bf16", "layers.3.moe.experts.gate_up": "nvfp4",
        "layers.3.moe.experts.down": "nvfp4", "layers.3.moe.shared.gate_up": "nvfp4",
        "layers.3.moe.shared.down": "nvfp4", "mtp.fc": "q8_g32", "mtp.norm_emb": "bf16",
        "mtp.layers.0.attn.q": "q8_g32", "mtp.layers.0.moe.experts.down": "nvfp4",
        "mtp.layers.0.moe.router": "bf16",
    }
    assert {n: enc[n] for n in expected} == expected

    def quantized(encoding: str, x: np.ndarray) -> dict[str, tuple[list[int], bytes]]:
        return {n: (list(s), b) for n, s, b in _core.quantize(encoding, x.tobytes(), list(x.shape))}

    for logical, hf, encoding in [
        ("layers.3.moe.experts.gate_up", LM + "layers.3.mlp.experts.gate_up_proj", "nvfp4"),
        ("layers.0.gdn.qkv", LM + "layers.0.linear_attn.in_proj_qkv.weight", "q8_g32"),
        ("head", "lm_head.weight", "q6_g64"),
        ("mtp.fc", "mtp.fc.weight", "q8_g32"),
    ]:
        assert parts_of(art, logical) == quantized(encoding, f32_of(st, hf)), logical
    S = LM + "layers.2.mlp.shared_expert."
    shared = np.concatenate([f32_of(st, S + "gate_proj.weight"), f32_of(st, S + "up_proj.weight")])
    assert parts_of(art, "layers.2.moe.shared.gate_up") == quantized("nvfp4", shared)
    assert parts_of(art, "layers.2.moe.shared.gate_up")["global"][0] == [1, 1]
    assert parts_of(art, "layers.3.moe.experts.gate_up")["global"][0] == [8, 1]


def test_chunked_quantization_matches_whole(bf16_ckpt: tuple[Path, Any], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    src, _ = bf16_ckpt
    recipe = Recipe("test_q8", "q8 everywhere it fits", ((r".*\.(gate_up|down|qkv)|head", "q8_g32"), (r".*", "keep")))
    monkeypatch.setitem(RECIPES, "test_q8", recipe)
    whole = convert(src, tmp_path / "whole.ninfer", "test_q8", progress=False)
    monkeypatch.setattr(encode_mod, "CHUNK_ELEMS", 1000)  # chunks of 15 rows / single experts
    chunked = convert(src, tmp_path / "chunked.ninfer", "test_q8", progress=False)
    a, b = _core.Artifact(whole["paths"]["artifact"]), _core.Artifact(chunked["paths"]["artifact"])
    for name in ("layers.1.moe.shared.gate_up", "layers.1.moe.experts.gate_up", "layers.0.gdn.qkv", "head"):
        assert whole["tensors"][name]["encoding"] == "q8_g32"
        assert parts_of(a, name) == parts_of(b, name), name


# ---------------------------------------------------------------- layouts


def test_text_prefix_flat_config_tied_sharded_with_index(tmp_path: Path) -> None:
    src = tmp_path / "flat"
    st = make_checkpoint(src, nested=False, prefix="model.", mtp=False, tied=True, shards=3, index=True)
    assert len(list(src.glob("*.safetensors"))) == 3
    rep = convert(src, tmp_path / "t.ninfer", "bf16", progress=False)
    art = _core.Artifact(rep["paths"]["artifact"])
    header = json.loads(art.header_json())
    assert set(header["components"]) == {"text"} and rep["components"] == ["text"]
    assert rep["totals"]["tensors"] == n_tensors(tiny_text_config(), mtp=False)
    assert rep["tensors"]["head"]["sources"] == ["model.embed_tokens.weight"]
    assert parts_of(art, "head") == parts_of(art, "embed")
    assert parts_of(art, "layers.2.gdn.qkv")["data"][1] == st["model.layers.2.linear_attn.in_proj_qkv.weight"][1].tobytes()
    with pytest.raises(ConvertError, match="no mtp"):
        convert(src, tmp_path / "m.ninfer", "bf16", ["text", "mtp"], progress=False)


def test_shards_without_index_and_f32_f16_sources(tmp_path: Path) -> None:
    src = tmp_path / "f16"
    st = make_checkpoint(src, dtype="F16", shards=2)
    rep = convert(src, tmp_path / "a.ninfer", "bf16", ["text"], progress=False)
    assert rep["components"] == ["text"] and not any(n.startswith("mtp") for n in rep["tensors"])
    assert all(n.startswith("mtp.") for n in rep["skipped"]) and rep["skipped"]
    art = _core.Artifact(rep["paths"]["artifact"])
    assert rep["tensors"]["layers.0.moe.router"]["encoding"] == "f16"
    assert parts_of(art, "layers.0.moe.router")["data"][1] == st[LM + "layers.0.mlp.gate.weight"][1].tobytes()

    # An F32 checkpoint written by the safetensors library itself: our reader agrees with it.
    f32 = tmp_path / "f32"
    make_checkpoint(f32, dtype="F32")
    (f32 / "model-00001-of-00001.safetensors").unlink()
    tensors = {n: v for n, (_, v) in to_storage(make_values(tiny_text_config()), "F32").items()}
    save_file(tensors, str(f32 / "model.safetensors"))
    store = TensorStore([f32 / "model.safetensors"])
    for name, value in load_file(str(f32 / "model.safetensors")).items():
        np.testing.assert_array_equal(store.array(name), value)
    rep = convert(f32, tmp_path / "b.ninfer", "bf16", progress=False)
    art = _core.Artifact(rep["paths"]["artifact"])
    assert {t["encoding"] for t in rep["tensors"].values()} == {"f32"}
    np.testing.assert_array_equal(tensor_f32(art, "layers.0.gdn.conv", [128, 4]),
                                  tensors[LM + "layers.0.linear_attn.conv1d.weight"][:, 0, :])


def test_bf16_reader_widens_exactly(tmp_path: Path) -> None:
    x = np.array([1.0, -2.5, 3.140625, 1e-3, 65504.0], np.float32)
    write_safetensors(tmp_path / "a.safetensors", {"x": ("BF16", bf16_bits(x)), "c": ("F8_E4M3", np.arange(256, dtype=np.uint8))})
    store = TensorStore([tmp_path / "a.safetensors"])
    assert store.array("x").dtype == np.uint16
    np.testing.assert_array_equal(store.f32("x"), (bf16_bits(x).astype(np.uint32) << 16).view(np.float32))
    e = store.f32("c")
    assert (e[0x38], e[0x7E], e[0x01], e[0xB8]) == (1.0, 448.0, 2.0**-9, -1.0) and np.isnan(e[0x7F])


# ---------------------------------------------------------------- errors and the command line


def test_errors_name_the_problem(bf16_ckpt: tuple[Path, Any], tmp_path: Path) -> None:
    src, _ = bf16_ckpt
    with pytest.raises(ConvertError, match="not a directory"):
        convert(tmp_path / "nope", tmp_path / "x.ninfer", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConvertError, match="no config.json"):
        convert(tmp_path / "empty", tmp_path / "x.ninfer", progress=False)
    with pytest.raises(ConvertError, match="unknown recipe 'fp2'.*bf16"):
        convert(src, tmp_path / "x.ninfer", "fp2", progress=False)
    with pytest.raises(ConvertError, match="vision component is not implemented"):
        convert(src, tmp_path / "x.ninfer", "bf16", ["text", "vision"], progress=False)
    with pytest.raises(ConvertError, match="unknown component"):
        convert(src, tmp_path / "x.ninfer", "bf16", ["text", "audio"], progress=False)
    bad = tmp_path / "h48"
    make_checkpoint(bad, text=tiny_text_config(hidden_size=48))
    with pytest.raises(ConvertError, match=r"tensor `embed` .*48.*group size 32"):
        convert(bad, tmp_path / "x.ninfer", "qwen3_6_35b_a3b_nvfp4", progress=False)
    other = tmp_path / "llama"
    make_checkpoint(other, config_extra={"model_type": "llama"})
    with pytest.raises(ConvertError, match="model_type 'llama'"):
        convert(other, tmp_path / "x.ninfer", progress=False)
    missing = tmp_path / "missing"
    make_checkpoint(missing)
    shard = missing / "model-00001-of-00001.safetensors"
    tensors = {n: v for n, v in to_storage(make_values(tiny_text_config())).items() if "layers.1.linear_attn.in_proj_z" not in n}
    write_safetensors(shard, tensors)
    with pytest.raises(ConvertError, match=r"layers\.1\.linear_attn\.in_proj_z.*layers\.1\.gdn\.z"):
        convert(missing, tmp_path / "x.ninfer", progress=False)
    assert not list(tmp_path.glob("x.ninfer*"))


def test_cli_convert(bf16_ckpt: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, _ = bf16_ckpt
    out = tmp_path / "cli.ninfer"
    assert main(["convert", str(src), "-o", str(out), "--recipe", "bf16", "--components", "text"]) == 0
    err = capsys.readouterr().err
    assert "wrote cli.ninfer" in err and f"/{n_tensors(tiny_text_config(), mtp=False)}]" in err
    assert set(json.loads(_core.Artifact(str(out)).header_json())["components"]) == {"text"}
    for argv, message in [
        (["convert", str(tmp_path / "nope"), "-o", str(out)], "not a directory"),
        (["convert", str(src), "-o", str(tmp_path / "y.ninfer"), "--recipe", "fp2"], "unknown recipe"),
        (["convert", str(src), "-o", str(out)], "already exists"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_missing_tokenizer_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "notok"
    make_checkpoint(src, tokenizer=False, mtp=False)
    rep = convert(src, tmp_path, "bf16")
    assert Path(rep["paths"]["artifact"]).name == "notok.bf16.ninfer"
    assert any("tokenizer.json" in w for w in rep["warnings"])
    assert "warning: no tokenizer.json" in capsys.readouterr().err
    assert _core.Artifact(rep["paths"]["artifact"]).resource("tokenizer.json") is None


def test_revision_and_repo_name(tmp_path: Path) -> None:
    sha = "0123456789abcdef" * 2 + "01234567"
    snap = tmp_path / "hub" / "models--Qwen--Tiny-A3B" / "snapshots" / sha
    make_checkpoint(snap, mtp=False)
    rep = convert(snap, tmp_path, "bf16", progress=False)
    art = _core.Artifact(rep["paths"]["artifact"])
    assert Path(rep["paths"]["artifact"]).name == "Tiny-A3B.bf16.ninfer"
    assert json.loads(art.header_json())["provenance"]["sources"] == [{"repo": "Qwen/Tiny-A3B", "revision": sha}]
    assert rep["source"] == {"path": sha, "revision": sha}

    git = tmp_path / "Tiny-git"
    make_checkpoint(git, mtp=False)
    (git / ".git").mkdir()
    (git / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (git / ".git" / "packed-refs").write_text(f"# pack-refs with: peeled\n{'b' * 40} refs/heads/main\n")
    rep = convert(git, tmp_path / "g.ninfer", "bf16", progress=False, name="custom")
    assert rep["source"] == {"path": "Tiny-git", "revision": "b" * 40}
    assert json.loads(_core.Artifact(rep["paths"]["artifact"]).header_json())["name"] == "custom"
