# Every target builds the virtual environment it needs (pinned versions from constraints.txt).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SMOE := $(VENV)/bin/smoe
STAMP := $(VENV)/.installed

.PHONY: demo test test-quant bench-quantize venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(SMOE) demo

test: $(STAMP)
	$(PY) -m pytest -q

test-quant: $(STAMP)
	$(SMOE) test-quant

bench-quantize: $(STAMP)
	$(SMOE) bench quantize

clean:
	rm -rf $(VENV) out
