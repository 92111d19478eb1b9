# Two commands for a fresh machine: `make train` (the main job) and `make test` (the suite).
# Each creates its own virtual environment first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zeroplus-installed

.PHONY: venv train test test-fast lint bench clean

$(STAMP): setup.py
	python3 -m venv $(VENV)
	# torch==2.13.0 first: the CPU build on this machine's disk, not a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,deepspeed,plotting,monitors]"
	touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/zeroplus train $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) tools/typecheck.py
	DS_ACCELERATOR=cpu $(PY) -m pytest -q -n 2 --dist worksteal tests $(ARGS)

# the fast tier (pytest marker `fast`): a broken core in under 3 minutes; CI runs the whole suite (`make test`)
test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	DS_ACCELERATOR=cpu $(PY) -m pytest -q -m fast tests $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) tools/typecheck.py

bench: $(STAMP)
	DS_ACCELERATOR=cpu $(PY) bench/bench_zero.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
