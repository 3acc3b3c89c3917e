# `make demo` and `make test` each create .venv from the lock (requirements-lock.txt: exact versions
# and sha256 hashes of everything installed), or create it anew when the lock changed, and then run.
# requirements.txt keeps loose ranges for installing into your own environment.
PYTHON ?= python3
comma  := ,
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCK   := requirements-lock.txt
# The lock covers Python >= LOCK_PYTHON on Linux (torch's CUDA build, which also runs without a GPU),
# macOS and Windows, one version of each package for all of them (--fork-strategy fewest).
LOCK_PYTHON := 3.11
# uv resolves the lock: a pinned copy of it lives in .venv-lock (make lock installs it there).
UV_VERSION := 0.13.9
UV_VENV    := .venv-lock
UV         := $(UV_VENV)/bin/uv
UV_COMPILE  = $(UV) pip compile --quiet --upgrade --generate-hashes --universal \
              --python-version $(LOCK_PYTHON) --fork-strategy fewest --custom-compile-command "make lock" \
              requirements-dev.txt
# $(call venv_from,DIR,LOCKFILE): DIR made anew, holding exactly what LOCKFILE lists. --require-hashes: every
# package, dependencies included, must be there with its hash, and each file pip takes must match one (a
# local wheel of the same version with another build cannot).
venv_from = rm -rf $(1) && $(PYTHON) -m venv $(1) && $(1)/bin/python -m pip install --quiet --require-hashes -r $(2)

.PHONY: benchmark benchmark-gpu demo format gpu-check lock test test-quick test-latest test-oldest test-slurm venv clean

demo: $(STAMP)
	$(PY) train_dp.py --overwrite

test: $(STAMP)
	$(PY) -m pytest -q tests

# The edit-test loop: the unit tier (tests/unit/, in-process) and one DP and one torchrun run (tests/test_quick.py).
test-quick: $(STAMP)
	$(PY) -m pytest -q -m "unit or quick" tests

# ruff's formatting and its fixes (ruff.toml); tests/unit/test_layout.py fails on what is left.
format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# The sbatch scripts under a real one-node Slurm on this machine (root: installs slurm-wlm and munge).
# The cluster is stopped afterwards whatever happened; the exit status is pytest's (or start's).
# REQUIRE_SLURM=1: a Slurm node that does not respond fails the tests instead of skipping them.
test-slurm: $(STAMP)
	tools/slurm_local_cluster.sh install
	status=0; \
	tools/slurm_local_cluster.sh start && REQUIRE_SLURM=1 $(PY) -m pytest -q tests/test_slurm.py || status=$$?; \
	tools/slurm_local_cluster.sh stop; \
	exit $$status

benchmark: $(STAMP)
	$(PY) tools/benchmark.py

# The GPU at steady state (ResNet-50, ViT-B/16, from synthetic data and JPEGs): one table under $OUT/benchmark-gpu or
# ./benchmark-gpu, about 8 min on one H100 or H200 (estimated from its rows' times). Without a GPU it says so and exits 0.
# On a machine with a torch of its own and no network to install the lock: python tools/benchmark_gpu.py (and
# python tools/gpu_check.py), with that python.
benchmark-gpu: $(STAMP)
	$(PY) tools/benchmark_gpu.py

# Every script, launch mode and GPU flag on this machine's GPUs: one table, exit 1 on any failure.
# Without a GPU it says so and exits 0.
gpu-check: $(STAMP)
	$(PY) tools/gpu_check.py

venv: $(STAMP)

# A new lock makes a new venv: it then holds exactly what the lock lists, nothing left from before.
$(STAMP): $(LOCK)
	@$(PYTHON) -c 'import sys; v = sys.version_info; sys.exit(v < ($(subst .,$(comma),$(LOCK_PYTHON)),) and \
	  f"error: $(PYTHON) is Python {v[0]}.{v[1]}; $(LOCK) is for Python $(LOCK_PYTHON) or newer: make PYTHON=python$(LOCK_PYTHON) ...")'
	$(call venv_from,$(VENV),$(LOCK))
	touch $(STAMP)

$(UV):
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install --quiet uv==$(UV_VERSION)

# The newest versions that requirements-dev.txt allows, with their hashes, into the lock. Run
# `make test-latest` first: it tries those versions without touching .venv or the lock.
lock: $(UV)
	$(UV_COMPILE) -o $(LOCK)

# The newest versions into .venv-latest (not .venv), then the suite there; the lock is left alone.
# Ends with what `make lock` would change in the lock.
test-latest: $(UV)
	$(UV_COMPILE) -o $(UV_VENV)/latest.txt
	$(call venv_from,.venv-latest,$(UV_VENV)/latest.txt)
	grep -E '^[a-z]' $(LOCK) >$(UV_VENV)/locked.pins; grep -E '^[a-z]' $(UV_VENV)/latest.txt >$(UV_VENV)/latest.pins
	status=0; .venv-latest/bin/python -m pytest -q tests || status=$$?; \
	echo "what make lock would change in $(LOCK) (< locked, > latest):"; \
	diff $(UV_VENV)/locked.pins $(UV_VENV)/latest.pins || true; \
	exit $$status

# The oldest versions requirements.txt allows (its floors: uv's lowest-direct resolution) into .venv-oldest, then
# gpu-check's CPU self-test there: every script and launch mode, FSDP's losses against DDP's, exact resume.
# On Python $(LOCK_PYTHON), the oldest the lock covers (older packages have no wheels for newer Pythons).
test-oldest: $(UV)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != ($(subst .,$(comma),$(LOCK_PYTHON)),) and \
	  f"error: $(PYTHON) is Python {sys.version_info[0]}.{sys.version_info[1]}; the floors are checked on Python $(LOCK_PYTHON): make PYTHON=python$(LOCK_PYTHON) test-oldest")'
	rm -f $(UV_VENV)/oldest.txt
	$(UV) pip compile --quiet --generate-hashes --python-version $(LOCK_PYTHON) --resolution lowest-direct \
	  requirements.txt -o $(UV_VENV)/oldest.txt
	$(call venv_from,.venv-oldest,$(UV_VENV)/oldest.txt)
	.venv-oldest/bin/python tools/gpu_check.py --cpu

# Only what `make` and the tests generate: the venvs, pytest's cache, the built-in demo set
# (common/demo_data.py) and the benchmark's JPEGs (tools/benchmark.py). Your runs/ and
# anything else under data/ stay.
clean:
	rm -rf $(VENV) $(UV_VENV) .venv-latest .venv-oldest .pytest_cache data/demo-shapes-v2 data/bench-jpegs-500x375
	rm -rf __pycache__ common/__pycache__ tools/__pycache__ tests/__pycache__ examples/__pycache__
	rmdir data 2>/dev/null || true
