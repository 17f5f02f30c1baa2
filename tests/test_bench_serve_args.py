"""`tokenloom bench serve` takes `vllm bench serve`'s flag names: both spellings give one config."""

from __future__ import annotations

import argparse
import math

import pytest

from tokenloom.bench.datasets import load_samples
from tokenloom.bench.serve_args import bench_config_from_args
from tokenloom.bench.serve_cli import add_bench_parser


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "serve", *argv])


def config(argv: list[str]):
    return bench_config_from_args(parse(argv))


def test_vllm_spelling_gives_the_same_config_as_ours(tmp_path):
    ours = config([
        "--base-url", "http://10.0.0.5:9000", "--endpoint", "chat", "--dataset", "random", "--input-len", "256",
        "--output-len", "64", "--num-prompts", "50", "--request-rate", "4", "--max-concurrency", "8",
        "--model", "m", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--out", str(tmp_path / "r.json"),
        "--no-progress", "--seed", "3",
    ])
    vllm = config([
        "--host", "10.0.0.5", "--port", "9000", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64",
        "--num-prompts", "50", "--request-rate", "4", "--max-concurrency", "8", "--model", "m",
        "--goodput", "ttft:500", "tpot:50", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "r.json", "--disable-tqdm", "--seed", "3", "--ignore-eos", "--save-detailed",
    ])
    assert vllm == ours
    assert ours.endpoint == "chat" and ours.base_url == "http://10.0.0.5:9000" and ours.input_len == 256
    assert ours.slo_ttft_ms == 500 and ours.out == str(tmp_path / "r.json") and not ours.progress


def test_defaults_and_backends():
    default = config([])
    assert (default.base_url, default.endpoint, default.dataset) == ("http://127.0.0.1:8000", "completions", "random")
    assert math.isinf(default.request_rate) and default.ignore_eos and default.percentiles == (50, 90, 99)
    assert config(["--backend", "openai"]).endpoint == "completions"
    assert config(["--backend", "vllm", "--endpoint", "/v1/completions"]).endpoint == "completions"
    assert config(["--no-ignore-eos"]).ignore_eos is False
    assert config(["--metric-percentiles", "25,99.9"]).percentiles == (25, 99.9)
    assert config(["--base-url", "http://h:1/"]).base_url == "http://h:1"


def test_custom_dataset_is_our_jsonl(tmp_path):
    path = str(tmp_path / "p.jsonl")
    assert config(["--dataset-name", "custom", "--dataset-path", path]) == config(["--dataset", path])
    assert config(["--dataset-name", "mixed"]).dataset == "mixed"


def test_save_result_default_name_is_vllms(tmp_path):
    cfg = config(["--save-result", "--result-dir", str(tmp_path), "--request-rate", "2", "--max-concurrency", "4"])
    assert cfg.out is None
    path = cfg.result_path("org/Model-1", "20260101-120000")
    assert path == str(tmp_path / "openai-2.0qps-concurrency4-Model-1-20260101-120000.json")
    labelled = config(["--save-result", "--label", "tl", "--backend", "openai-chat"])
    assert labelled.result_path("m", "d") == "./tl-infqps-m-d.json"
    assert config([]).result_path("m", "d") is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--backend openai-chat"),
    (["--dataset", "mixed", "--dataset-name", "random"], "--dataset and --dataset-name"),
    (["--dataset-name", "custom"], "needs --dataset-path"),
    (["--dataset-path", "x.jsonl"], "--dataset-path goes with --dataset-name custom"),
    (["--random-range-ratio", "1.0"], "--random-range-ratio"),
    (["--random-range-ratio", "0.5", "--output-len-dist", "uniform:1,4"], "--output-len-dist"),
    (["--goodput", "ttft:100", "--slo-ttft-ms", "200"], "disagree"),
    (["--out", "a.json", "--save-result"], "--out and --save-result"),
    (["--result-dir", "d"], "--save-result"),
])
def test_contradictions_are_named(argv, message):
    with pytest.raises(ValueError, match=message):
        config(argv)


@pytest.mark.parametrize("argv", [
    ["--backend", "tgi"], ["--endpoint", "/v1/embeddings"], ["--dataset-name", "sharegpt"],
    ["--goodput", "ttft"], ["--goodput", "itl:5"], ["--goodput", "ttft:-1"], ["--metric-percentiles", "0,50"],
    ["--tokenizer", "x"],
])
def test_bad_flags_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert "error:" in capsys.readouterr().err


def test_random_range_ratio_draws_lengths_around_the_given_ones():
    samples = load_samples("random", 200, input_len=100, output_len=20, seed=1, range_ratio=0.5)
    ins, outs = [s.prompt_len for s in samples], [s.max_tokens for s in samples]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 20
    assert min(outs) >= 10 and max(outs) <= 30 and len(set(outs)) > 5
    assert all(len(s.prompt.split()) == s.prompt_len for s in samples)
    assert samples == load_samples("random", 200, input_len=100, output_len=20, seed=1, range_ratio=0.5)
    with pytest.raises(ValueError, match="only for the random dataset"):
        load_samples("mixed", 4, range_ratio=0.5)

