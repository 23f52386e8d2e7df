# Quick start: `make demo` runs Saguaro on the embedded default pair; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint test-deps test-compat bench venv clean

# uv installs the packages (measured: 7 s for torch and the rest against pip's 39 s, the same versions);
# it reads no pip configuration, so tools/pip_sources.py hands it the sources pip is configured with (where
# this machine keeps the CPU build of torch: an unpinned or unfound torch would pull a CUDA build). Where
# uv cannot be had, pip does the same work without byte-compiling (torch 55 s with pip's one-file-at-a-time
# compile, 23 s without). compileall then compiles on all cores the modules the tests and the demo can import
# (34 s on two for everything, 19-25 s without the 2,600 files of transformers' model families other than
# `auto`, whose few used modules compile on import in milliseconds, and without pip's, setuptools' and test
# folders). The .pyc files must exist: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines)
# no import writes them, and every process would compile torch's modules again (about 10 s each). Like
# pip's, it passes over a file written for a newer Python (torch ships one).
NOT_COMPILED := /site-packages/(transformers/models/(?!auto/|__init__)|pip/|setuptools/|uv/|.*/tests?/)
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	( $(PY) -m pip install --quiet uv && $(VENV)/bin/uv pip install --quiet --python $(PY) \
	    --index-strategy unsafe-best-match $$($(PY) tools/pip_sources.py) "torch==2.13.0" -e ".[dev]" ) || \
	( $(PY) -m pip install --quiet --upgrade pip && \
	  $(PY) -m pip install --quiet --no-compile "torch==2.13.0" && \
	  $(PY) -m pip install --quiet --no-compile -e ".[dev]" )
	$(PY) -c "import compileall, re, sys; compileall.compile_dir(sys.argv[1], quiet=2, workers=0, \
	  rx=re.compile(sys.argv[2]))" $(VENV)/lib '$(NOT_COMPILED)'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Graphviz (`dot`: SVG of graphs and schedules) and a headless Chromium (the HTML report's browser test).
# Best effort: without them (no root, no network) the tests that need them skip and say why.
test-deps:
	@command -v dot >/dev/null && command -v chromium >/dev/null || \
	  ( apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      graphviz chromium >/dev/null ) || \
	  echo "make test-deps: could not install graphviz/chromium; their tests will be skipped"

# Two workers, one per core: every test runs torch with one intra-op thread (tests/conftest.py); tests
# are handed out one at a time, the heavy ones first, so both workers end together, and the tests of one
# xdist_group (a costly session fixture) go to one worker (--dist loadgroup); the tests marked isolated
# (figures compared across two clocks, which a loaded machine skews) then run in a pytest process of their own.
# The venv and the Debian packages are made side by side (uv's work and apt's barely compete). Byte code
# is written while the tests run, where PYTHONDONTWRITEBYTECODE says not to: pytest's rewritten test modules
# (collection measured 10.3-14.4 s without their .pyc, 6.9-8.7 s with) and the project's modules compile
# once, not again in each of the suite's processes (__pycache__ is ignored by git).
test:
	$(MAKE) --no-print-directory -j2 $(STAMP) test-deps
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2 --dist loadgroup -m "not isolated"
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -m isolated

# The suite on the oldest stack pyproject.toml admits, the GPU machine's: torch 2.11 + transformers 5.17 (Python
# 3.12 where pyenv has it). PyPI's torch 2.11 is its CUDA build, a multi-GB download, so this is not part of
# `make test`; the CUDA libraries stay unused on a CPU machine. Results: README.md, "Supported versions".
COMPAT_VENV := .venv-compat
COMPAT_PYTHON ?= $(shell for p in $$HOME/.pyenv/versions/3.12*/bin/python3 $$(command -v python3.12) python3; do \
                   $$p --version >/dev/null 2>&1 && echo $$p && break; done)
COMPAT_STAMP := $(COMPAT_VENV)/.installed

$(COMPAT_STAMP): pyproject.toml
	test -x $(COMPAT_VENV)/bin/python || $(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip install --quiet "torch==2.11.0" "transformers==5.17.0"
	$(COMPAT_VENV)/bin/python -m pip install --quiet -e ".[dev]"
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP) test-deps
	$(COMPAT_VENV)/bin/python -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"
	$(COMPAT_VENV)/bin/python -m pytest -q -n 2 --dist loadgroup -m "not isolated"
	$(COMPAT_VENV)/bin/python -m pytest -q -m isolated

# ruff (pinned in pyproject.toml's dev extra; its settings are there too): the format and the lint rules.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(VENV)/bin/saguaro bench

clean:
	rm -rf $(VENV) $(COMPAT_VENV) .pytest_cache
