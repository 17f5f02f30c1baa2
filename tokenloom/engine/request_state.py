"""What the engine holds of one request: built by the input processor, moved on by the core alone,
read by the output processor."""

from __future__ import annotations

from dataclasses import dataclass

from ..model.tokenizer import IncrementalDetokenizer
from ..sampling_params import SamplingParams
from ..step import Sequence
from .constraints import RequestConstraints


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    constraints: RequestConstraints | None = None
    error: str | None = None  # set when an internal error failed this request
    fault_text: str = ""  # the prompt text per-request fault rules match (only while faults are active)
    lora_name: str | None = None  # the LoRA adapter it pinned (released when the request goes)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


def max_tokens(max_model_len: int, num_prompt_tokens: int, params: SamplingParams) -> int:
    """The completion's token limit: `max_tokens`, or (None) up to the context length."""
    return params.max_tokens if params.max_tokens is not None else max_model_len - num_prompt_tokens
