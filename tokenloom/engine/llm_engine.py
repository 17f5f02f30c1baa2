"""LLMEngine: requests in, `RequestOutput`s out, one `step()` at a time.

step() = (speculative drafts, engine/speculation.py) → schedule → per-row constraints → (swap copies)
→ forward → sample (verifying drafts) → `_advance` each sequence (the one place a step moves a sequence
on: computed tokens, accepted drafts and the new token, detokenize, every stop decision in
`_check_stop`) → return outputs of the requests that changed. Every way a sequence ends (stop, length,
abort) goes through `_finish`, which calls the scheduler's one release path, so no KV block can leak.
A request may run under a LoRA adapter (`lora_request`), pinned in `self.adapters` until it goes.

Fault isolation (no request can take the engine down):
- An exception while handling one request (its sampler row, detokenization, logprobs, output
  assembly) fails that request alone: it finishes with finish_reason "error" and `error` set, its
  blocks are freed through `_finish`, the others go on.
- An exception in the batched forward that cannot be pinned on one request fails every request of
  that step (each gets the error), drops the prefix-cache entries nobody holds (their KV may never
  have been written), checks the KV invariants and goes on.
- What the engine cannot survive raises `EngineFatalError` out of `step()`: an error in the
  scheduler or in releasing blocks, broken KV invariants after a failure, or
  `MAX_CONSECUTIVE_FORWARD_FAILURES` failing forwards in a row. The AsyncLLM then ends the process.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import faults
from .. import step as steps
from ..config import EngineConfig
from ..model.config import ModelConfig
from ..model.heap import trim_heap, use_one_arena
from ..model.kv_layout import KVLayout
from ..model.load import load, set_num_threads, weight_bytes
from ..model.loader import torch_dtype
from ..model.lora import LoRARequest
from ..model.sampler import choice_generator
from ..model.tokenizer import IncrementalDetokenizer, TokenizerWrapper, same_tokenizer
from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..request_checks import check_request
from ..runner import ModelRunner
from ..sampling_params import SamplingParams
from ..step import RowConstraint, Runner, Sequence, SequenceStatus, StepPlan, StepResult, StepShape
from ..structured_output.grammar import GrammarCompiler, GrammarError
from .constraints import RequestConstraints
from .draft_model import DraftModelProposer
from .kv_cache import KVCacheManager, kv_cache_size
from .lora_manager import AdapterManager
from .scheduler import Scheduler
from .speculation import SpeculationPolicy
from .stall_free import StallFreeBudget

logger = logging.getLogger("tokenloom.engine")

MAX_CONSECUTIVE_FORWARD_FAILURES = 3
# After a step that ran prompt tokens the heap's free pages go back to the OS: a prefill's activations
# are freed into holes glibc keeps resident (measured: +100-170 MB over a serving run on Qwen2.5-0.5B).
# A trim takes 0.2-3.4 ms (more when more was freed), so it runs only after a forward at least
# 1 / TRIM_MAX_SHARE times as long as the last trim took: a long prompt step always, a short one on a
# small model only while trims stay cheap. Decode steps free into holes too, more slowly (a server
# streaming one request crept by ~0.6 MB/s, measured), so a trim also runs once a TRIM_EVERY_S.
TRIM_MAX_SHARE = 0.03
TRIM_EVERY_S = 1.0


class EngineFatalError(RuntimeError):
    """The engine's state can no longer be trusted; the process should exit and be restarted."""


@dataclass
class FaultStats:
    """Failures the engine survived, for tests, logs and the reliability report."""

    requests_failed_alone: int = 0  # a per-request error (sampler row, detokenization, logprobs, output)
    requests_failed_collateral: int = 0  # failed with a step whose batched forward raised
    forward_failures: int = 0
    consecutive_forward_failures: int = 0


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
    shape: StepShape  # per-row (tokens, context) of the step: what calibration fits against
    forward_time: float = 0.0  # inside the model forward (the rest of `duration` is engine overhead)
    num_padding: int = 0  # static/dynamic batching: finished members' slots computed as padding
    num_draft_tokens: int = 0  # speculative drafts scored in the step (counted in num_batched_tokens)
    num_accepted_tokens: int = 0  # of those, accepted
    row_drafts: list[int] | None = None  # per row of `shape`, its speculative drafts (the dashboard's rows)


@dataclass
class EngineStats:
    """The engine's state at one moment, for metrics, logs, the lab and admission control."""

    num_running: int
    num_waiting: int  # waiting to be (re)admitted, not counting swapped-out sequences
    num_swapped: int
    kv_usage: float
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int
    num_preemptions: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


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


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: TokenizerWrapper | None = None,
        runner: Runner | None = None,
        model_config: ModelConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        draft_model: torch.nn.Module | None = None,
    ):
        """Pass `model`/`tokenizer` to run an already-built model (tests use a random-weight one), and
        `draft_model` for a speculative config's draft model (it shares the tokenizer).
        The simulator passes a `runner` (a cost model in place of the forward) with the `model_config`
        it pretends to run, and a virtual `clock`."""
        self.config = config = (config or EngineConfig()).validate()
        self.clock = clock
        set_num_threads(config.num_threads)
        if model is None and runner is None:
            model, loaded_tokenizer, _ = load(config.model, config.dtype, config.device, config.quantization,
                                              config.kv_cache_dtype)
            tokenizer = tokenizer or loaded_tokenizer
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

        kv_dtype = None  # the config's dtype, unless asked for or chosen at load
        if config.kv_cache_dtype != "auto":
            kv_dtype = torch_dtype(config.kv_cache_dtype)
        elif model is not None:
            kv_dtype = getattr(model, "kv_cache_dtype", None)
        num_blocks, num_host_blocks, block_bytes = kv_cache_size(config, model_config, kv_dtype)
        layout = KVLayout.of(model_config)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks,
                                 layout.group_windows)
        self.stall_free = None
        if config.stall_free_factor and config.batching == "continuous":
            self.stall_free = StallFreeBudget(config.block_size, config.stall_free_factor,
                                              max_tokens=config.max_num_batched_tokens)
        self.scheduler = Scheduler(config, self.kv, self.stall_free)
        self.runner: Runner = runner or ModelRunner(model, num_blocks, config.block_size, num_host_blocks, config.seed,
                                                    kv_dtype)
        self.speculation = None
        if config.speculative is not None:
            draft = None
            if config.speculative.method == "draft_model":
                draft = self._draft_proposer(config.speculative.model, draft_model, num_blocks)
            self.speculation = SpeculationPolicy(config.speculative, draft)
        self.adapters = None
        if config.enable_lora:
            self.adapters = AdapterManager(model_config, config.max_cpu_loras or max(config.max_loras, 8),
                                           config.max_lora_rank, torch_dtype(config.dtype))
        self.requests: dict[str, RequestState] = {}
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self.last_step: StepStats | None = None
        self.step_listeners: list = []  # callables(StepStats, RequestOutputs of the step): metrics, the lab
        if self.stall_free is not None:
            self.step_listeners.append(self.stall_free.on_step)
        self.num_generation_tokens = 0
        self.num_prompt_tokens = 0
        self.num_steps = 0
        self._last_trim_s = 0.003  # how long the last heap trim took (TRIM_MAX_SHARE)
        use_one_arena()  # before a server starts the thread that steps this engine: trims then reach its heap
        self._last_trim_at = time.monotonic()
        self.fault_stats = FaultStats()
        # What exists now (weights, tokenizer tables, compiled kernels' handles) lives as long as the engine:
        # out of the garbage collector's reach, a collection scans only what steps allocate. Scanning it
        # all made some steps 2-3x slower (a full collection inside the forward: 7 ms of a 5 ms step).
        gc.collect()
        gc.freeze()
        groups = "" if layout.num_groups == 1 else f" (a block: {layout.layers_per_page} layers of one of {layout.num_groups} KV groups)"
        logger.info(
            "engine ready: %d KV blocks of %d tokens%s (%.0f MiB, %s), max_model_len %d, dtype %s",
            num_blocks, config.block_size, groups, num_blocks * block_bytes / 2**20,
            str(kv_dtype or config.dtype).removeprefix("torch."), config.max_model_len, config.dtype,
        )

    def _draft_proposer(self, source: str, draft_model: torch.nn.Module | None, num_blocks: int) -> DraftModelProposer:
        """The draft model loaded as the target was (dtype, quantization), checked to share its tokenizer
        (its drafts are token ids the target scores), over a KV pool of as many blocks as the target's."""
        config = self.config
        if draft_model is None:
            if self.model is None:
                raise ValueError("speculative_config.model: a draft model needs a real target model, not a simulated one")
            try:
                draft_model, draft_tokenizer, _ = load(source, config.dtype, config.device, config.quantization,
                                                       config.kv_cache_dtype)
            except (OSError, ValueError) as exc:
                raise ValueError(f"speculative_config.model: {exc}") from exc
            if not same_tokenizer(draft_tokenizer, self.tokenizer):
                raise ValueError(f"speculative_config.model: {source!r} has another tokenizer than the model "
                                 "it drafts for; a draft model must share the target's vocabulary")
        if draft_model.config.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"speculative_config.model: its vocabulary has {draft_model.config.vocab_size} ids, the "
                             f"target's {self.model_config.vocab_size}; a draft model must share the target's vocabulary")
        size_ratio = weight_bytes(draft_model) / max(weight_bytes(self.model), 1) if self.model is not None else 1.0
        logger.info("draft model %s: %.2fx the target's weight bytes; %s", source, size_ratio,
                    getattr(getattr(draft_model, "plan", None), "line", lambda: "")())
        return DraftModelProposer(draft_model, num_blocks, config.block_size, size_ratio)

    # -- requests --------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        params = params or SamplingParams()
        if lora_request is not None and self.adapters is None:
            raise ValueError("lora_request: LoRA adapters are not enabled (enable_lora=True / --enable-lora)")
        if request_id in self.requests:
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
        state = self.requests[request_id] = RequestState(request_id, text, ids, seqs, detok, constraints,
                                                         lora_name=lora_request.lora_name if lora else None)
        if faults.ACTIVE:
            state.fault_text = text if text is not None else self.tokenizer.decode(ids)
            faults.track(ids, request_id, state.fault_text)
        for seq in seqs:
            self.scheduler.add(seq)

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
        worst = len(ids) + self.max_tokens(len(ids), params)
        needed = self.kv.most_blocks_held(worst, self.config.max_num_batched_tokens)
        if needed > self.kv.num_blocks:
            raise ValueError(
                f"max_tokens: a sequence of {worst} tokens needs {needed} KV blocks but the cache "
                f"has {self.kv.num_blocks}; raise kv_cache_memory_bytes or lower max_tokens"
            )

    def max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The completion's token limit: `max_tokens`, or (None) up to the context length."""
        return params.max_tokens if params.max_tokens is not None else self.config.max_model_len - num_prompt_tokens

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        for seq in state.seqs if state is not None else ():
            if not seq.finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        if state is not None:
            self._forget(state)

    # -- KV handed between engines (disaggregated prefill) ---------------------------------------

    def export_prefix_kv(self, token_ids: list[int], cache_salt: str | None = None):
        """(tokens, K/V) of the longest cached prefix of `token_ids` (whole blocks, held in every KV group),
        as the runner's `read_blocks` gives it, group after group; (0, None) when nothing is cached. A
        prefill engine calls this right after the prompt's request finished, while its blocks are still
        cached."""
        rows = self.kv.cached_in_every_group(self.kv.prefix_keys(token_ids, cache_salt))
        if not rows:
            return 0, None
        blocks = [row[group].block_id for group in range(self.kv.num_groups) for row in rows]
        return len(rows) * self.kv.block_size, self.runner.read_blocks(blocks)

    def import_prefix_kv(self, token_ids: list[int], kv, cache_salt: str | None = None) -> int:
        """Put another engine's K/V of `token_ids`' first blocks (export_prefix_kv) into this engine's
        prefix cache, so a request with that prompt starts from a cache hit; returns the tokens now
        cached. The blocks stay free, so memory pressure may evict them: that costs a recompute, never a
        wrong token."""
        if kv is None:
            return 0
        bs, groups = self.kv.block_size, self.kv.num_groups
        if kv.dim() < 3 or kv.shape[2] % (bs * groups):
            raise ValueError(f"kv: a {tuple(kv.shape)} tensor is not whole blocks of {bs} tokens in {groups} KV groups")
        num_blocks = kv.shape[2] // (bs * groups)  # the export's blocks per group, group after group
        keys = self.kv.prefix_keys(token_ids[: num_blocks * bs], cache_salt)
        adopted = self.kv.adopt(keys)
        if adopted:
            starts = [(group * num_blocks + i) * bs for group, i, _ in adopted]
            rows = torch.cat([torch.arange(start, start + bs) for start in starts])
            self.runner.write_blocks([b.block_id for _, _, b in adopted], kv[:, :, rows])
        return len(self.kv.cached_prefix(keys)) * bs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        sched, kv, swapped = self.scheduler, self.kv, self.scheduler.num_swapped
        return EngineStats(len(sched.running), len(sched.waiting) - swapped, swapped, kv.usage, kv.prefix_queries,
                           kv.prefix_hits, sched.num_preemptions)

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step; raises only `EngineFatalError` (see the module docstring)."""
        start = self.clock()
        self.num_steps += 1
        try:
            if faults.ACTIVE:
                faults.maybe_raise_step("scheduler", self.num_steps)
            drafted = self._propose_drafts()  # never raises: a failure costs this step its drafts, said in the log
            plan = self.scheduler.schedule(start)
        except Exception as exc:
            raise EngineFatalError(f"the scheduler failed: {exc!r}") from exc
        for k, (seq, n) in enumerate(plan.scheduled):
            if steps.samples(seq, n) and (rows := self._row_constraints(seq)) is not None:
                plan.constraints[k] = rows
        plan.shape  # noqa: B018 -- cache the shape before the sequences advance
        row_drafts = [len(seq.spec_token_ids) for seq, _ in plan.scheduled]  # cleared as the rows advance
        num_drafts = sum(row_drafts)
        accepted_before = self.speculation.stats.num_accepted_tokens if self.speculation is not None else 0
        changed: dict[str, RequestState] = {}
        try:
            if faults.ACTIVE and not plan.is_empty:
                in_step = {(seq.request_id, self.requests[seq.request_id].fault_text) for seq, _ in plan.scheduled}
                faults.maybe_raise_step("forward", self.num_steps, tuple(in_step))
                faults.maybe_raise_step("stall", self.num_steps, tuple(in_step))
            forward_start = time.perf_counter()
            results = self.runner.execute(plan)
            ran_prompt = any(n > 1 and not drafts for (_, n), drafts in zip(plan.scheduled, row_drafts))
            self._maybe_trim_heap(ran_prompt, time.perf_counter() - forward_start)
        except Exception as exc:  # noqa: BLE001 - not one request's fault: fail the step's requests
            results = []
            self._forward_failed(plan, exc, changed)
        else:
            self.fault_stats.consecutive_forward_failures = 0
        now = self.clock()
        for res in results:
            state = self.requests[res.seq.request_id]
            if state.error is not None:
                continue  # a sibling sequence (n > 1) already failed the request in this step
            try:
                if self._advance(res, now):
                    changed[state.request_id] = state
            except EngineFatalError:
                raise
            except Exception as exc:  # noqa: BLE001 - this request's fault alone
                self._fail_request(state, exc)
                changed[state.request_id] = state
        for seq in drafted:  # those the scheduler did not run this step
            seq.spec_token_ids = []
        outputs = [self._output_or_fail(state) for state in changed.values()]
        for out in outputs:
            if out.finished:
                self._forget(self.requests.pop(out.request_id))
        if any(out.error is not None for out in outputs):
            self._check_after_failure()
        accepted = self.speculation.stats.num_accepted_tokens - accepted_before if self.speculation is not None else 0
        self._record_step(plan, start, self.clock(), outputs, num_drafts, accepted, row_drafts)
        return outputs

    def _forget(self, state: RequestState) -> None:
        """A request has gone (finished or aborted): unpin its adapter, stop tracking its faults."""
        if state.lora_name is not None:
            self.adapters.release(state.lora_name)
        if faults.ACTIVE:
            faults.untrack(state.prompt_token_ids)

    def _propose_drafts(self) -> list[Sequence]:
        """Speculation: drafts for the running sequences that decode (engine/speculation.py); returns them."""
        if self.speculation is None:
            return []
        seqs = [s for s in self.scheduler.running if s.num_tokens - s.num_computed_tokens == 1]
        # The bonus token always comes: drafts may take what max_tokens and the context length leave but one.
        limits = [min(self.max_tokens(s.num_prompt_tokens, s.params) - s.num_output_tokens,
                      self.config.max_model_len - s.num_tokens) - 1 for s in seqs]
        try:
            self.speculation.propose(seqs, limits)
            for seq in seqs:
                constraints = self.requests[seq.request_id].constraints
                if constraints is not None:
                    constraints.fit_drafts(seq)
        except Exception:  # drafts are an optimisation: the step goes on without them
            logger.exception("step %d: proposing speculative drafts failed; this step has none", self.num_steps)
            for seq in seqs:
                seq.spec_token_ids = []
        return seqs

    # -- failures --------------------------------------------------------------------------------

    def _fail_request(self, state: RequestState, exc: BaseException, collateral: bool = False) -> None:
        """End every unfinished sequence of the request with an error; its blocks are freed."""
        if state.error is not None:
            return
        logger.error("request %s failed: %r", state.request_id, exc, exc_info=exc if not collateral else None)
        # A grammar that failed mid-generation is the request's error, said as such (not "internal").
        state.error = str(exc) if isinstance(exc, GrammarError) else f"internal error: {exc!r}"
        if collateral:
            self.fault_stats.requests_failed_collateral += 1
        else:
            self.fault_stats.requests_failed_alone += 1
        try:
            for seq in state.seqs:
                if not seq.finished:
                    self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        except Exception as err:
            raise EngineFatalError(f"releasing the blocks of failed request {state.request_id} failed: {err!r}") from err

    def _maybe_trim_heap(self, ran_prompt: bool, forward_s: float) -> None:
        """Free heap pages back to the OS after a long enough prompt step, or once a TRIM_EVERY_S."""
        now = time.monotonic()
        if (ran_prompt and forward_s * TRIM_MAX_SHARE >= self._last_trim_s) or now - self._last_trim_at >= TRIM_EVERY_S:
            trim_heap()
            self._last_trim_at = time.monotonic()
            self._last_trim_s = self._last_trim_at - now

    def _forward_failed(self, plan: StepPlan, exc: BaseException, changed: dict[str, RequestState]) -> None:
        fs = self.fault_stats
        fs.forward_failures += 1
        fs.consecutive_forward_failures += 1
        logger.error("step %d: the forward failed (%d in a row); failing its %d sequences", self.num_steps,
                     fs.consecutive_forward_failures, len(plan.scheduled), exc_info=exc)
        # The scheduled sequences, and those swapped out in this step (their copy may not have happened).
        hit = [seq for seq, _ in plan.scheduled]
        hit += [seq for seq in plan.preempted if seq.status == SequenceStatus.SWAPPED]
        for seq in hit:
            state = self.requests.get(seq.request_id)
            if state is not None and state.error is None:
                self._fail_request(state, exc, collateral=True)
                changed[state.request_id] = state
        # Blocks registered in the prefix cache for this step's tokens may hold no KV: forget the
        # ones nobody uses any more.
        self.kv.reset_prefix_cache()
        if fs.consecutive_forward_failures >= MAX_CONSECUTIVE_FORWARD_FAILURES:
            raise EngineFatalError(f"{fs.consecutive_forward_failures} forwards failed in a row; last: {exc!r}") from exc

    def _check_after_failure(self) -> None:
        try:
            self.check_kv_invariants()
        except Exception as exc:
            raise EngineFatalError(f"KV cache invariants broken after a failure: {exc}") from exc

    def _output_or_fail(self, state: RequestState) -> RequestOutput:
        try:
            return self._make_output(state)
        except Exception as exc:  # noqa: BLE001 - this request's fault alone
            self._fail_request(state, exc)
        try:
            return self._make_output(state)
        except Exception:  # noqa: BLE001 - a bare error output still ends the request once
            return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                                 [CompletionOutput(s.index, "", [], "error", None, None, state.error)
                                  for s in state.seqs], finished=True, error=state.error)

    def _advance(self, res: StepResult, now: float) -> bool:
        """Move a sequence on after a step; returns whether it produced a token."""
        seq, token = res.seq, res.token_id
        if isinstance(token, BaseException):  # the sampler failed on this row alone
            raise token
        drafts, seq.spec_token_ids = seq.spec_token_ids, []
        rejected = len(drafts) - len(res.accepted)
        seq.num_computed_tokens += res.num_tokens - rejected  # a rejected draft's KV is overwritten later
        if res.prompt_logprobs is not None:
            if not seq.prompt_logprobs:
                seq.prompt_logprobs.append(None)  # the first prompt token has no logprob
            seq.prompt_logprobs.extend(res.prompt_logprobs)
        if token is None:
            return False
        if drafts:
            self.speculation.observe(seq, len(drafts), len(res.accepted))
        for accepted, logprobs in zip(res.accepted, res.accepted_logprobs, strict=True):
            self._append(seq, accepted, logprobs, now)
            if seq.finished:  # a stop inside the accepted drafts: what follows it is dropped
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                return True
        self._append(seq, token, res.logprobs, now)
        if rejected and not seq.finished:
            self.kv.trim(seq, seq.num_tokens)
        constraints = self.requests[seq.request_id].constraints
        if constraints is not None and not seq.finished:
            for forced in constraints.forced_tokens(seq):  # jump-forward: no forward for forced tokens
                self._append(seq, forced, None, now)
                if seq.finished:
                    break
        return True

    def _append(self, seq: Sequence, token: int, logprobs, now: float) -> None:
        seq.token_ids.append(token)
        self.num_generation_tokens += 1
        if seq.times.first_token is None:
            seq.times.first_token = now
            self.num_prompt_tokens += seq.num_prompt_tokens
        seq.times.last_token = now
        state = self.requests[seq.request_id]
        if faults.ACTIVE:
            if logprobs is not None:
                faults.maybe_raise("logprobs", seq.request_id, state.fault_text)
            faults.maybe_raise("detok", seq.request_id, state.fault_text)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        delta = state.detokenizers[seq.index].step(token)
        seq.output_text += delta
        status = self._check_stop(seq, token, len(delta))
        if state.constraints is not None and not state.constraints.accept(seq, token):
            status = status or SequenceStatus.FINISHED_STOPPED  # the grammar is complete
        if status is not None:
            self._finish(seq, status)

    @staticmethod
    def _may_stop(seq: Sequence) -> bool:
        """The `min_tokens` gate: before it, no stop token may be sampled and no stop condition ends it."""
        return seq.num_output_tokens >= seq.params.min_tokens

    def _row_constraints(self, seq: Sequence) -> list[RowConstraint | None] | None:
        """What each row the sequence samples may produce (one row, plus one per speculative draft)."""
        p = seq.params
        stops = tuple(p.stop_token_ids) + (() if p.ignore_eos else self.tokenizer.eos_token_ids)
        # Row i samples output token num_output_tokens + i: under min_tokens the stop tokens are banned.
        banned = [() if seq.num_output_tokens + i >= p.min_tokens else stops for i in range(len(seq.spec_token_ids) + 1)]
        constraints = self.requests[seq.request_id].constraints
        if constraints is not None:
            return constraints.rows(seq, banned)
        return [RowConstraint(b) if b else None for b in banned] if any(banned) else None

    def _check_stop(self, seq: Sequence, token: int, delta_len: int) -> SequenceStatus | None:
        p = seq.params
        if self._may_stop(seq):
            if not p.ignore_eos and token in self.tokenizer.eos_token_ids:
                seq.stop_reason = None
                return SequenceStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
            if p.stop and self._cut_at_stop_string(seq, delta_len):
                return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= self.max_tokens(seq.num_prompt_tokens, p):
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
        if self.speculation is not None:
            self.speculation.forget(seq)

    def _visible_text(self, seq: Sequence) -> str:
        """While running, hold back the tail that could be the start of a stop string."""
        if seq.finished or not seq.params.stop:
            return seq.output_text
        hold = max(len(s) for s in seq.params.stop) - 1
        return seq.output_text[: len(seq.output_text) - hold] if hold else seq.output_text

    def _make_output(self, state: RequestState) -> RequestOutput:
        first, times = state.seqs[0], [s.times for s in state.seqs]
        outputs = [
            CompletionOutput(s.index, self._visible_text(s), s.output_token_ids,
                             "error" if state.error is not None else s.finish_reason, s.stop_reason,
                             s.logprobs if s.params.logprobs is not None else None, state.error)
            for s in state.seqs
        ]
        metrics = RequestMetrics(
            arrival_time=first.times.arrival,
            first_scheduled_time=min((t.first_scheduled for t in times if t.first_scheduled), default=None),
            first_token_time=min((t.first_token for t in times if t.first_token), default=None),
            last_token_time=max((t.last_token or 0 for t in times), default=None),
            finished_time=max((t.finished or 0 for t in times), default=None) if state.finished else None,
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
            error=state.error,
        )

    def _record_step(self, plan: StepPlan, start: float, end: float, outputs: list[RequestOutput],
                     num_drafts: int = 0, num_accepted: int = 0, row_drafts: list[int] | None = None) -> None:
        # A row with drafts decodes one token and scores the drafts (rows are (tokens, context) pairs).
        decode = sum(1 for n, _ in plan.shape.rows if steps.is_decode(n)) + plan.shape.num_draft_rows
        stats = StepStats(
            start=start,
            duration=end - start,
            num_seqs=len(plan.scheduled),
            num_batched_tokens=plan.num_batched_tokens,
            num_prefill_tokens=plan.num_batched_tokens - decode - num_drafts,
            num_decode_tokens=decode,
            num_preempted=len(plan.preempted),
            seq_ids=[s.seq_id for s, _ in plan.scheduled],
            shape=plan.shape,
            forward_time=getattr(self.runner, "last_forward_time", 0.0),
            num_padding=plan.num_padding,
            num_draft_tokens=num_drafts,
            num_accepted_tokens=num_accepted,
            row_drafts=row_drafts,
        )
        if self.speculation is not None and stats.num_prefill_tokens == 0:
            self.speculation.observe_step(stats.num_batched_tokens, stats.duration)
        self.last_step = stats
        for listener in self.step_listeners:
            listener(stats, outputs)

    # -- checks ----------------------------------------------------------------------------------

    def check_kv_invariants(self) -> None:
        live = [s for st in self.requests.values() for s in st.seqs if not s.finished]
        self.kv.check_invariants(live)
