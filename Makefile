# kvpilot: `make test` sets itself up from nothing and runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: test lint venv clean

venv: $(STAMP)

# torch is pinned on the test path: the CPU build of this version is what the test machines carry,
# and an unpinned requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[engine,operator,test,demo]'
	touch $(STAMP)

# KVPILOT_REQUIRE_TOOLS=1: tests that need helm/kubectl/hadolint/promtool or vLLM fail (instead of
# skipping) when absent. vLLM runs from its own virtual environment (mk/vllm.mk).
test: $(STAMP) test-operator-prereqs vllm-venv
	KVPILOT_REQUIRE_TOOLS=1 KVPILOT_VLLM_PYTHON=$(VLLM_PY) $(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .tools

include mk/operator.mk
include mk/vllm.mk
include mk/demo.mk
