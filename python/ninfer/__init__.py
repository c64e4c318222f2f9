"""ninfer: fast inference for Qwen3.5/3.6 hybrid MoE models.

A tour of the package:
- `_core`: the Rust engine (artifact reader/writer and codecs, tokenizer, backends, sampler).
- `convert/`: Hugging Face checkpoint -> `.ninfer` (readers, recipes, report, SHA256SUMS).
- `chat.py`: chat templates rendered like transformers' `apply_chat_template`.
- `parsers.py`: streaming reasoning / tool-call parsing of model output.
- `cli.py`: the `ninfer` command.
"""

from ninfer._core import __version__

__all__ = ["__version__"]
