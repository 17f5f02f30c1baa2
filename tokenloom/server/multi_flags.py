"""The flags of `tokenloom serve` with several models, and whether a command line asks for them
(multi_serve.py serves them; kept apart so `serve --help` loads no web stack)."""

from __future__ import annotations

import argparse
import os

from .cascade_config import add_cascade_args


def add_multi_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models-preset", metavar="FILE", default=None,
                   help="several models from a TOML file: a [NAME] table per model with its source, aliases, "
                        "pin, load_on_startup, lora_modules and its own engine flags (e.g. quantization, "
                        "max_model_len, kv_cache_memory_bytes, speculative_config), or a cascade's tiers; after "
                        "any MODEL given on the command line")
    p.add_argument("--memory-budget", type=int, default=None, metavar="BYTES",
                   help="with several models: bytes the resident models (weights, KV pools, drafts, adapters) may "
                        "take; loading one evicts least-recently-used idle ones (default: 80%% of the memory this "
                        "process may use)")
    p.add_argument("--models-max", type=int, default=None, metavar="N",
                   help="with several models: at most N resident at once (default: no limit but the budget)")
    p.add_argument("--sleep-idle-seconds", type=float, default=None, metavar="S",
                   help="with several models: unload a model idle for S seconds (a request's `keep_alive`, "
                        "in seconds, overrides it for its model; 0: once idle, negative: never)")
    p.add_argument("--no-models-autoload", dest="models_autoload", action="store_false",
                   help="with several models: a request for one not loaded is a 400 naming its status "
                        "(POST /models/load loads it) instead of loading it")
    add_cascade_args(p)


def is_multi(args: argparse.Namespace) -> bool:
    tags = args.model_tag or []
    named = len(tags) == 1 and "=" in tags[0] and not os.path.exists(tags[0])
    return (len(tags) > 1 or named or args.memory_budget is not None or args.models_max is not None
            or args.models_preset is not None or args.sleep_idle_seconds is not None or bool(args.cascade))


# A preset table's engine flags: EngineConfig's, as `serve` spells them (dashes or underscores), less the
# model's source (the table's `source`) and the device (one per server).
NOT_PER_MODEL = ("model", "device")


def preset_flags(where: str, table: dict) -> dict:
    """A preset table's engine flags, checked and converted as `serve`'s command line would (`--key
    value`, booleans as `--key` / `--no-key`, tables as JSON): {argparse dest: value}; a ValueError naming
    `where` and the key for an unknown key or a bad value."""
    import json

    from ..config import add_engine_args

    parser = _RaisingParser(prog=where, add_help=False)
    add_engine_args(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # only the keys the table gives
    actions = {a.dest: a for a in parser._actions}
    known = set(actions) - set(NOT_PER_MODEL)
    argv: list[str] = []
    for key, value in table.items():
        dest = key.replace("-", "_")
        if dest not in known:
            raise ValueError(f"{where}: unknown key {key!r} (a table takes source, aliases, pin, load_on_startup, "
                             f"lora_modules and engine flags: {', '.join(sorted(known))})")
        flag = "--" + dest.replace("_", "-")
        if isinstance(actions[dest], argparse.BooleanOptionalAction) and not isinstance(value, bool):
            raise ValueError(f"{where}: `{key}` must be true or false, got {value!r}")  # noqa: TRY004 - the CLI's one-line errors
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + dest.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    try:
        return vars(parser.parse_args(argv))
    except argparse.ArgumentError as exc:
        raise ValueError(f"{where}: {exc}") from None


class _RaisingParser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of printing and exiting (a preset's errors name its table)."""

    def error(self, message: str):
        raise argparse.ArgumentError(None, message)
