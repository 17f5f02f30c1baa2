"""tokenloom: an LLM serving engine with continuous batching and a paged KV cache."""

from .config import EngineConfig
from .llm import LLM
from .model.lora import LoRARequest
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LoRARequest", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
