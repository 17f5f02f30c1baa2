"""LLMEngine: requests in, `RequestOutput`s out, one `step()` at a time.

The engine is built of parts (engine/builder.py wires them; this class is their public face):
- input processing, engine/input_processor.py: a request becomes a `RequestState` (tokenised,
  checked against the context and the KV cache, its constraints built, its LoRA adapter pinned, its
  `n` sequences made);
- the core, engine/engine_core.py: the step, speculation, fault isolation, advancing sequences and
  every stop decision - the one owner of a sequence's state;
- output processing, engine/output_processor.py: detokenization, the stop-string cut and hold-back,
  the `RequestOutput`;
- stats, engine/stats.py: each step's `StepStats` for the step listeners, `EngineStats`, `FaultStats`;
- KV handed between engines (disaggregated prefill), engine/kv_transfer.py;
- the heap policy, engine/heap_policy.py; the fault-injection sites, engine/fault_sites.py.
"""

from __future__ import annotations

from ..config import EngineConfig
from ..model.lora import LoRARequest
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..structured_output.grammar import GrammarCompiler
from .builder import build_engine
from .engine_core import MAX_CONSECUTIVE_FORWARD_FAILURES, EngineFatalError
from .request_state import RequestState, max_tokens
from .stats import EngineStats, FaultStats, StepStats

__all__ = [
    "MAX_CONSECUTIVE_FORWARD_FAILURES",
    "EngineFatalError",
    "EngineStats",
    "FaultStats",
    "LLMEngine",
    "RequestState",
    "StepStats",
]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **given):
        """The engine of `config`, built by `build_engine` (engine/builder.py); `given` are the objects
        it uses instead of building them: `model`/`tokenizer` to run an already-built model (tests use a
        random-weight one), `draft_model` for a speculative config's draft model (it shares the
        tokenizer); the simulator passes a `runner` (a cost model in place of the forward) with the
        `model_config` it pretends to run, and a virtual `clock`."""
        self.parts = p = build_engine(config, **given)
        self.config, self.clock, self.model, self.tokenizer, self.model_config = (
            p.config, p.clock, p.model, p.tokenizer, p.model_config)
        self.kv, self.stall_free, self.scheduler, self.runner = p.kv, p.stall_free, p.scheduler, p.runner
        self.speculation, self.adapters = p.speculation, p.adapters
        self.inputs, self.core, self.outputs, self.metrics, self.heap = p.inputs, p.core, p.outputs, p.metrics, p.heap
        self.requests: dict[str, RequestState] = p.core.requests  # the core's: read, never changed, here
        self.fault_stats: FaultStats = p.core.fault_stats
        self.step_listeners = p.metrics.listeners  # callables(StepStats, RequestOutputs of the step): metrics, the lab

    # -- requests --------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        state = self.inputs.process(request_id, prompt, params, arrival_time, lora_request, self.requests)
        if self.config.slo_shed and self.scheduler.slo is not None:
            try:  # SLOShedError: predicted to miss its TTFT by far (a 429 at the server)
                self.scheduler.slo.check_admission(state.seqs, self.scheduler.waiting, self.scheduler.running,
                                                   self.config.max_num_seqs, self.clock())
            except Exception:
                self.core.release(state)
                raise
        self.core.add(state)

    def abort_request(self, request_id: str) -> None:
        self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured-output grammars for this model's tokenizer (engine/input_processor.py)."""
        return self.inputs.grammars

    def max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The completion's token limit: `max_tokens`, or (None) up to the context length."""
        return max_tokens(self.config.max_model_len, num_prompt_tokens, params)

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step; raises only `EngineFatalError` (engine/engine_core.py)."""
        return self.core.step()

    @property
    def last_step(self) -> StepStats | None:
        return self.metrics.last_step

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def num_generation_tokens(self) -> int:
        return self.core.num_generation_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self.core.num_prompt_tokens

    def stats(self) -> EngineStats:
        return EngineStats.of(self.scheduler, self.kv)

    def check_kv_invariants(self) -> None:
        self.core.check_kv_invariants()

    # -- KV handed between engines (disaggregated prefill, engine/kv_transfer.py) ----------------

    def export_prefix_kv(self, token_ids: list[int], cache_salt: str | None = None):
        return self.parts.transfer.export_prefix_kv(token_ids, cache_salt)

    def import_prefix_kv(self, token_ids: list[int], kv, cache_salt: str | None = None) -> int:
        return self.parts.transfer.import_prefix_kv(token_ids, kv, cache_salt)
