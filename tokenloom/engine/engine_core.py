"""The engine core: the one owner of every sequence's state, and `step()`.

step() = (speculative drafts, engine/speculation.py) → schedule → per-row constraints → (swap copies)
→ forward → sample (verifying drafts) → `_advance` each sequence (the one place a step moves a sequence
on: computed tokens, accepted drafts and the new token, its text, every stop decision in `_check_stop`)
→ the outputs of the requests that changed (engine/output_processor.py) → the step's stats. Every way a
sequence ends (stop, length, abort) goes through `_finish`, the scheduler's one release path: no KV
block can leak. A request's LoRA adapter stays pinned until it goes.

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

import logging
import time
from collections.abc import Callable

from .. import faults
from .. import step as steps
from ..config import EngineConfig
from ..model.tokenizer import TokenizerWrapper
from ..outputs import RequestOutput
from ..step import RowConstraint, Runner, Sequence, SequenceStatus, StepPlan, StepResult
from ..structured_output.grammar import GrammarError
from . import fault_sites
from .heap_policy import HeapPolicy
from .kv_cache import KVCacheManager
from .lora_manager import AdapterManager
from .output_processor import OutputProcessor
from .request_state import RequestState, max_tokens
from .scheduler import Scheduler
from .speculation import SpeculationPolicy
from .stats import FaultStats, StepMetrics

logger = logging.getLogger("tokenloom.engine")

MAX_CONSECUTIVE_FORWARD_FAILURES = 3


class EngineFatalError(RuntimeError):
    """The engine's state can no longer be trusted; the process should exit and be restarted."""


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer: TokenizerWrapper, kv: KVCacheManager, scheduler: Scheduler,
                 runner: Runner, speculation: SpeculationPolicy | None, adapters: AdapterManager | None,
                 outputs: OutputProcessor, metrics: StepMetrics, heap: HeapPolicy, clock: Callable[[], float]):
        self.config, self.tokenizer, self.kv, self.scheduler, self.runner = config, tokenizer, kv, scheduler, runner
        self.speculation, self.adapters, self.outputs, self.metrics = speculation, adapters, outputs, metrics
        self.heap, self.clock = heap, clock
        self.requests: dict[str, RequestState] = {}
        self.fault_stats = FaultStats()
        self.num_generation_tokens = self.num_prompt_tokens = self.num_steps = 0

    # -- requests --------------------------------------------------------------------------------

    def add(self, state: RequestState) -> None:
        """Run a request the input processor made."""
        self.requests[state.request_id] = state
        if faults.ACTIVE:
            fault_sites.on_add(state, self.tokenizer)
        for seq in state.seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        for seq in state.seqs if state is not None else ():
            if not seq.finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        if state is not None:
            self._forget(state)

    def release(self, state: RequestState) -> None:
        """A request made by the input processor that will not run after all (refused): unpin what it holds."""
        self._forget(state)

    def _forget(self, state: RequestState) -> None:
        """A request has gone (finished or aborted): unpin its adapter, stop tracking its faults."""
        if state.lora_name is not None:
            self.adapters.release(state.lora_name)
        if faults.ACTIVE:
            fault_sites.on_forget(state)

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step; raises only `EngineFatalError` (see the module docstring)."""
        start = self.clock()
        self.num_steps += 1
        try:
            if faults.ACTIVE:
                fault_sites.before_schedule(self.num_steps)
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
            if faults.ACTIVE:
                fault_sites.before_forward(self.num_steps, plan, self.requests)
            forward_start = time.perf_counter()
            results = self.runner.execute(plan)
            ran_prompt = any(n > 1 and not drafts for (_, n), drafts in zip(plan.scheduled, row_drafts))
            self.heap.after_forward(ran_prompt, time.perf_counter() - forward_start)
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
        self.metrics.record(plan, start, self.clock(), outputs, num_drafts, accepted, row_drafts)
        return outputs

    def _propose_drafts(self) -> list[Sequence]:
        """Speculation: drafts for the running sequences that decode (engine/speculation.py); returns them."""
        if self.speculation is None:
            return []
        seqs = [s for s in self.scheduler.running if s.num_tokens - s.num_computed_tokens == 1]
        # The bonus token always comes: drafts may take what max_tokens and the context length leave but one.
        max_len = self.config.max_model_len
        limits = [min(max_tokens(max_len, s.num_prompt_tokens, s.params) - s.num_output_tokens,
                      max_len - s.num_tokens) - 1 for s in seqs]
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
            return self.outputs.make_output(state)
        except Exception as exc:  # noqa: BLE001 - this request's fault alone
            self._fail_request(state, exc)
        try:
            return self.outputs.make_output(state)
        except Exception:  # noqa: BLE001 - a bare error output still ends the request once
            return self.outputs.error_output(state)

    # -- moving a sequence on --------------------------------------------------------------------

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
            fault_sites.on_token(state, seq.request_id, logprobs is not None)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        status = self._check_stop(seq, token, self.outputs.detokenize(state, seq, token))
        if state.constraints is not None and not state.constraints.accept(seq, token):
            status = status or SequenceStatus.FINISHED_STOPPED  # the grammar is complete
        if status is not None:
            self._finish(seq, status)

    def _check_stop(self, seq: Sequence, token: int, delta_len: int) -> SequenceStatus | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:  # before min_tokens no stop condition ends it
            if not p.ignore_eos and token in self.tokenizer.eos_token_ids:
                seq.stop_reason = None
                return SequenceStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
            if p.stop and self.outputs.cut_at_stop_string(seq, delta_len):
                return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= max_tokens(self.config.max_model_len, seq.num_prompt_tokens, p):
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        seq.times.finished = self.clock()
        self.scheduler.remove(seq)
        if self.speculation is not None:
            self.speculation.forget(seq)

    def check_kv_invariants(self) -> None:
        live = [s for st in self.requests.values() for s in st.seqs if not s.finished]
        self.kv.check_invariants(live)
