"""Reading a Hugging Face checkpoint directory: config, weights, resources, revision.

`open_source` gathers everything the converter needs from the directory; `resolve_text_config`
turns the HF config (nested `text_config` or flat) into the resolved `components.text` JSON of
docs/format.md §4, with the defaults transformers applies for `qwen3_5_moe` (model-spec.md §1.1).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ninfer.convert.safetensors_io import SafetensorsError, TensorStore

__all__ = ["ConvertError", "HFSource", "open_source", "resolve_text_config"]

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")


class ConvertError(Exception):
    """A conversion cannot proceed; the message says why and names the file or tensor."""


@dataclass
class HFSource:
    path: Path
    config: dict[str, Any]
    generation_config: dict[str, Any] | None
    store: TensorStore
    resources: dict[str, bytes]
    revision: str | None
    warnings: list[str] = field(default_factory=list)

    @property
    def text_config(self) -> dict[str, Any]:
        text = self.config.get("text_config")
        return text if isinstance(text, dict) else self.config

    @property
    def repo(self) -> str:
        """`Org/Name` for a hub cache snapshot (`models--Org--Name/snapshots/<commit>`), else the
        directory name."""
        path = self.path.resolve()
        hub = path.parent.parent.name
        if path.parent.name == "snapshots" and hub.startswith("models--"):
            return "/".join(hub.split("--")[1:])
        return path.name

    @property
    def tied(self) -> bool:
        # Either level may carry the flag; transformers' default for this model is untied.
        text = self.text_config
        return bool(text.get("tie_word_embeddings", self.config.get("tie_word_embeddings", False)))


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"cannot read {path.name}: {e}") from None


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _load_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConvertError(f"{index.name} has no weight_map")
        files = sorted({path / str(f) for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConvertError(f"{index.name} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"no *.safetensors files in {path.name}")
    return files


def _chat_template(path: Path) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tok_cfg = path / "tokenizer_config.json"
    if not tok_cfg.is_file():
        return None
    tpl = _load_json(tok_cfg).get("chat_template")
    if isinstance(tpl, list):
        # Named templates: [{"name": "default", "template": "..."}, ...].
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else None


def _git_revision(path: Path) -> str | None:
    head = path / ".git" / "HEAD"
    if not head.is_file():
        return None
    ref = head.read_text(encoding="utf-8").strip()
    if not ref.startswith("ref:"):
        return ref if _HEX40.match(ref) else None
    ref = ref[4:].strip()
    loose = path / ".git" / ref
    if loose.is_file():
        return loose.read_text(encoding="utf-8").strip()
    packed = path / ".git" / "packed-refs"
    if packed.is_file():
        for line in packed.read_text(encoding="utf-8").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref:
                return parts[0]
    return None


def _revision(path: Path, config: dict[str, Any]) -> str | None:
    """The source revision, from the first place that records one."""
    rev_file = path / "revision"
    if rev_file.is_file():
        return rev_file.read_text(encoding="utf-8").strip() or None
    git = _git_revision(path)
    if git:
        return git
    # huggingface_hub's local_dir downloads keep the commit on the first line of each metadata file.
    meta = path / ".cache" / "huggingface" / "download" / "config.json.metadata"
    if meta.is_file():
        first = meta.read_text(encoding="utf-8").splitlines()[:1]
        if first and _HEX40.match(first[0].strip()):
            return first[0].strip()
    if isinstance(config.get("_commit_hash"), str):
        return config["_commit_hash"]
    # A hub cache snapshot directory is named after its commit.
    if path.parent.name == "snapshots" and _HEX40.match(path.name):
        return path.name
    return None


def open_source(path: str | Path) -> HFSource:
    path = Path(path)
    if not path.is_dir():
        raise ConvertError(f"{path}: not a directory (expected a Hugging Face checkpoint directory)")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ConvertError(f"{path}: no config.json")
    config = _load_json(cfg_path)
    if not isinstance(config, dict):
        raise ConvertError("config.json is not a JSON object")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConvertError(
            f"config.json has model_type {model_type!r}; ninfer converts {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        store = TensorStore(_shard_files(path))
    except (SafetensorsError, OSError) as e:
        raise ConvertError(str(e)) from None

    resources: dict[str, bytes] = {}
    warnings: list[str] = []
    tok = path / "tokenizer.json"
    if tok.is_file():
        resources["tokenizer.json"] = tok.read_bytes()
    else:
        warnings.append("no tokenizer.json in the source: the artifact can only be used with token ids")
    template = _chat_template(path)
    if template is not None:
        resources["chat_template.jinja"] = template.encode("utf-8")
    gen_path = path / "generation_config.json"
    generation = None
    if gen_path.is_file():
        resources["generation_config.json"] = gen_path.read_bytes()
        generation = _load_json(gen_path)
    return HFSource(path, config, generation, store, resources, _revision(path, config), warnings)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def resolve_text_config(src: HFSource) -> dict[str, Any]:
    """The `components.text` JSON (docs/format.md §4)."""
    t = src.text_config

    def need(key: str) -> Any:
        if key not in t:
            raise ConvertError(f"config.json lacks `{key}`")
        return t[key]

    hidden = int(need("hidden_size"))
    layers = int(need("num_hidden_layers"))
    heads = int(t.get("num_attention_heads", 16))
    head_dim = int(t.get("head_dim") or hidden // heads)

    layer_types = t.get("layer_types")
    if layer_types is None:
        interval = int(t.get("full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    legacy = {"attention": "full_attention", "mamba": "linear_attention"}
    layer_types = [legacy.get(x, x) for x in layer_types]
    if len(layer_types) != layers or not set(layer_types) <= {"full_attention", "linear_attention"}:
        raise ConvertError(f"config.json layer_types does not describe {layers} layers of known types")

    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConvertError(f"rope type {rope_type!r} is not supported (only the default RoPE)")
    theta = float(rope.get("rope_theta", t.get("rope_theta", 10000.0)))
    factor = float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25)))

    # Stop ids: generation_config.json wins (model-spec.md §5.1), then the text config, then the top.
    gen = src.generation_config or {}
    eos = _ids(gen.get("eos_token_id")) or _ids(t.get("eos_token_id")) or _ids(src.config.get("eos_token_id"))

    return {
        "hidden_size": hidden,
        "num_layers": layers,
        "layer_types": layer_types,
        "vocab_size": int(t.get("vocab_size", 248320)),
        "rms_norm_eps": float(t.get("rms_norm_eps", 1e-6)),
        "num_attention_heads": heads,
        "num_kv_heads": int(t.get("num_key_value_heads", 2)),
        "head_dim": head_dim,
        "rotary_dim": int(head_dim * factor),
        "rope_theta": theta,
        "linear_num_key_heads": int(t.get("linear_num_key_heads", 16)),
        "linear_num_value_heads": int(t.get("linear_num_value_heads", 32)),
        "linear_key_head_dim": int(t.get("linear_key_head_dim", 128)),
        "linear_value_head_dim": int(t.get("linear_value_head_dim", 128)),
        "linear_conv_kernel": int(t.get("linear_conv_kernel_dim", 4)),
        "num_experts": int(t.get("num_experts", 256)),
        "num_experts_per_tok": int(t.get("num_experts_per_tok", 8)),
        "moe_intermediate_size": int(t.get("moe_intermediate_size", 512)),
        "shared_expert_intermediate_size": int(t.get("shared_expert_intermediate_size", 512)),
        "eos_token_ids": eos,
        "max_position_embeddings": int(t.get("max_position_embeddings", 32768)),
    }
