"""`tokenloom calibrate-cascade SMALL LARGE --dev FILE --out FILE`: fit a cascade's rule on labelled data.

The dev set is code problems in HumanEval's format (JSON lines of `prompt`, `test` with a
`check(candidate)`, `entry_point`; benchmarks/cascade/dev.jsonl, never the evaluation's problems). Each
prompt is completed greedily by each tier in this process, with the engine flags `serve` would use (so
the answers, and the signals, are the server's), cut at HumanEval's stop sequences, and run against
its asserts in a subprocess. Of the small tier's answer the first k tokens give every token signal
(cascade_signals.py), and its pooled hidden states (over the prompt alone, and over the prompt and the
first k tokens) the probe's features. The label: the small tier fails.

Every signal's AUROC for "small fails" is measured (the probe's out of fold, 5 folds by the problems'
`group`, so it is not scored on what it, or a variant of the same template, was fitted to); the signal is the best one unless `--signal` names one; the threshold
is the one at which `--target-escalation` of the dev set escalates. The file records the tiers' files
(`--cascade-config` refuses it for other models), k, the signal, threshold, the probe and the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import subprocess
import sys

import numpy as np

from .cascade_config import DEFAULT_K, CascadeRule, write_config
from .cascade_signals import (
    CONFIDENCE_TOP_N,
    SIGNALS,
    TOKEN_SIGNALS,
    LogisticProbe,
    auroc,
    threshold_for_rate,
    token_signals,
)

logger = logging.getLogger("tokenloom.calibrate")

STOPS = ["\ndef ", "\nclass ", "\nif __name__", "\n#", "\nprint(", "\nassert "]  # HumanEval's usual stops
CHECK_TIMEOUT_S = 10.0
FOLDS = 5


def load_problems(path: str, limit: int | None = None) -> list[dict]:
    with open(path) as f:
        problems = [json.loads(line) for line in f if line.strip()]
    for p in problems:
        if not {"prompt", "test", "entry_point"} <= set(p):
            raise ValueError(f"--dev {path}: each line needs prompt, test and entry_point ({p.get('task_id')})")
    return problems[:limit] if limit else problems


def passes(problem: dict, completion: str, timeout: float = CHECK_TIMEOUT_S) -> bool:
    """Does prompt + completion pass the problem's check (run in a fresh interpreter, bounded in time)?"""
    program = f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    try:
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def add_calibrate_cascade_parser(subparsers) -> argparse.ArgumentParser:
    from ..config import SERVING_DEFAULTS, add_engine_args

    p = subparsers.add_parser("calibrate-cascade")
    p.add_argument("tiers", nargs="+", metavar="MODEL", help="the cascade's tiers, smallest first (catalog names, "
                   "GGUF files or HF directories, as `serve` takes them)")
    p.add_argument("--dev", required=True, help="JSON lines of HumanEval-format problems (not the evaluation's)")
    p.add_argument("--out", required=True, help="the calibration file to write")
    p.add_argument("--target-escalation", type=float, default=0.3,
                   help="the share of the dev set that escalates at the chosen threshold (default 0.3)")
    p.add_argument("--k", type=int, default=DEFAULT_K, help=f"tokens judged (default {DEFAULT_K})")
    p.add_argument("--signal", choices=("best", *SIGNALS), default="best",
                   help="the signal to set the threshold on (default: the best AUROC on the dev set)")
    p.add_argument("--probe-pool", choices=("prompt", "prompt+k"), default="prompt",
                   help="the probe's features: the hidden state pooled over the prompt (a router) or also the "
                        "first k tokens")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer (default 256)")
    p.add_argument("--limit", type=int, default=None, help="only the first N problems (a quick try)")
    add_engine_args(p)
    p.set_defaults(func=cmd_calibrate_cascade, **SERVING_DEFAULTS)
    return p


def _answers(args: argparse.Namespace, source: str, problems: list[dict], small: bool) -> list:
    """Each problem's greedy answer by one tier (the small one also with logprobs and pooled states)."""
    from ..config import engine_config_from_args
    from ..llm import LLM
    from ..model import catalog
    from ..sampling_params import SamplingParams

    ns = argparse.Namespace(**{**vars(args), "model": source})
    config = engine_config_from_args(ns)
    catalog.pull_missing(config.model)
    llm = LLM(**dataclasses.asdict(config))
    prompts = [p["prompt"] for p in problems]
    full = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, stop=STOPS,
                                                logprobs=CONFIDENCE_TOP_N if small else None, pool_hidden=small),
                        use_tqdm=False)
    at_k = None
    if small:  # the state the server's decision sees after k tokens (pooled over prompt + k - 1 generated)
        at_k = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.k, stop=STOPS, pool_hidden=True),
                            use_tqdm=False)
    del llm
    gc.collect()
    return [(f.outputs[0], a.outputs[0] if a else None) for f, a in zip(full, at_k or [None] * len(full), strict=True)]


def _out_of_fold(features: np.ndarray, failed: np.ndarray, groups: list[str]) -> np.ndarray:
    """Each problem's p(fail) from a probe fitted on the other folds; a group (a template's variants)
    stays in one fold, so no problem is scored by a probe that saw its near-twin."""
    names = sorted(set(groups))
    np.random.default_rng(0).shuffle(names)
    p = np.zeros(len(failed))
    for chunk in np.array_split(np.array(names, dtype=object), min(FOLDS, len(names))):
        fold = np.array([i for i, g in enumerate(groups) if g in set(chunk)])
        rest = np.setdiff1d(np.arange(len(failed)), fold)
        if not len(fold):
            continue
        if len(set(failed[rest])) < 2:
            p[fold] = failed[rest].mean()
            continue
        probe = LogisticProbe.fit(features[rest], failed[rest])
        p[fold] = [probe.p_fail(x) for x in features[fold]]
    return p


def cmd_calibrate_cascade(args: argparse.Namespace) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if len(args.tiers) < 2:
        raise ValueError("calibrate-cascade: give at least two tiers (SMALL LARGE)")
    if not 0 <= args.target_escalation <= 1:
        raise ValueError(f"--target-escalation: must be in [0, 1], got {args.target_escalation}")
    problems = load_problems(args.dev, args.limit)
    logger.info("%d problems; tier %s first", len(problems), args.tiers[0])
    small = _answers(args, args.tiers[0], problems, small=True)
    small_ok = np.array([passes(p, c.text) for p, (c, _) in zip(problems, small, strict=True)])
    logger.info("small tier passes %d of %d", small_ok.sum(), len(problems))
    large = _answers(args, args.tiers[-1], problems, small=False)
    large_ok = np.array([passes(p, c.text) for p, (c, _) in zip(problems, large, strict=True)])
    failed = (~small_ok).astype(float)
    conf = {name: np.array([token_signals(c.token_ids[: args.k], (c.logprobs or [])[: args.k])[name]
                            for c, _ in small]) for name in TOKEN_SIGNALS}
    features = np.array([(c.prompt_hidden if args.probe_pool == "prompt" else at_k.pooled_hidden)
                         for c, at_k in small])
    conf["probe"] = 1.0 - _out_of_fold(features, failed, [p.get("group", p.get("task_id", str(i)))
                                                          for i, p in enumerate(problems)])
    aurocs = {name: auroc(1.0 - c, failed.astype(bool)) for name, c in conf.items()}
    signal = args.signal if args.signal != "best" else max(aurocs, key=lambda s: aurocs[s] or 0.0)
    threshold = threshold_for_rate(conf[signal], args.target_escalation)
    rule = CascadeRule(k=args.k, signal=signal, threshold=threshold, probe_pool=args.probe_pool,
                       probe=LogisticProbe.fit(features, failed) if len(set(failed)) > 1 else None,
                       thresholds={s: threshold_for_rate(c, args.target_escalation) for s, c in conf.items()})
    if rule.signal == "probe" and rule.probe is None:
        raise ValueError("calibrate-cascade: the small tier passed (or failed) every problem; no probe to fit")
    escalate = np.array([rule.escalates(c) for c in conf[signal]])
    cascade_ok = np.where(escalate, large_ok, small_ok)
    report = {"problems": len(problems), "dev": args.dev, "small_pass": float(small_ok.mean()),
              "large_pass": float(large_ok.mean()), "cascade_pass": float(cascade_ok.mean()),
              "escalation_rate": float(escalate.mean()), "auroc_small_fails": aurocs,
              "max_tokens": args.max_tokens, "quantization": getattr(args, "quantization", None),
              # each problem's outcome and confidences (the probe's out of fold): a refit needs no rerun
              "per_problem": [{"task_id": p.get("task_id"), "small_pass": bool(ok_s), "large_pass": bool(ok_l),
                               **{name: round(float(c[i]), 5) for name, c in conf.items()}}
                              for i, (p, ok_s, ok_l) in enumerate(zip(problems, small_ok, large_ok, strict=True))]}
    write_config(args.out, list(args.tiers), rule, report)
    print(json.dumps({"signal": signal, "threshold": threshold,
                      **{k: v for k, v in report.items() if k != "per_problem"}}, indent=1))
    return 0
