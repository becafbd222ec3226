# make train: set up .venv and run the default recipe; make test: set up and run the tests.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup train test test-integration bench clean

setup: $(STAMP)

# torch==2.13.0 first: it is the CPU build on this machine's disk, so the project's range
# (torch>=2.9) is already met and pip never fetches a multi-GB CUDA build.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,slurm,data,hf,transformers,qlora,float8,ft,hfdata,tracking,rl,eval,hpo]'
	$(PY) -m pip install --quiet --no-deps 'hydra-optuna-sweeper>=1.3'   # (pyproject.toml's hpo extra says why)
	touch $(STAMP)

train: setup
	$(PY) -m framework.train

# Two pytest workers (pytest-xdist), a test file each at a time: a serial run leaves one of two
# cores idle about half its time (ranks starting, Hydra composing, gloo waiting). By file, a
# module's fixtures (models, data, test_slurm's cluster) are made once.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: setup
	$(PYTEST)

# the longer multi-process cases: more layouts of what make test proves (CI runs both)
test-integration: setup
	$(PYTEST) -m integration

bench: setup
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) outputs multirun
