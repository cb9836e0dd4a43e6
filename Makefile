# Two commands work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin

# Flags for the demo run; override e.g. `make demo DEMO_ARGS="--workers 4"`.
DEMO_ARGS ?=
# Extra pytest flags, e.g. `make test PYTEST_ARGS="-k round_table -x"`.
PYTEST_ARGS ?=

.PHONY: demo test lint typecheck linked-tree docs pytest test-verl test-areal proto install install-dev bench clean

# setuptools prints an "Editable installation" notice on every editable
# install (a reminder that the source tree is imported in place, which is the
# point here); silence that one notice and nothing else.
PIP_INSTALL := PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Stamps re-run the install whenever pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP_INSTALL) -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(PY)
	$(PIP_INSTALL) -e '.[dev,trl,docs]'
	touch $(VENV)/.installed $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed
	$(BIN)/lossreduce train $(DEMO_ARGS)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy and griffe (the API reference) cannot follow setuptools' package-dir
# mapping: link the folders into one `lossreduce` tree (build/typecheck,
# ignored by git) and check or document that.
TYPECHECK_TREE := build/typecheck/lossreduce
linked-tree:
	rm -rf build/typecheck && mkdir -p $(TYPECHECK_TREE)
	for f in proto/lossreduce/*; do ln -s "$$PWD/$$f" $(TYPECHECK_TREE)/; done
	for d in server client trainer_worker; do ln -s "$$PWD/$$d" $(TYPECHECK_TREE)/$$d; done

typecheck: $(VENV)/.installed-dev linked-tree
	$(BIN)/mypy

# The documentation site (mkdocs.yml); --strict fails on a broken link or
# anchor, a missing page or a reference to a renamed symbol. The variable
# silences the banner in which Material advertises its successor, nothing else.
docs: $(VENV)/.installed-dev linked-tree
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

pytest: $(VENV)/.installed-dev
	$(BIN)/pytest --ignore=tests/trainer_worker/integrations/verl \
		--ignore=tests/trainer_worker/train/engines/verl \
		--ignore=tests/trainer_worker/integrations/areal \
		--ignore=tests/trainer_worker/train/engines/areal $(PYTEST_ARGS)

# verl 0.9.1 pins transformers<5.11 (the trl extra needs >=5.24): its tests (the
# integration's and `lossreduce train --engine verl`'s) run in an environment of
# their own, built with exactly the install docs/frameworks/verl.md gives a user
# (read from the page by documented_install.py; lossreduce editable), plus pytest.
# verl's wheel also installs its own test suite as a top-level `tests` package,
# which would shadow ours, so that folder is removed.
VERL_VENV    := .venv-verl
VERL_PY      := $(VERL_VENV)/bin/python
VERL_INSTALL := tests/trainer_worker/integrations/verl/documented_install.py
$(VERL_VENV)/.installed: pyproject.toml docs/frameworks/verl.md $(VERL_INSTALL)
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install --quiet --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" $(PYTHON) $(VERL_INSTALL) --python $(VERL_PY) --editable
	$(VERL_PY) -m pip install --quiet "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
	rm -rf "$$($(VERL_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tests"
	touch $@

test-verl: $(VERL_VENV)/.installed
	$(VERL_VENV)/bin/pytest tests/trainer_worker/integrations/verl \
		tests/trainer_worker/train/engines/verl $(PYTEST_ARGS)

# AReaL 1.0.4 pins torch<2.11, so its tests (tests/trainer_worker/integrations/areal,
# and tests/trainer_worker/train/engines/areal: lossreduce train --engine areal)
# run in an environment of their own, built by the install commands of
# docs/frameworks/areal.md, read from the page (documented_install.py: this
# checkout for lossreduce[areal], editable, its dependencies pinned by the
# constraints file), then the test tools.
AREAL_VENV ?= .venv-areal
AREAL_PY := $(AREAL_VENV)/bin/python
AREAL_CONSTRAINTS := tests/trainer_worker/integrations/areal/constraints.txt
AREAL_INSTALL := tests/trainer_worker/integrations/areal/documented_install.py
$(AREAL_VENV)/.installed: pyproject.toml $(AREAL_CONSTRAINTS) $(AREAL_INSTALL)
	rm -rf $(AREAL_VENV)
	$(PYTHON) -m venv $(AREAL_VENV)
	$(AREAL_PY) -m pip install --quiet --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" $(AREAL_PY) $(AREAL_INSTALL) \
		--python $(AREAL_PY) --constraints $(AREAL_CONSTRAINTS) --editable
	$(AREAL_PY) -m pip install --quiet -c $(AREAL_CONSTRAINTS) pytest pytest-timeout hypothesis
	touch $@

test-areal: $(AREAL_VENV)/.installed
	$(AREAL_VENV)/bin/pytest tests/trainer_worker/integrations/areal \
		tests/trainer_worker/train/engines/areal $(PYTEST_ARGS)

# Frameworks whose pins conflict with ours run in environments of their own. The two
# are independent (own venvs, own Ray sessions, loopback ports picked free), so they
# run side by side, each target's output kept together: it keeps `make test` well
# inside CI's time on 2 cores.
test: lint docs typecheck pytest
	$(MAKE) --no-print-directory -j2 --output-sync=target test-verl test-areal

# Regenerate the gRPC binding from proto/lossreduce/v2/coordinator.proto.
proto: $(VENV)/.installed-dev
	$(PY) proto/generate.py

bench: $(VENV)/.installed
	$(BIN)/lossreduce bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VERL_VENV) $(AREAL_VENV) build *.egg-info .mypy_cache .ruff_cache .hypothesis
