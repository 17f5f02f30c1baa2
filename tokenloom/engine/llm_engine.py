"""LLMEngine: requests in, `RequestOutput`s out, one `step()` at a time.

step() = schedule → (swap copies) → forward → sample → append tokens, detokenize, check stop
conditions → free finished sequences → return outputs of the requests that changed. Every way a
sequence ends (stop, length, abort) goes through `_finish`, which calls the scheduler's one release
path, so no KV block can leak.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..model.llama import LlamaConfig
from ..model.loader import ModelSource, kv_bytes_per_block_for, load_model, torch_dtype
from ..model.tokenizer import IncrementalDetokenizer, TokenizerWrapper, load_tokenizer
from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..runner import ModelRunner
from ..sampling_params import SamplingParams
from .kv_cache import KVCacheManager
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceStatus

logger = logging.getLogger("tokenloom.engine")


@dataclass
class StepStats:
    """What one step did, for metrics, logs and the batching lab."""

    start: float
    duration: float
    num_seqs: int
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    seq_ids: list[str]
    forward_time: float = 0.0  # inside the model forward (the rest of `duration` is engine overhead)
    num_padding: int = 0  # static/dynamic batching: finished members' slots computed as padding


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], seqs: list[Sequence]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.seqs = seqs
        self.detokenizers: list[IncrementalDetokenizer] = []

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: TokenizerWrapper | None = None,
        runner=None,
        model_config: LlamaConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """Pass `model`/`tokenizer` to run an already-built model (tests use a random-weight one).
        The simulator passes a `runner` (a cost model in place of the forward) with the `model_config`
        it pretends to run, and a virtual `clock`."""
        self.config = config = (config or EngineConfig()).validate()
        self.clock = clock
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if model is None and runner is None:
            source = ModelSource.resolve(config.model)
            model = load_model(source, dtype=config.dtype, device=config.device)
            tokenizer = tokenizer or load_tokenizer(source.path)
        if tokenizer is None:
            raise ValueError("tokenizer: required when a model or runner object is passed")
        self.model, self.tokenizer = model, tokenizer
        model_config = model_config or model.config
        self.model_config = model_config
        if config.max_model_len is None:
            config.max_model_len = model_config.max_position_embeddings
        elif config.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len: {config.max_model_len} exceeds the model's context length "
                f"{model_config.max_position_embeddings}"
            )
        config.validate()

        block_bytes = kv_bytes_per_block_for(model_config, config.block_size, torch_dtype(config.dtype))
        num_blocks = config.num_kv_blocks or config.kv_cache_memory_bytes // block_bytes
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory_bytes: {config.kv_cache_memory_bytes} holds fewer than 2 blocks of {block_bytes} bytes"
            )
        num_host_blocks = int(config.swap_space * (1 << 30)) // block_bytes if config.preemption_mode == "swap" else 0
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks)
        self.scheduler = Scheduler(config, self.kv)
        self.runner = runner or ModelRunner(
            model, num_blocks, config.block_size, num_host_blocks, tokenizer.eos_token_ids, config.seed
        )
        self.requests: dict[str, RequestState] = {}
        self.last_step: StepStats | None = None
        self.step_listeners: list = []  # callables(StepStats, RequestOutputs of the step): metrics, the lab
        self.num_generation_tokens = 0
        self.num_prompt_tokens = 0
        logger.info(
            "engine ready: %d KV blocks of %d tokens (%.0f MiB), max_model_len %d, dtype %s",
            num_blocks, config.block_size, num_blocks * block_bytes / 2**20, config.max_model_len, config.dtype,
        )

    # -- requests --------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        self._check_lengths(ids, params)
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator().manual_seed(params.seed + i)
            seq = Sequence(request_id, i, ids, params, self.clock() if arrival_time is None else arrival_time, gen)
            seqs.append(seq)
        state = RequestState(request_id, text, ids, seqs)
        state.detokenizers = [IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) for _ in seqs]
        self.requests[request_id] = state
        for seq in seqs:
            self.scheduler.add(seq)

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
            vocab = self.model_config.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt_token_ids: every id must be an integer in [0, {vocab})")
        if not ids:
            raise ValueError("prompt: must not be empty")
        return text, ids

    def _check_lengths(self, ids: list[int], params: SamplingParams) -> None:
        max_len = self.config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"prompt: {len(ids)} tokens, but max_model_len is {max_len} (room is needed to generate)")
        if params.max_tokens is not None and len(ids) + params.max_tokens > max_len:
            raise ValueError(
                f"max_tokens: this model's maximum context length is {max_len} tokens, but {len(ids) + params.max_tokens} "
                f"were requested ({len(ids)} in the prompt, {params.max_tokens} in the completion)"
            )
        worst = len(ids) + (params.max_tokens or max_len - len(ids))
        if self.kv.blocks_needed(worst) > self.kv.num_blocks:
            raise ValueError(
                f"max_tokens: a sequence of {worst} tokens needs {self.kv.blocks_needed(worst)} KV blocks but the cache "
                f"has {self.kv.num_blocks}; raise kv_cache_memory_bytes or lower max_tokens"
            )

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        for seq in state.seqs:
            if not seq.finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) - self.scheduler.num_swapped

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = self.clock()
        plan = self.scheduler.schedule(start)
        results = self.runner.execute(plan)
        now = self.clock()
        changed: dict[str, RequestState] = {}
        for res in results:
            seq = res.seq
            seq.num_computed_tokens += res.num_tokens
            if res.prompt_logprobs is not None:
                if not seq.prompt_logprobs:
                    seq.prompt_logprobs.append(None)  # the first prompt token has no logprob
                seq.prompt_logprobs.extend(res.prompt_logprobs)
            if res.token_id is None:
                continue
            self._append_token(seq, res.token_id, res.logprobs, now)
            changed[seq.request_id] = self.requests[seq.request_id]
        outputs = [self._make_output(state) for state in changed.values()]
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        self._record_step(plan, start, self.clock(), outputs)
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprobs, now: float) -> None:
        seq.token_ids.append(token)
        self.num_generation_tokens += 1
        if seq.times.first_token is None:
            seq.times.first_token = now
            self.num_prompt_tokens += seq.num_prompt_tokens
        seq.times.last_token = now
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        state = self.requests[seq.request_id]
        delta = state.detokenizers[seq.index].step(token)
        seq.output_text += delta
        status = self._check_stop(seq, token, len(delta))
        if status is not None:
            self._finish(seq, status)

    def _check_stop(self, seq: Sequence, token: int, delta_len: int) -> SequenceStatus | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.tokenizer.eos_token_ids:
                seq.stop_reason = None
                return SequenceStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
            if p.stop and self._cut_at_stop_string(seq, delta_len):
                return SequenceStatus.FINISHED_STOPPED
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _cut_at_stop_string(seq: Sequence, delta_len: int) -> bool:
        """Find a stop string completed by the latest text and cut the output exactly there."""
        text = seq.output_text
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(0, len(text) - delta_len - longest + 1)
        found = [(i, s) for s in seq.params.stop if (i := text.find(s, search_from)) != -1]
        if not found:
            return False
        idx, stop = min(found)
        seq.output_text = text[: idx + len(stop)] if seq.params.include_stop_str_in_output else text[:idx]
        seq.stop_reason = stop
        return True

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        seq.times.finished = self.clock()
        self.scheduler.remove(seq)

    def _visible_text(self, seq: Sequence) -> str:
        """While running, hold back the tail that could be the start of a stop string."""
        if seq.finished or not seq.params.stop:
            return seq.output_text
        hold = max(len(s) for s in seq.params.stop) - 1
        return seq.output_text[: len(seq.output_text) - hold] if hold else seq.output_text

    def _make_output(self, state: RequestState) -> RequestOutput:
        first = state.seqs[0]
        outputs = [
            CompletionOutput(
                index=s.index,
                text=self._visible_text(s),
                token_ids=s.output_token_ids,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=s.logprobs if s.params.logprobs is not None else None,
            )
            for s in state.seqs
        ]
        t = first.times
        metrics = RequestMetrics(
            arrival_time=t.arrival,
            first_scheduled_time=min((s.times.first_scheduled for s in state.seqs if s.times.first_scheduled), default=None),
            first_token_time=min((s.times.first_token for s in state.seqs if s.times.first_token), default=None),
            last_token_time=max((s.times.last_token or 0 for s in state.seqs), default=None),
            finished_time=max((s.times.finished or 0 for s in state.seqs), default=None) if state.finished else None,
            num_cached_tokens=first.num_cached_prompt_tokens,
            num_preemptions=sum(s.num_preemptions for s in state.seqs),
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=state.finished,
            prompt_logprobs=first.prompt_logprobs if first.params.prompt_logprobs is not None else None,
            metrics=metrics,
            num_cached_tokens=first.num_cached_prompt_tokens,
        )

    def _record_step(self, plan: SchedulerOutput, start: float, end: float, outputs: list[RequestOutput]) -> None:
        decode = sum(1 for s, n in plan.scheduled if n == 1 and s.num_computed_tokens > s.num_prompt_tokens)
        stats = StepStats(
            start=start,
            duration=end - start,
            num_seqs=len(plan.scheduled),
            num_batched_tokens=plan.num_batched_tokens,
            num_prefill_tokens=plan.num_batched_tokens - decode,
            num_decode_tokens=decode,
            num_preempted=len(plan.preempted),
            seq_ids=[s.seq_id for s, _ in plan.scheduled],
            forward_time=getattr(self.runner, "last_forward_time", 0.0),
            num_padding=plan.num_padding,
        )
        self.last_step = stats
        for listener in self.step_listeners:
            listener(stats, outputs)

    # -- checks ----------------------------------------------------------------------------------

    def check_kv_invariants(self) -> None:
        live = [s for st in self.requests.values() for s in st.seqs if not s.finished]
        self.kv.check_invariants(live)
