"""The engine's fault-injection sites (tokenloom/faults.py), in one place.

Each call site guards its call with `if faults.ACTIVE:` (one attribute read), so a site costs nothing
while no fault is armed. The sampler's own site (`sampler`) is in model/sampler.py; it names a row's
request through the prompt ids `on_add` tracks.
"""

from __future__ import annotations

from .. import faults
from ..model.tokenizer import TokenizerWrapper
from ..step import StepPlan
from .request_state import RequestState


def on_add(state: RequestState, tokenizer: TokenizerWrapper) -> None:
    """A new request: the text its rules match, and its prompt ids for the sampler's site."""
    state.fault_text = state.prompt if state.prompt is not None else tokenizer.decode(state.prompt_token_ids)
    faults.track(state.prompt_token_ids, state.request_id, state.fault_text)


def on_forget(state: RequestState) -> None:
    faults.untrack(state.prompt_token_ids)


def before_schedule(step: int) -> None:
    faults.maybe_raise_step("scheduler", step)


def before_forward(step: int, plan: StepPlan, requests: dict[str, RequestState]) -> None:
    if plan.is_empty:
        return
    in_step = {(seq.request_id, requests[seq.request_id].fault_text) for seq, _ in plan.scheduled}
    faults.maybe_raise_step("forward", step, tuple(in_step))
    faults.maybe_raise_step("stall", step, tuple(in_step))


def on_token(state: RequestState, request_id: str, has_logprobs: bool) -> None:
    """Before a token's logprobs are recorded and its text detokenized."""
    if has_logprobs:
        faults.maybe_raise("logprobs", request_id, state.fault_text)
    faults.maybe_raise("detok", request_id, state.fault_text)
