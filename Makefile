# `make demo` and `make test` each create .venv (or refresh it when a
# requirements file changed) and then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: benchmark demo gpu-check test test-slurm venv clean

demo: $(STAMP)
	$(PY) train_dp.py --overwrite

test: $(STAMP)
	$(PY) -m pytest -q tests

# The sbatch scripts under a real one-node Slurm on this machine (root: installs slurm-wlm and munge).
# The cluster is stopped afterwards whatever happened; the exit status is pytest's (or start's).
# REQUIRE_SLURM=1: a Slurm node that does not respond fails the tests instead of skipping them.
test-slurm: $(STAMP)
	run_scripts/slurm_local_cluster.sh install
	status=0; \
	run_scripts/slurm_local_cluster.sh start && REQUIRE_SLURM=1 $(PY) -m pytest -q tests/test_slurm.py || status=$$?; \
	run_scripts/slurm_local_cluster.sh stop; \
	exit $$status

benchmark: $(STAMP)
	$(PY) run_scripts/benchmark.py

# Every script, launch mode and GPU flag on this machine's GPUs: one table, exit 1 on any failure.
# Without a GPU it says so and exits 0.
gpu-check: $(STAMP)
	$(PY) run_scripts/gpu_check.py

venv: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt requirements-imagenet.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $(STAMP)

# Only what `make` and the tests generate: the venv, pytest's cache, the built-in demo set
# (common/demo_data.py) and the benchmark's JPEGs (run_scripts/benchmark.py). Your runs/ and
# anything else under data/ stay.
clean:
	rm -rf $(VENV) .pytest_cache data/demo-shapes-v1 data/bench-jpegs-500x375
	rm -rf __pycache__ common/__pycache__ run_scripts/__pycache__ tests/__pycache__
	rmdir data 2>/dev/null || true
