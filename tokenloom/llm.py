"""The offline API, vLLM-shaped: `LLM(...).generate(prompts, sampling_params)` and `.chat(...)`."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from tqdm import tqdm

from .config import EngineConfig
from .engine.llm_engine import LLMEngine
from .model.lora import LoRARequest
from .outputs import RequestOutput
from .sampling_params import SamplingParams

PromptType = str | list[int] | dict


def _log_unless_configured() -> None:
    """As vLLM's offline API does, show tokenloom's INFO lines (the forward plan at load) on stderr when
    the application has configured no logging of its own."""
    ours = logging.getLogger("tokenloom")
    if not logging.getLogger().handlers and not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        """Keyword arguments are `EngineConfig` fields (dtype, max_num_seqs, block_size, ...); `engine=`
        passes a ready `LLMEngine` instead."""
        engine = kwargs.pop("engine", None)
        if engine is None:
            _log_unless_configured()
            unknown = set(kwargs) - EngineConfig.field_names()
            if unknown:
                raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
            engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. `lora_request`: one adapter
        for every prompt, or one (or None: the base model) per prompt; needs `LLM(enable_lora=True)`."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, list | tuple) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: {len(loras)} given for {len(prompts)} prompts")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, prompt, p, lora in zip(ids, prompts, params, loras, strict=True):
                self.engine.add_request(rid, prompt, p, lora_request=lora)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm and len(prompts) > 1)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(self, ids: list[str], show_progress: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not show_progress, dynamic_ncols=True)
        try:
            while len(done) < len(ids):
                outputs = self.engine.step()
                if self.engine.last_step and self.engine.last_step.num_seqs == 0:
                    time.sleep(0.001)  # dynamic batching may be waiting for its window
                for out in outputs:
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in wanted - done.keys():
                self.engine.abort_request(rid)
        return [done[i] for i in ids]
