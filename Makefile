# Every target builds the virtual environment it needs (pinned versions from constraints.txt).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SMOE := $(VENV)/bin/smoe
STAMP := $(VENV)/.installed

.PHONY: demo test test-integrations browser test-quant bench-quantize venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(SMOE) demo

test: $(STAMP)
	$(PY) -m pytest -q --ignore=tests/integration

# Slow tests against real outside programs (a browser, llama.cpp, mlx): everything under tests/integration.
test-integrations: $(STAMP) browser
	$(PY) -m pytest -q tests/integration

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
