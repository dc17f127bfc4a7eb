# kvpilot: `make test` sets itself up from nothing and runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: test test-isa test-under-load lint venv lock clean

venv: $(STAMP)

# Every package on the test path is pinned by mk/constraints.txt (torch among them: its wheel from the
# registry is a multi-GB CUDA build, which runs on the CPU). torch goes first, alone, so that the
# download is visible as such.
CONSTRAINTS := mk/constraints.txt
$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@echo "installing torch $$(grep '^torch==' $(CONSTRAINTS) | cut -d= -f3) (a multi-GB download on a fresh machine)"
	$(PIP) install -q -c $(CONSTRAINTS) torch
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[engine,operator,test,demo]'
	touch $(STAMP)

# Pin the venv's current set (after `make test` passed on it).
lock: $(STAMP)
	{ sed -n '/^#/p' $(CONSTRAINTS); $(PIP) freeze --exclude-editable; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)

# KVPILOT_REQUIRE_TOOLS=1: tests that need helm/kubectl/hadolint/promtool or vLLM fail (instead of
# skipping) when absent. vLLM runs from its own virtual environment (mk/vllm.mk).
test: $(STAMP) test-operator-prereqs vllm-venv
	KVPILOT_REQUIRE_TOOLS=1 KVPILOT_VLLM_PYTHON=$(VLLM_PY) $(PY) -m pytest -q tests

# The kernel, sampler and engine-parity tests again on the code paths of an AVX2 CPU without AVX-512:
# torch's kernels at its avx2 dispatch level, oneDNN capped at AVX2, and the C++ kernels built for
# x86-64-v3 (AVX2 + FMA). On an AVX2 machine it repeats what `make test` ran; on an AVX-512 one it
# shows what an AVX2 machine would run.
ISA_TESTS ?= tests/kernels tests/engine/test_sampling_vs_hf.py tests/engine/test_llm_vs_hf.py \
	tests/engine/test_swap_vs_hf.py tests/engine/test_parallel_vs_hf.py
test-isa: $(STAMP)
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 KVPILOT_CPU_MARCH=x86-64-v3 \
		KVPILOT_REQUIRE_TOOLS=1 $(PY) -m pytest -q $(ISA_TESTS)

# The whole suite while another process keeps one core busy.
test-under-load:
	bash mk/under-load.sh test

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .tools

include mk/operator.mk
include mk/k8s.mk
include mk/vllm.mk
include mk/demo.mk
