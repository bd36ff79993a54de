# Every target builds the virtual environment it needs (pinned versions from constraints.txt).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SMOE := $(VENV)/bin/smoe
STAMP := $(VENV)/.installed
INTEGRATIONS := $(VENV)/.installed-integrations

.PHONY: demo test test-integrations browser test-quant bench-quantize venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test,cuda,ray]'
	touch $(STAMP)

demo: $(STAMP)
	$(SMOE) demo

# The import contracts and the linter (both configured in pyproject.toml), then the tests.
test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check smoe tests scripts
	$(PY) -m pytest -q --ignore=tests/integration

# Slow tests against real outside programs (a browser, llama.cpp, mlx) the server's HTTP edges and the thread bounds: everything under tests/integration.
test-integrations: $(INTEGRATIONS) browser
	$(PY) -m pytest -q tests/integration

# llama-cpp-python, mlx[cpu], mlx-lm and lm-evaluation-harness at the versions in constraints.txt; llama-cpp-python compiles
# llama.cpp from its source release once (pip keeps the built wheel).
$(INTEGRATIONS): $(STAMP)
	@echo "installing llama-cpp-python, mlx, mlx-lm and lm-evaluation-harness: llama-cpp-python compiles llama.cpp from source the first time (about 20 minutes for this install on 2 cores, with no output from pip meanwhile)"
	$(PY) -m pip install -q -c constraints.txt -e '.[test,cuda,ray,integrations]'
	touch $(INTEGRATIONS)

# Debian's headless Chromium and its WebDriver, for the web chat test.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium chromium-driver; }

test-quant: $(STAMP)
	$(SMOE) test-quant

bench-quantize: $(STAMP)
	$(SMOE) bench quantize

clean:
	rm -rf $(VENV) out
