"""Logical tensor names (docs/format.md §5) and where each comes from in a HF checkpoint.

A logical tensor is one matrix, or a bank of per-expert matrices, each the row-concatenation of
one or more HF modules ("leaves"). A leaf is plain (a float tensor), or NVFP4 in the ModelOpt or
compressed-tensors layout (model-spec.md §4.2, §4.3); which one is decided by the tensors that
exist, never by `quantization_config` (§4.4: a tensor is quantized only if its scales exist).

Both key prefixes are accepted: `model.language_model.` (the multimodal checkpoint) and `model.`
(a text-only `Qwen3_5MoeForCausalLM` save), model-spec.md §1.2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ninfer.convert.safetensors_io import TensorStore
from ninfer.convert.source import ConvertError

__all__ = ["Leaf", "Entry", "plan_tensors", "text_prefix", "has_mtp"]

MTP_PREFIX = "mtp."


@dataclass(frozen=True)
class Leaf:
    """One HF module's weight. For NVFP4 leaves `data` holds the packed codes."""

    base: str
    kind: str  # "plain", "modelopt" or "ct"
    data: str
    scale: str | None = None
    glob: str | None = None
    extra: tuple[str, ...] = ()  # tensors consumed but not stored (activation scales)


@dataclass(frozen=True)
class Entry:
    logical: str
    component: str
    matrices: tuple[tuple[Leaf, ...], ...]  # one per expert for a bank, else exactly one
    bank: bool
    squeeze: bool = False  # drop the size-1 middle dim of a depthwise conv weight

    def leaves(self) -> list[Leaf]:
        return [leaf for m in self.matrices for leaf in m]


def find_leaf(store: TensorStore, base: str) -> Leaf | None:
    """The leaf for HF module `base`, or None when the checkpoint lacks it."""
    def has(suffix: str) -> bool:
        return f"{base}.{suffix}" in store

    if has("weight_packed"):
        for s in ("weight_scale", "weight_global_scale"):
            if not has(s):
                raise ConvertError(f"`{base}.weight_packed` (compressed-tensors NVFP4) has no `{base}.{s}`")
        extra = tuple(f"{base}.{s}" for s in ("input_global_scale",) if has(s))
        return Leaf(base, "ct", f"{base}.weight_packed", f"{base}.weight_scale", f"{base}.weight_global_scale", extra)
    if has("weight_scale_2"):
        for s in ("weight", "weight_scale"):
            if not has(s):
                raise ConvertError(f"`{base}.weight_scale_2` (ModelOpt NVFP4) has no `{base}.{s}`")
        extra = tuple(f"{base}.{s}" for s in ("input_scale",) if has(s))
        return Leaf(base, "modelopt", f"{base}.weight", f"{base}.weight_scale", f"{base}.weight_scale_2", extra)
    if has("weight_scale") or has("weight_scale_inv"):
        raise ConvertError(
            f"`{base}` is quantized in a format ninfer does not read (only ModelOpt and "
            "compressed-tensors NVFP4 are supported)"
        )
    if has("weight"):
        return Leaf(base, "plain", f"{base}.weight")
    if base in store:
        return Leaf(base, "plain", base)
    return None


def _need(store: TensorStore, base: str, logical: str) -> Leaf:
    leaf = find_leaf(store, base)
    if leaf is None:
        raise ConvertError(f"the checkpoint has no `{base}` (or `{base}.weight`), needed for `{logical}`")
    return leaf


def text_prefix(store: TensorStore) -> str:
    names = store.names()
    for prefix in ("model.language_model.", "model."):
        if any(n.startswith(prefix + "layers.") for n in names):
            return prefix
    raise ConvertError("no language-model tensors found (expected `model.layers.*` or `model.language_model.layers.*`)")


def has_mtp(store: TensorStore) -> bool:
    return any(n.startswith(MTP_PREFIX) for n in store.names())


class _Planner:
    def __init__(self, store: TensorStore, text: dict[str, Any]):
        self.store = store
        self.text = text
        self.entries: list[Entry] = []

    def one(self, logical: str, component: str, *bases: str, squeeze: bool = False) -> None:
        leaves = tuple(_need(self.store, b, logical) for b in bases)
        self.entries.append(Entry(logical, component, (leaves,), bank=False, squeeze=squeeze))

    def experts(self, logical: str, component: str, hf: str, fused: str, per_expert: tuple[str, ...]) -> None:
        # Fused 3-D bank of the BF16 checkpoint, or per-expert 2-D modules of quantized ones (§1.2).
        leaf = find_leaf(self.store, f"{hf}.{fused}")
        if leaf is not None:
            self.entries.append(Entry(logical, component, ((leaf,),), bank=True))
            return
        n = self.text["num_experts"]
        if find_leaf(self.store, f"{hf}.0.{per_expert[0]}") is None:
            raise ConvertError(
                f"the checkpoint has neither `{hf}.{fused}` nor per-expert `{hf}.0.{per_expert[0]}`, "
                f"needed for `{logical}`"
            )
        mats = tuple(tuple(_need(self.store, f"{hf}.{e}.{p}", logical) for p in per_expert) for e in range(n))
        self.entries.append(Entry(logical, component, mats, bank=True))

    def layer(self, logical: str, hf: str, full_attention: bool, component: str) -> None:
        L, P = logical, hf
        self.one(f"{L}.attn_norm", component, f"{P}.input_layernorm")
        if full_attention:
            for name in ("q", "k", "v", "o"):
                self.one(f"{L}.attn.{name}", component, f"{P}.self_attn.{name}_proj")
            self.one(f"{L}.attn.q_norm", component, f"{P}.self_attn.q_norm")
            self.one(f"{L}.attn.k_norm", component, f"{P}.self_attn.k_norm")
        else:
            G = f"{P}.linear_attn"
            self.one(f"{L}.gdn.qkv", component, f"{G}.in_proj_qkv")
            self.one(f"{L}.gdn.z", component, f"{G}.in_proj_z")
            self.one(f"{L}.gdn.b", component, f"{G}.in_proj_b")
            self.one(f"{L}.gdn.a", component, f"{G}.in_proj_a")
            self.one(f"{L}.gdn.conv", component, f"{G}.conv1d", squeeze=True)
            self.one(f"{L}.gdn.A_log", component, f"{G}.A_log")
            self.one(f"{L}.gdn.dt_bias", component, f"{G}.dt_bias")
            self.one(f"{L}.gdn.norm", component, f"{G}.norm")
            self.one(f"{L}.gdn.out", component, f"{G}.out_proj")
        self.one(f"{L}.moe_norm", component, f"{P}.post_attention_layernorm")
        self.one(f"{L}.moe.router", component, f"{P}.mlp.gate")
        X = f"{P}.mlp.experts"
        self.experts(f"{L}.moe.experts.gate_up", component, X, "gate_up_proj", ("gate_proj", "up_proj"))
        self.experts(f"{L}.moe.experts.down", component, X, "down_proj", ("down_proj",))
        if self.text["shared_expert_intermediate_size"] > 0:
            S = f"{P}.mlp.shared_expert"
            self.one(f"{L}.moe.shared.gate_up", component, f"{S}.gate_proj", f"{S}.up_proj")
            self.one(f"{L}.moe.shared.down", component, f"{S}.down_proj")
            self.one(f"{L}.moe.shared_gate", component, f"{P}.mlp.shared_expert_gate")


def plan_tensors(store: TensorStore, text: dict[str, Any], tied: bool, mtp_layers: int) -> list[Entry]:
    """Every logical tensor of the enabled components, in file order. `mtp_layers` 0 = no MTP."""
    T = text_prefix(store)
    p = _Planner(store, text)
    p.one("embed", "text", f"{T}embed_tokens")
    for i, kind in enumerate(text["layer_types"]):
        p.layer(f"layers.{i}", f"{T}layers.{i}", kind == "full_attention", "text")
    p.one("final_norm", "text", f"{T}norm")
    # A tied model's head is its embedding (docs/format.md §5).
    p.one("head", "text", f"{T}embed_tokens" if tied else "lm_head")
    if mtp_layers:
        p.one("mtp.norm_emb", "mtp", "mtp.pre_fc_norm_embedding")
        p.one("mtp.norm_hidden", "mtp", "mtp.pre_fc_norm_hidden")
        p.one("mtp.fc", "mtp", "mtp.fc")
        for i in range(mtp_layers):
            # The MTP block is a full-attention decoder layer (model-spec.md §3.1).
            p.layer(f"mtp.layers.{i}", f"mtp.layers.{i}", True, "mtp")
        p.one("mtp.final_norm", "mtp", "mtp.norm")
    return p.entries
