# The two newcomer commands:  `make demo`  and  `make test`.
# Both create .venv and install everything on first use (torch==2.13.0 CPU first,
# so that the `torch>=2.6` dependency is already satisfied and no CUDA build is pulled;
# then the dev, jax and hf extras: JAX CPU + optax, for tests/test_jax.py; transformers
# (~20 MB with its dependencies, no torch of its own), for tests/test_examples.py).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
LINTED := elastrain tests benchmarks examples

.PHONY: setup demo test lint system browser slurm clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,jax,hf]'
	$(BIN)/python -c "import torch; v = torch.__version__; assert v.split('+')[0] == '2.13.0', v"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/elastrain demo

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy

# What the tests need from Debian, in one apt-get (one index update) for whatever is
# missing: headless Chromium renders the report (tests/test_observe_run.py); slurm-wlm
# and munge bring up a real local Slurm cluster (tests/test_slurm.py).
system:
	@need=""; \
	command -v chromium >/dev/null 2>&1 || need="$$need chromium"; \
	command -v slurmctld >/dev/null 2>&1 || need="$$need slurm-wlm munge"; \
	if [ -n "$$need" ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "apt-get install$$need"; apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$need; fi

browser slurm: system

# Two pytest workers (pytest-xdist), one per core of the 2-core machines CI uses,
# each taking whole files (--dist loadfile): a file's module fixtures (the local
# Slurm cluster, the heal processes) are set up once, and a file's tests never run
# beside each other. Every test is hermetic (temp dirs, port 0, its own processes
# stopped by PID), so two files may run side by side.
# mypy (about a minute of one core on a fresh clone, no cache) runs beside the tests
# instead of before them; the target fails if either does.
test: $(STAMP) system
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy > .mypy-test.log 2>&1 & mypy=$$!; \
	$(BIN)/pytest -q -n 2 --dist loadfile --durations=15 tests; tests=$$?; \
	wait $$mypy; typed=$$?; cat .mypy-test.log; rm -f .mypy-test.log; \
	test $$tests -eq 0 && test $$typed -eq 0

clean:
	rm -rf $(VENV) runs .mypy_cache .ruff_cache .pytest_cache
