"""Fault injection for tests: make chosen places of the engine raise, at no cost when off.

Every hook is guarded by `if faults.ACTIVE:` (one module attribute read), and `ACTIVE` is False
unless a rule was added, by `inject()` in a test or by the `TOKENLOOM_FAULTS` environment variable
read at import (so a server process under test can be told what to break):

    TOKENLOOM_FAULTS="sampler:req-A,detok:req-B,forward:3"

Sites and targets:
- per request: `sampler` (inside the batched sampler, for that request's rows), `detok` (its
  incremental detokenization), `logprobs` (recording its logprobs). The target matches a request
  whose id contains it or whose prompt text contains it (so an HTTP client, who does not choose the
  request id, can put a marker in its prompt); `*` matches every request.
- per step: `forward` (the batched forward, before it runs), `scheduler` (inside schedule()) and
  `stall` (before the forward, like `forward`, but it hangs the engine thread for
  TOKENLOOM_FAULT_STALL_S seconds, default 3600, instead of raising: a hung step).
  The target is an engine step number counted from 1: `3` (the third step only), `3+` (every
  step from the third on), `*` (every one). A `forward` target that is not a step number is a
  request marker: the forward of any step that computes a matching request fails (failing every
  request of that step) - what an HTTP test can aim at.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

ACTIVE = False

REQUEST_SITES = ("sampler", "detok", "logprobs")
STEP_SITES = ("forward", "scheduler", "stall")
STALL_S = float(os.environ.get("TOKENLOOM_FAULT_STALL_S", "3600"))


class InjectedFault(RuntimeError):
    """The exception an injected fault raises."""


@dataclass
class Rule:
    site: str
    target: str
    fired: int = 0

    @property
    def is_step_target(self) -> bool:
        t = self.target.removesuffix("+")
        return t == "*" or t.isdigit()

    def matches_step(self, n: int) -> bool:
        t = self.target
        if not self.is_step_target:
            return False
        if t == "*":
            return True
        if t.endswith("+"):
            return n >= int(t[:-1])
        return n == int(t)

    def matches_request(self, request_id: str, text: str) -> bool:
        t = self.target
        return t == "*" or t in request_id or (bool(text) and t in text)


_rules: list[Rule] = []
# id(prompt_token_ids list) -> (the list, request id, prompt text): lets the sampler, which sees only a
# row's prompt ids, name the request. Filled by the engine only while faults are active.
_owners: dict[int, tuple[object, str, str]] = {}


def inject(site: str, target: str = "*") -> Rule:
    """Arm a fault; returns its rule (its `fired` counts how often it raised)."""
    global ACTIVE
    if site not in REQUEST_SITES + STEP_SITES:
        raise ValueError(f"faults: unknown site {site!r} (known: {', '.join(REQUEST_SITES + STEP_SITES)})")
    rule = Rule(site, str(target))
    if site == "scheduler" and not rule.is_step_target:
        raise ValueError(f"faults: scheduler needs a step number target, got {target!r}")
    _rules.append(rule)
    ACTIVE = True
    return rule


def configure(spec: str | None) -> list[Rule]:
    """Arm the faults of a `site:target,site:target` spec (the TOKENLOOM_FAULTS format)."""
    rules = []
    for part in (spec or "").split(","):
        part = part.strip()
        if part:
            site, sep, target = part.partition(":")
            rules.append(inject(site.strip(), target.strip() if sep else "*"))
    return rules


def clear() -> None:
    """Disarm every fault (tests call this in teardown)."""
    global ACTIVE
    _rules.clear()
    _owners.clear()
    ACTIVE = False


def fired() -> dict[str, int]:
    """How often each site raised, over all rules."""
    out: dict[str, int] = {}
    for r in _rules:
        out[r.site] = out.get(r.site, 0) + r.fired
    return out


def track(prompt_token_ids: list[int], request_id: str, text: str) -> None:
    _owners[id(prompt_token_ids)] = (prompt_token_ids, request_id, text)


def untrack(prompt_token_ids: list[int]) -> None:
    _owners.pop(id(prompt_token_ids), None)


def _raise(rule: Rule, what: str) -> None:
    rule.fired += 1
    if rule.site == "stall":
        time.sleep(STALL_S)
        return
    raise InjectedFault(f"injected fault: {rule.site} ({what})")


def maybe_raise(site: str, request_id: str = "", text: str = "") -> None:
    """A per-request hook: raise if a `site` rule matches the request."""
    for rule in _rules:
        if rule.site == site and rule.matches_request(request_id, text):
            _raise(rule, request_id)


def maybe_raise_for_prompt(site: str, prompt_token_ids) -> None:
    """A per-request hook where only the row's prompt ids are at hand (the sampler)."""
    owner = _owners.get(id(prompt_token_ids))
    if owner is not None and owner[0] is prompt_token_ids:
        maybe_raise(site, owner[1], owner[2])


def maybe_raise_step(site: str, step: int, requests: tuple[tuple[str, str], ...] = ()) -> None:
    """A per-step hook: raise if a `site` rule matches this step number, or (a marker rule) one of
    the step's (request id, prompt text) pairs."""
    for rule in _rules:
        if rule.site != site:
            continue
        if rule.matches_step(step):
            _raise(rule, f"step {step}")
        if not rule.is_step_target:
            for request_id, text in requests:
                if rule.matches_request(request_id, text):
                    _raise(rule, f"step {step}, request {request_id}")


configure(os.environ.get("TOKENLOOM_FAULTS"))
