"""ninfer: fast inference for Qwen3.5/3.6 hybrid MoE models.

A tour of the package:
- `_core`: the Rust engine (artifact reader/writer and codecs, tokenizer, backends, scheduler,
  sampler). Python never reimplements what it does.
- `engine.py`: `Engine`, `SamplingParams`, `Completion`, `Delta` (sync and asyncio).
- `convert/`: Hugging Face checkpoint -> `.ninfer` (readers, recipes, report, SHA256SUMS).
- `chat.py`: chat templates rendered like transformers' `apply_chat_template`.
- `parsers.py`: streaming reasoning / tool-call parsing of model output.
- `server/`: the aiohttp server speaking the OpenAI and Anthropic APIs.
- `cli.py`: the `ninfer` command.
"""

from ninfer._core import __version__
from ninfer.engine import Completion, Delta, Engine, EngineError, SamplingParams

__all__ = ["Completion", "Delta", "Engine", "EngineError", "SamplingParams", "__version__"]
