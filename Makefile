# Two commands work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
# Exact versions of the development environment (.venv): the package itself declares
# ranges (pyproject.toml); these pins keep `make test` reproducible. `make constraints`
# rewrites the file from what .venv holds.
CONSTRAINTS := constraints/dev.txt
VENV   ?= .venv
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin

# Flags for the demo run; override e.g. `make demo DEMO_ARGS="--workers 4"`.
DEMO_ARGS ?=
# Extra pytest flags, e.g. `make test PYTEST_ARGS="-k round_table -x"`.
PYTEST_ARGS ?=
# A process that dies of a fatal signal (a C extension's segfault or abort) prints
# every thread's Python stack, also after pytest has ended, when its own fault
# handler is off again: interpreter teardown is where such a crash has shown up.
export PYTHONFAULTHANDLER ?= 1

# PRUNE_VENVS=1 removes each framework's and matrix cell's environment once its suite has
# run, passed or not, for a machine short of disk (envs.mk keeps them, hard-linked, for the
# next run). `$(call pruned,DIR)` ends a test recipe's pytest line: the suite's exit status
# is kept.
PRUNE_VENVS ?=
pruned = $(if $(PRUNE_VENVS),; status=$$?; rm -rf $(1); exit $$status)
# A suite builds its environment in its own recipe, not as a prerequisite: under -j2 make
# would otherwise build every suite's environment before running the first suite (all of
# them on disk at once, and the suites started late).
venv_of = $(MAKE) --no-print-directory $(1)/.installed
# A test recipe's first line: the environment $(1) (envs.mk) built, pointed at this
# checkout, and linked into the clone as $(2) (.venv-verl, ...) for commands by hand.
use_env = $(call venv_of,$(1)) && $(call repoint,$(1)) && ln -sfn $(1) $(2)

.PHONY: demo test test-all static resolutions lint typecheck linked-tree docs pytest test-verl test-verl-megatron test-areal test-megatron test-skyrl test-matrix test-floor test-ceiling test-resolve proto install install-dev constraints bench clean

# setuptools prints an "Editable installation" notice on every editable
# install (a reminder that the source tree is imported in place, which is the
# point here); silence that one notice and nothing else.
PIP_INSTALL := PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet
# A script under tests/ as the module `python -m` runs (it imports tests.* helpers).
module_of = $(subst /,.,$(basename $(1)))

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Stamps re-run the install whenever pyproject.toml changes.
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) | $(PY)
	$(PIP_INSTALL) -c $(CONSTRAINTS) -e '.[trainer]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(CONSTRAINTS) | $(PY)
	$(PIP_INSTALL) -c $(CONSTRAINTS) -e '.[trainer,dev,trl,docs]'
	touch $(VENV)/.installed $@

# Rewrites constraints/dev.txt from .venv (after a deliberate upgrade there).
constraints: $(VENV)/.installed-dev
	{ grep '^#' $(CONSTRAINTS); $(PY) -m pip freeze --exclude-editable; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)

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
	for d in server client trainer_worker bench; do ln -s "$$PWD/$$d" $(TYPECHECK_TREE)/$$d; done

typecheck: $(VENV)/.installed-dev linked-tree
	$(BIN)/mypy

# The documentation site (mkdocs.yml); --strict fails on a broken link or
# anchor, a missing page or a reference to a renamed symbol. The variable
# silences the banner in which Material advertises its successor, nothing else.
docs: $(VENV)/.installed-dev linked-tree
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

pytest: $(VENV)/.installed-dev
	$(BIN)/pytest --ignore=tests/install/test_resolution.py \
		--ignore=tests/trainer_worker/integrations/verl \
		--ignore=tests/trainer_worker/train/engines/verl \
		--ignore=tests/trainer_worker/integrations/areal \
		--ignore=tests/trainer_worker/train/engines/areal \
		--ignore=tests/trainer_worker/integrations/skyrl $(PYTEST_ARGS)

include envs.mk

# verl 0.9.1 pins transformers<5.11 (TRL's users have 5.17, .venv too): its tests (the
# integration's and `lossreduce train --engine verl`'s) run in an environment of their own,
# a verl user's (envs.mk). verl's `verl-core` extra brings pytest-asyncio, whose plugin
# warns at start (an error under our filterwarnings) when its loop scope is unset; no test
# here is async. The Megatron folder runs in its own environment (test-verl-megatron).
test-verl:
	$(call use_env,$(VERL_VENV),.venv-verl)
	$(VERL_VENV)/bin/pytest -p no:asyncio tests/trainer_worker/integrations/verl \
		tests/trainer_worker/train/engines/verl \
		--ignore=tests/trainer_worker/integrations/verl/megatron $(PYTEST_ARGS) $(call pruned,$(VERL_VENV))

# verl's Megatron engine (tests/trainer_worker/integrations/verl/megatron), on Python 3.12.
test-verl-megatron:
	$(call use_env,$(VERL_MEGATRON_VENV),.venv-verl-megatron)
	$(VERL_MEGATRON_VENV)/bin/pytest -p no:asyncio tests/trainer_worker/integrations/verl/megatron \
		$(PYTEST_ARGS) $(call pruned,$(VERL_MEGATRON_VENV))

# AReaL 1.0.4 pins torch<2.11: its tests (tests/trainer_worker/integrations/areal, and
# tests/trainer_worker/train/engines/areal: lossreduce train --engine areal) run in the
# environment docs/frameworks/areal.md builds (envs.mk). The Megatron folder runs in its own
# environment (test-megatron).
test-areal:
	$(call use_env,$(AREAL_VENV),.venv-areal)
	$(AREAL_VENV)/bin/pytest tests/trainer_worker/integrations/areal \
		tests/trainer_worker/train/engines/areal \
		--ignore=tests/trainer_worker/integrations/areal/megatron $(PYTEST_ARGS) $(call pruned,$(AREAL_VENV))

# AReaL's Megatron engine (tests/trainer_worker/integrations/areal/megatron), on Python 3.12.
test-megatron:
	$(call use_env,$(MEGATRON_VENV),.venv-megatron)
	$(MEGATRON_VENV)/bin/pytest tests/trainer_worker/integrations/areal/megatron $(PYTEST_ARGS) \
		$(call pruned,$(MEGATRON_VENV))

# SkyRL 0.4 on Python 3.12 (envs.mk): the worker against stock SkyRL on 1 and 2 gloo ranks,
# SkyRL's own main_base launch on CPU (3 steps, a SIGKILL after step 2 and the resume, the
# refusals), and the bench on a small workload.
test-skyrl:
	$(call use_env,$(SKYRL_VENV),.venv-skyrl)
	$(SKYRL_VENV)/bin/pytest tests/trainer_worker/integrations/skyrl $(PYTEST_ARGS) $(call pruned,$(SKYRL_VENV))

# The test matrix: the core suite (wire contract, coordinator, client, reduction library,
# the coordinator as a Ray actor) at the floor and at the ceiling of the ranges
# pyproject.toml declares: Python 3.10 with torch 2.10, protobuf 6.30 and grpcio 1.72.1,
# and Python 3.13 with torch 2.15 and protobuf 7 (envs.mk). docs/development.md says what
# each cell runs.
CORE_TESTS := tests/test_errors.py tests/test_import_rules.py tests/test_packaging.py \
	tests/test_proto_binding.py tests/test_settings_cli.py tests/test_versions.py \
	tests/test_service_side.py tests/server tests/client \
	$(wildcard tests/trainer_worker/test_*.py) tests/trainer_worker/integrations/test_coordinator_actor.py
# Left out of the cells: the benchmarks (tests/bench, not among CORE_TESTS: they time,
# not test) and the soak and restart stress runs (the main run has them); the
# stale-binding check needs grpcio-tools 1.72.1, which installs only beside protobuf 6
# (the main run and the floor have it).
CORE_IGNORE := --ignore=tests/server/reliability

test-floor:
	$(call use_env,$(FLOOR_VENV),.venv-floor)
	$(FLOOR_VENV)/bin/pytest $(CORE_TESTS) $(CORE_IGNORE) $(PYTEST_ARGS) $(call pruned,$(FLOOR_VENV))

test-ceiling:
	$(call use_env,$(CEILING_VENV),.venv-ceiling)
	$(CEILING_VENV)/bin/pytest $(CORE_TESTS) $(CORE_IGNORE) \
		--deselect tests/test_proto_binding.py::test_committed_binding_matches_regenerated $(PYTEST_ARGS) \
		$(call pruned,$(CEILING_VENV))

test-matrix: test-floor test-ceiling

# pip's resolver alone: each framework stack resolves with lossreduce added exactly as
# without it (docs/install.md). The main suite checks the committed record of those
# resolutions (tests/install/resolutions.json: seconds, no network), which must have been
# resolved from today's inputs (pyproject.toml's install tables, constraints/, the stacks).
# After changing one, `make resolutions` re-resolves against the package index (5 to 13
# minutes) and rewrites the record to commit; `make test-resolve` runs the live checks
# without writing (new releases on the index, which no hash sees).
resolutions: $(VENV)/.installed-dev
	$(PY) -m tests.install.resolution_report

test-resolve: $(VENV)/.installed-dev
	LOSSREDUCE_RESOLUTION=1 $(BIN)/pytest tests/install/test_resolution.py $(PYTEST_ARGS)

# ruff, the strict docs build and mypy, one after another (docs and mypy share the linked
# tree, which each rebuilds).
static:
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory docs
	$(MAKE) --no-print-directory typecheck

# Frameworks whose pins conflict with ours run in environments of their own. They are
# independent of each other and of the matrix cells (own venvs, own Ray sessions,
# loopback ports picked free), so they run side by side, each target's output kept
# together: one queue of two slots keeps both cores busy to the end. The static checks
# (one core, 2 to 3 minutes) run first beside verl's lane, the longest, whose environment
# builds meanwhile; the main suite follows them. A failed job fails `make test`, and the
# queue goes on (-k) so that one run reports every lane. .venv is built before the queue:
# left to the queue, the main suite waited on it while the static checks built it, and make
# then ran the suite last, alone, after every other lane.
test: $(VENV)/.installed-dev
	$(MAKE) --no-print-directory -j2 -k --output-sync=target static test-verl pytest test-skyrl \
		test-areal test-verl-megatron test-megatron test-matrix

# Everything `make test` runs, the checks marked `extended` (each repeats, for the same
# framework, what another check of `make test` shows) and the live resolutions
# (docs/development.md, What `make test-all` adds). Run it before calling a change to an
# integration done.
test-all:
	LOSSREDUCE_EXTENDED=1 $(MAKE) --no-print-directory test
	$(MAKE) --no-print-directory test-resolve

# Regenerate the gRPC binding from proto/lossreduce/v2/coordinator.proto.
proto: $(VENV)/.installed-dev
	$(PY) proto/generate.py

bench: $(VENV)/.installed
	$(BIN)/lossreduce bench $(BENCH_ARGS)

# The framework environments live outside the clone: `make clean-envs` removes them.
clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .hypothesis
