"""Input processing: a request as the caller gave it becomes a `RequestState` the core can run.

The prompt is tokenised (or its ids checked), the request checked (`check_request`, then whether its
longest sequence fits the KV cache), its constraints built (a grammar compiled once per text), its LoRA
adapter pinned (the last check: nothing after it fails) and its `n` sequences made, each with its own
seeded generator and detokenizer. Nothing here touches the scheduler: the core adds the request."""

from __future__ import annotations

import threading
from collections.abc import Callable, Container

from ..config import EngineConfig
from ..model.config import ModelConfig
from ..model.lora import LoRARequest
from ..model.sampler import choice_generator
from ..model.tokenizer import IncrementalDetokenizer, TokenizerWrapper
from ..request_checks import check_request
from ..sampling_params import SamplingParams
from ..step import Sequence
from ..structured_output.grammar import GrammarCompiler
from .constraints import RequestConstraints
from .kv_cache import KVCacheManager
from .lora_manager import AdapterManager
from .request_state import RequestState, max_tokens


class InputProcessor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer: TokenizerWrapper,
                 kv: KVCacheManager, adapters: AdapterManager | None, clock: Callable[[], float]):
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.kv, self.adapters, self.clock = kv, adapters, clock
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    def process(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None,
                arrival_time: float | None, lora_request: LoRARequest | None,
                in_use: Container[str]) -> RequestState:
        """The request's state, or ValueError; `in_use` holds the request ids the engine has."""
        params = params or SamplingParams()
        if lora_request is not None and self.adapters is None:
            raise ValueError("lora_request: LoRA adapters are not enabled (enable_lora=True / --enable-lora)")
        if request_id in in_use:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        check_request(params, ids, self.model_config.vocab_size, self.config.max_model_len)
        self._check_lengths(ids, params)
        # The grammar compiler (~0.1 s to build) only for a request that has a grammar.
        grammars = self.grammars if params.structured_outputs is not None else None
        constraints = RequestConstraints.of(params, self.tokenizer, grammars, self.model_config.vocab_size)
        lora = self.adapters.acquire(lora_request) if lora_request is not None else None  # the last check
        seqs = []
        for i in range(params.n):
            gen = None if params.seed is None else choice_generator(params.seed, i)
            seq = Sequence(request_id, i, ids, params, self.clock() if arrival_time is None else arrival_time, gen)
            seq.lora = lora
            seqs.append(seq)
        detok = [IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) for _ in seqs]
        return RequestState(request_id, text, ids, seqs, detok, constraints,
                            lora_name=lora_request.lora_name if lora else None)

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured-output grammars for this model's tokenizer, compiled once per text (the server
        compiles a request's grammar off the engine thread before adding it, so this is a cache hit)."""
        with self._grammars_lock:  # first use may come from the server's compile thread and the engine thread
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
            return self._grammars

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids, text = list(prompt), None
            vocab = self.model_config.vocab_size  # named as the offline caller wrote it (check_request says "prompt")
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt_token_ids: every id must be an integer in [0, {vocab})")
        return text, ids  # emptiness and lengths: `check_request`

    def _check_lengths(self, ids: list[int], params: SamplingParams) -> None:
        """What `check_request` cannot know: whether the longest the sequence may grow fits the KV cache."""
        worst = len(ids) + max_tokens(self.config.max_model_len, len(ids), params)
        needed = self.kv.most_blocks_held(worst, self.config.max_num_batched_tokens)
        if needed > self.kv.num_blocks:
            raise ValueError(
                f"max_tokens: a sequence of {worst} tokens needs {needed} KV blocks but the cache "
                f"has {self.kv.num_blocks}; raise kv_cache_memory_bytes or lower max_tokens"
            )
