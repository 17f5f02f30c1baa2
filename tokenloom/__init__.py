"""tokenloom: an LLM serving engine with continuous batching and a paged KV cache.

The public names load on first use (PEP 562), so importing a light module (`tokenloom.sampling_params`,
`tokenloom.config`) does not load the engine, the model and torch with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import EngineConfig
    from .llm import LLM
    from .model.lora import LoRARequest
    from .outputs import CompletionOutput, RequestOutput
    from .sampling_params import SamplingParams

_EXPORTS = {
    "EngineConfig": ".config",
    "LLM": ".llm",
    "LoRARequest": ".model.lora",
    "CompletionOutput": ".outputs",
    "RequestOutput": ".outputs",
    "SamplingParams": ".sampling_params",
}
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LoRARequest", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tokenloom' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
