# specshim: two commands matter. `make demo` runs the main job on a tiny model
# the tool builds itself; `make test` runs every test tier. Both create .venv.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
UV     := $(VENV)/bin/uv
STAMP  := $(VENV)/.specshim-setup
PYTEST_ARGS ?=

.PHONY: setup test test-unit test-e2e demo doctor lint clean

setup: $(STAMP)

# Re-runs only when the pinned stack or the package metadata changes.
$(STAMP): pyproject.toml requirements/cpu-stack.txt requirements/overrides.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -x $(UV) || { $(PY) -m pip --version >/dev/null 2>&1 || $(PY) -m ensurepip; \
		$(PY) -m pip install -q uv; }
	$(UV) pip install --python $(PY) --index-strategy unsafe-best-match \
		-r requirements/cpu-stack.txt --override requirements/overrides.txt -e .
	$(PY) -c "import specshim, sys; assert 'torch' not in sys.modules and 'vllm' not in sys.modules"
	touch $@

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest tests/unit tests/contract $(PYTEST_ARGS)

test-e2e: setup
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/specshim demo

doctor: setup
	$(VENV)/bin/specshim doctor

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

clean:
	rm -rf $(VENV) .pytest_cache
