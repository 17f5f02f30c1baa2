"""`tokenloom bench serve`'s flags, in our spelling and in `vllm bench serve`'s, resolved to one config.

A person who has a `vllm bench serve` command line should be able to point it at tokenloom unchanged
where the flag means something here. Both spellings land in one `BenchServeConfig`
(`bench_config_from_args`), so the rest of the benchmark never sees which one was typed:

| ours | vLLM's |
|---|---|
| `--base-url URL` | `--base-url URL`, or `--host H --port P` |
| `--endpoint completions\\|chat` | `--backend openai\\|vllm\\|openai-chat`, `--endpoint /v1/completions\\|/v1/chat/completions` |
| `--dataset random\\|mixed\\|PATH.jsonl` | `--dataset-name random\\|custom --dataset-path PATH.jsonl` (`mixed` is ours) |
| `--input-len`, `--output-len` | `--random-input-len`, `--random-output-len` (`--custom-output-len`), `--random-range-ratio` |
| `--out PATH` | `--save-result [--result-dir DIR] [--result-filename NAME] [--label L]` |
| `--slo-ttft-ms` etc. | `--goodput ttft:MS tpot:MS e2el:MS` |
| `--no-progress` | `--disable-tqdm` |
| (percentiles 50, 90, 99) | `--metric-percentiles 50,90,99` |

Shared as they are: `--model`, `--num-prompts`, `--request-rate`, `--burstiness`, `--max-concurrency`,
`--seed`. `--ignore-eos` is accepted (ignore_eos is sent by default, as vLLM does for random prompts;
`--no-ignore-eos` turns it off); `--save-detailed` is accepted and changes nothing, since the per-request
arrays are always saved. A vLLM flag for something tokenloom's client does not do (a local tokenizer,
sampling parameters, ramp-up) is refused by argparse as unknown rather than silently ignored.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
# vLLM's --backend names for the two OpenAI endpoints ("vllm" is its other name for completions).
BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}
ENDPOINTS = {"completions": "completions", "/v1/completions": "completions",
             "chat": "chat", "/v1/chat/completions": "chat"}
DATASET_NAMES = ("random", "mixed", "custom")  # vLLM's `custom` is a .jsonl of {"prompt": ...} lines
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class BenchServeConfig:
    """What one `bench serve` run does, whichever spelling the flags were in."""

    base_url: str
    model: str | None
    endpoint: str  # "completions" | "chat"
    dataset: str  # "random" | "mixed" | a .jsonl path
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    input_len: int
    output_len: int
    output_len_dist: str | None
    range_ratio: float
    seed: int
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    slo_e2el_ms: float | None
    percentiles: tuple[float, ...]
    out: str | None  # the result file, when its name is known before the run
    out_dir: str | None  # --save-result without --result-filename: vLLM's name, made once the model is known
    label: str | None
    api_key: str | None
    progress: bool
    ignore_eos: bool
    align_prompts: bool
    request_timeout: float
    run_timeout: float | None

    def result_path(self, model: str, when: str) -> str | None:
        """Where the result JSON goes: --out, or vLLM's
        ``{label}-{rate}qps[-concurrency{N}]-{model}-{YYYYmmdd-HHMMSS}.json`` in --result-dir."""
        if self.out is not None or self.out_dir is None:
            return self.out
        concurrency = f"-concurrency{self.max_concurrency}" if self.max_concurrency is not None else ""
        label = self.label or ("openai-chat" if self.endpoint == "chat" else "openai")
        name = f"{label}-{self.request_rate}qps{concurrency}-{model.split('/')[-1]}-{when}.json"
        return os.path.join(self.out_dir, name)


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    """Every flag of `bench serve`, ours with vLLM's names beside them (see the module docstring)."""
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default=None, help="server root, without /v1 (default: http://HOST:PORT)")
    server.add_argument("--host", default="127.0.0.1", help="vLLM's: the server's host when --base-url is not given")
    server.add_argument("--port", type=int, default=8000, help="vLLM's: the server's port when --base-url is not given")
    server.add_argument("--model", default=None, help="model name (default: first id from GET /v1/models)")
    server.add_argument("--endpoint", type=_endpoint, default=None,
                        help="completions | chat (or vLLM's paths /v1/completions, /v1/chat/completions); "
                             "default: completions")
    server.add_argument("--backend", choices=tuple(BACKENDS), default=None,
                        help="vLLM's: openai (or vllm) = completions, openai-chat = chat")
    server.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")

    data = p.add_argument_group("prompts")
    data.add_argument("--dataset", default=None, help="random | mixed | PATH.jsonl (default: random)")
    data.add_argument("--dataset-name", choices=DATASET_NAMES, default=None,
                      help="vLLM's: random | custom (with --dataset-path) | mixed (ours)")
    data.add_argument("--dataset-path", default=None, help="vLLM's: the .jsonl file of --dataset-name custom")
    data.add_argument("--num-prompts", type=int, default=100)
    data.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128,
                      help="prompt length in tokens (random/mixed)")
    data.add_argument("--output-len", "--random-output-len", "--custom-output-len", dest="output_len", type=int,
                      default=128, help="max_tokens for the 'fixed' distribution")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="vLLM's: random prompt and output lengths drawn uniformly from "
                           "[len * (1 - r), len * (1 + r)], r in [0, 1)")
    data.add_argument("--output-len-dist", default=None,
                      help="fixed | uniform:a,b | mixed:short,long (default: fixed; mixed:16,256 for --dataset mixed; "
                           "the file's max_tokens for .jsonl)")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--no-align-prompts", action="store_true",
                      help="skip exact-length alignment via /tokenize")

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests/s (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests")
    load.add_argument("--no-ignore-eos", dest="no_ignore_eos", action="store_true",
                      help="do not send ignore_eos: true")
    load.add_argument("--ignore-eos", dest="no_ignore_eos", action="store_false", default=False,
                      help="vLLM's: send ignore_eos: true (the default here)")
    load.add_argument("--request-timeout", type=float, default=600.0, help="per-request total timeout (s)")
    load.add_argument("--run-timeout", type=float, default=None, help="whole-run deadline (s)")

    out = p.add_argument_group("results")
    out.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT (ms)")
    out.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT (ms)")
    out.add_argument("--slo-e2el-ms", type=float, default=None, help="goodput SLO on E2EL (ms)")
    out.add_argument("--goodput", nargs="+", type=_goodput_pair, default=None, metavar="KEY:MS",
                     help="vLLM's: goodput SLOs as ttft:MS tpot:MS e2el:MS")
    out.add_argument("--metric-percentiles", type=_percentiles, default=DEFAULT_PERCENTILES,
                     help="comma list of percentiles to report (default: 50,90,99)")
    out.add_argument("--out", default=None, help="write the result JSON here")
    out.add_argument("--save-result", action="store_true",
                     help="vLLM's: write the result JSON as --result-dir/--result-filename (default name: "
                          "{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json in the current directory)")
    out.add_argument("--result-dir", default=None, help="vLLM's: the directory of --save-result")
    out.add_argument("--result-filename", default=None, help="vLLM's: the file name of --save-result")
    out.add_argument("--label", default=None, help="vLLM's: the file name's prefix (default: the backend's name)")
    out.add_argument("--save-detailed", action="store_true",
                     help="vLLM's: accepted; the per-request arrays are always saved")
    out.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true",
                     help="no progress bar")


def _endpoint(text: str) -> str:
    if text not in ENDPOINTS:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(ENDPOINTS)} (got {text!r})")
    return ENDPOINTS[text]


def _goodput_pair(text: str) -> tuple[str, float]:
    name, sep, value = text.partition(":")
    try:
        ms = float(value) if sep else math.nan
    except ValueError:
        ms = math.nan
    if name not in GOODPUT_METRICS or not ms >= 0:  # NaN fails
        raise argparse.ArgumentTypeError(
            f"{text!r}: give KEY:MS with KEY one of {', '.join(GOODPUT_METRICS)} and MS a number >= 0")
    return name, ms


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(0 < v < 100 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of numbers in (0, 100), e.g. 50,90,99")
    return values


def bench_config_from_args(args: argparse.Namespace) -> BenchServeConfig:
    """Resolve both spellings into one config; contradictions are ValueErrors naming the flags."""
    return BenchServeConfig(
        base_url=(args.base_url or f"http://{_host_port(args.host, args.port)}").rstrip("/"),
        model=args.model,
        endpoint=_resolve_endpoint(args.endpoint, args.backend),
        dataset=_resolve_dataset(args.dataset, args.dataset_name, args.dataset_path),
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        output_len_dist=args.output_len_dist,
        range_ratio=_resolve_range_ratio(args.random_range_ratio, args.output_len_dist),
        seed=args.seed,
        **_resolve_slos(args),
        percentiles=tuple(args.metric_percentiles),
        **_resolve_out(args),
        label=args.label,
        api_key=args.api_key,
        progress=not args.no_progress,
        ignore_eos=not args.no_ignore_eos,
        align_prompts=not args.no_align_prompts,
        request_timeout=args.request_timeout,
        run_timeout=args.run_timeout,
    )


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _resolve_endpoint(endpoint: str | None, backend: str | None) -> str:
    from_backend = BACKENDS.get(backend) if backend else None
    if endpoint and from_backend and endpoint != from_backend:
        raise ValueError(f"--backend {backend} sends to the {from_backend} endpoint, --endpoint says {endpoint}; "
                         "give one, or two that agree")
    return endpoint or from_backend or "completions"


def _resolve_dataset(dataset: str | None, name: str | None, path: str | None) -> str:
    if dataset is not None and (name is not None or path is not None):
        raise ValueError("--dataset and --dataset-name/--dataset-path both name the prompts; give one")
    if name == "custom":
        if path is None:
            raise ValueError("--dataset-name custom needs --dataset-path PATH.jsonl")
        return path
    if path is not None:
        raise ValueError(f"--dataset-path goes with --dataset-name custom (got --dataset-name {name or 'random'})")
    return dataset or name or "random"


def _resolve_range_ratio(ratio: float, output_len_dist: str | None) -> float:
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio: must be in [0, 1), got {ratio}")
    if ratio and output_len_dist is not None:
        raise ValueError("--random-range-ratio and --output-len-dist both set the output lengths; give one")
    return ratio


def _resolve_slos(args: argparse.Namespace) -> dict[str, float | None]:
    slos = {f"slo_{m}_ms": getattr(args, f"slo_{m}_ms") for m in GOODPUT_METRICS}
    for metric, ms in args.goodput or ():
        key = f"slo_{metric}_ms"
        if slos[key] is not None and slos[key] != ms:
            raise ValueError(f"--goodput {metric}:{ms:g} and --{key.replace('_', '-')} {slos[key]:g} disagree")
        slos[key] = ms
    return slos


def _resolve_out(args: argparse.Namespace) -> dict[str, str | None]:
    if not args.save_result:
        if args.result_dir is not None or args.result_filename is not None:
            raise ValueError("--result-dir/--result-filename name the file of --save-result, which is not given")
        return {"out": args.out, "out_dir": None}
    if args.out is not None:
        raise ValueError("--out and --save-result both name the result file; give one")
    directory = args.result_dir or ""
    if args.result_filename is not None:
        return {"out": os.path.join(directory, args.result_filename), "out_dir": None}
    return {"out": None, "out_dir": directory or "."}
