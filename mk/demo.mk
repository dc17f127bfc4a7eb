# `make demo`: the whole loop on one machine, no cluster. `kvpilot up --local` runs an InferenceService whose
# KV pool is too small for a bounded load; the terminal shows the preemption storm, the remediation and
# its reason; a summary and build/demo/timeline.png follow. A few minutes on 2 cores; exit 0 only when a
# remediation was applied and the preemption rate fell.
#   make demo                        a random-weight checkpoint, built once into $(DEMO_DIR) (git-ignored)
#   make demo MODEL=/path/to/hf-dir  a real Hugging Face model directory (slower on CPU)
#   KVPILOT_DEMO_QUICK=1 make demo   the short run (CI)
#   make demo DEMO_ARGS=--no-live    every change rolls out (no live relief): the restart path alone
#   make demo DEMO_ARGS=--no-plan    the ladder alone (spec.remediation.plan.enabled: false)
#   make demo DEMO_ARGS=--compare    the plan, then the ladder alone, and both side by side
DEMO_DIR ?= build/demo
DEMO_STAMP := $(VENV)/.demo-installed

.PHONY: demo

# The venv of `make test` plus the `demo` extra (matplotlib), pinned like it; torch stays as installed.
$(DEMO_STAMP): $(STAMP)
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[demo]'
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m kvpilot.operator.demo.run --out $(DEMO_DIR) $(if $(MODEL),--model $(MODEL)) $(DEMO_ARGS)
