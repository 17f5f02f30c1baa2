"""What every route needs: the AsyncLLM, the served names, ids and timestamps, and the input side
of a request kept off the event loop.

Tokenizing a long prompt takes seconds of CPU and the `tokenizers` library holds the GIL in
`encode` (a thread would still freeze the loop), so long texts go through `encode_batch`, which
releases it, on a small executor. A text whose length alone proves it cannot fit the context (more
characters than max_model_len tokens of the longest token could hold) is refused before that.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property

from ..engine.async_llm import AsyncLLM
from ..model.lora import LoRARequest
from ..slo import SLOPolicy
from .chat_text import ChatEncoder
from .errors import APIError
from .tenancy import ClientPriorityRange

INLINE_CHARS = 4096  # texts shorter than this are tokenized on the loop (well under a millisecond)
_EXECUTOR_THREADS = 2


@dataclass
class ServerState:
    async_llm: AsyncLLM
    served_model_names: list[str]
    model_path: str | None = None
    metrics: object | None = None  # EngineMetrics
    shutting_down: bool = False
    client_priority: ClientPriorityRange = field(default_factory=ClientPriorityRange)
    trust_chat_messages: bool = False  # content may spell control tokens, any role (operator's choice)
    reasoning_parser: str | None = None  # "qwen3" / "deepseek_r1": <think> blocks as reasoning_content
    loras: dict[str, LoRARequest] = field(default_factory=dict)  # adapters served by name (--lora-modules)
    slo_policy: SLOPolicy = field(default_factory=SLOPolicy)  # where a request's SLO comes from (slo.py)
    _executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(_EXECUTOR_THREADS, thread_name_prefix="tokenloom-text"))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self):
        return self.async_llm.tokenizer

    @cached_property
    def vocab_size(self) -> int:
        model_config = getattr(self.async_llm.engine, "model_config", None)
        return getattr(model_config, "vocab_size", None) or self.tokenizer.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.async_llm.config.max_model_len

    @property
    def max_token_bytes(self) -> int:
        """The longest token in bytes (a character is at least one byte, so also in characters)."""
        return self.tokenizer.max_token_chars

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * max(self.max_token_bytes, 1)

    def check_text_length(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise APIError(
                400, f"{param}: {chars} characters cannot fit this model's context of {self.max_model_len} tokens "
                f"(at most {self.max_token_bytes} characters per token)", param=param, code="context_length_exceeded")

    async def run_off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` as `TokenizerWrapper.encode` gives them (with `add_special_tokens`
        false: without the BOS it adds for a model that wants one), off the loop when long."""
        self.check_text_length(len(text), param)
        wrapper = self.tokenizer
        if len(text) < INLINE_CHARS:
            ids = wrapper.tokenizer.encode(text, add_special_tokens=False).ids
        else:
            ids = (await self.run_off_loop(_encode_releasing_gil, wrapper.tokenizer, text))
        return self.with_bos(ids) if add_special_tokens else ids

    def with_bos(self, ids: list[int]) -> list[int]:
        """`ids` with the BOS a model that wants one gets (unless they start with it)."""
        wrapper = self.tokenizer
        if wrapper.add_bos_token and wrapper.bos_token_id is not None and (not ids or ids[0] != wrapper.bos_token_id):
            ids = [wrapper.bos_token_id, *ids]
        return ids

    @cached_property
    def chat_encoder(self) -> ChatEncoder:
        return ChatEncoder(self.tokenizer)

    async def decode(self, ids: list[int]) -> str:
        if len(ids) < INLINE_CHARS:
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        return await self.run_off_loop(_decode_releasing_gil, self.tokenizer.tokenizer, ids)

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.served_model_names or name in self.loras:
            return self.model_name if name is None else name
        raise APIError(
            404, f"The model `{name}` does not exist. Served: {', '.join([*self.served_model_names, *self.loras])}",
            "invalid_request_error", "model", "model_not_found",
        )

    @property
    def adapters(self):
        """The engine's AdapterManager, or None without --enable-lora."""
        return self.async_llm.engine.adapters

    async def lora_for(self, model: str) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base), pinned for its admission (the caller
        releases it once the engine has the request, which pins it itself: an unload meanwhile is a 409)
        and loaded off the event loop and the engine thread, so neither waits on its files."""
        if model in self.served_model_names or self.adapters is None:
            return None  # the base (a name that was an adapter when checked is not: its unload is a 404 here)
        from ..engine.lora_manager import AdapterGone

        try:
            lora = self.adapters.admit(model)  # on the loop, under the lock unload checks
        except AdapterGone:
            raise APIError(404, f"The model `{model}` does not exist (its adapter was unloaded)",
                           "invalid_request_error", "model", "model_not_found") from None
        try:
            if lora.lora_name not in self.adapters.loaded:  # a hop only to read files
                await self.run_off_loop(self.adapters.ensure_loaded, lora.lora_name)
        except BaseException:
            self.adapters.release(lora.lora_name)
            raise
        return lora


def _encode_releasing_gil(tokenizer, text: str) -> list[int]:
    # `encode_batch` runs without the GIL (`encode` holds it), so the event loop keeps running.
    return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids


def _decode_releasing_gil(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode_batch([ids], skip_special_tokens=False)[0]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())
