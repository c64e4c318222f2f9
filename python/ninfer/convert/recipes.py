"""Conversion recipes: which encoding each logical tensor gets.

A recipe is data: an ordered list of (regular expression over the logical name, encoding); the
first rule whose pattern matches the whole name wins. `keep` stores the tensor as the source has
it (bf16 stays bf16 bit for bit, f32 stays f32, f16 stays f16). Two rules hold for every recipe
and are applied by the encoder, not written here: a tensor that arrives as NVFP4 codes stays
NVFP4 bit for bit (DESIGN.md §4: never requantized), and a tensor whose last dimension is not a
multiple of its encoding's group size is an error, never a silent fallback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Recipe", "RECIPES", "KEEP", "GROUP_SIZES", "get_recipe"]

KEEP = "keep"

# Elements per quantization group along the last dimension (docs/format.md §3).
GROUP_SIZES = {"nvfp4": 16, "q8_g32": 32, "q6_g64": 64, "q4_g32": 32}

_LAYER = r"(mtp\.)?layers\.\d+"


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    rules: tuple[tuple[str, str], ...]

    def encoding_for(self, logical: str) -> str:
        for pattern, encoding in self.rules:
            if re.fullmatch(pattern, logical):
                return encoding
        return KEEP


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "bf16",
            "every tensor as in the source (bf16 stays bf16, NVFP4 stays NVFP4)",
            ((r".*", KEEP),),
        ),
        Recipe(
            "qwen3_6_35b_a3b_nvfp4",
            "experts nvfp4, attention/GDN/MTP matrices and embedding q8_g32, head q6_g64, rest as in the source",
            (
                # Routed and shared experts, in the main layers and the MTP layer.
                (rf"{_LAYER}\.moe\.(experts|shared)\.(gate_up|down)", "nvfp4"),
                # Attention and GDN projections (model-spec.md §8 reference recipe).
                (rf"{_LAYER}\.(gdn\.(qkv|z|a|b|out)|attn\.(q|k|v|o))", "q8_g32"),
                (r"embed", "q8_g32"),
                (r"head", "q6_g64"),
                (r"mtp\.fc", "q8_g32"),
                # Router, shared-expert gate, norms, conv, A_log, dt_bias: as in the source.
                (r".*", KEEP),
            ),
        ),
    )
}


def get_recipe(name: str) -> Recipe | None:
    return RECIPES.get(name)
