"""Hugging Face checkpoint -> `.ninfer` artifact (docs/format.md), and artifact summaries.

- `pipeline`: `convert()`, the whole conversion, its `conversion.json` report and `SHA256SUMS`.
- `source`: reading the HF directory (config resolution, resources, revision).
- `safetensors_io`: a minimal safetensors reader that keeps bf16/float8 as raw bits.
- `mapping`: logical tensor names and their HF sources (both key prefixes, fused or per-expert).
- `recipes`: the recipe table (logical-name patterns -> encodings).
- `encode`: copy / NVFP4 pass-through / quantize of one tensor.
- `summary`: what `ninfer inspect` prints.
"""

from ninfer.convert.pipeline import convert, conversion_json_path
from ninfer.convert.recipes import RECIPES, Recipe
from ninfer.convert.source import ConvertError

__all__ = ["convert", "conversion_json_path", "ConvertError", "RECIPES", "Recipe"]
