# `make demo` and `make test` each create .venv (or refresh it when a
# requirements file changed) and then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test venv clean

demo: $(STAMP)
	$(PY) train_dp.py

test: $(STAMP)
	$(PY) -m pytest -q tests

venv: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $(STAMP)

clean:
	rm -rf $(VENV) runs data .pytest_cache
