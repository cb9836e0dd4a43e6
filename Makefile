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

# PRUNE_VENVS=1 (as .ci/run sets it) removes each framework's and matrix cell's
# environment once its suite has run, passed or not: together they hold over 40 GB, more
# than a CI machine may have free, and CI never reuses them. `$(call pruned,DIR)` ends a
# test recipe's pytest line: the suite's exit status is kept.
PRUNE_VENVS ?=
pruned = $(if $(PRUNE_VENVS),; status=$$?; rm -rf $(1); exit $$status)
# A suite builds its environment in its own recipe, not as a prerequisite: under -j2 make
# would otherwise build every suite's environment before running the first suite (all of
# them on disk at once, and the suites started late).
venv_of = $(MAKE) --no-print-directory $(1)/.installed

.PHONY: demo test lint typecheck linked-tree docs pytest test-verl test-verl-megatron test-areal test-megatron test-skyrl test-matrix test-floor test-ceiling test-resolve proto install install-dev constraints bench clean

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
	$(BIN)/pytest --ignore=tests/install \
		--ignore=tests/trainer_worker/integrations/verl \
		--ignore=tests/trainer_worker/train/engines/verl \
		--ignore=tests/trainer_worker/integrations/areal \
		--ignore=tests/trainer_worker/train/engines/areal \
		--ignore=tests/trainer_worker/integrations/skyrl $(PYTEST_ARGS)

# verl 0.9.1 pins transformers<5.11 (TRL's users have 5.17, .venv too): its tests (the
# integration's and `lossreduce train --engine verl`'s) run in an environment of
# their own, a verl user's: verl's `vllm` extra without vllm (a GPU engine the CPU
# tests never import) at the versions pip's resolver picks for `verl[vllm]==0.9.1`
# (constraints/verl.txt: torch 2.11.0, the CUDA build from the index, which runs on
# CPU), then exactly the install docs/frameworks/verl.md gives a verl user (read from
# the page by documented_install.py; lossreduce editable) under the same pins, plus
# pytest. The environment must then hold exactly the pinned versions: the diff fails
# the build if anything moved. verl's wheel also installs its own test suite as a
# top-level `tests` package, which would shadow ours, so that folder is removed.
VERL_VENV        := .venv-verl
VERL_PY          := $(VERL_VENV)/bin/python
VERL_INSTALL     := tests/trainer_worker/integrations/verl/documented_install.py
VERL_CONSTRAINTS := constraints/verl.txt
$(VERL_VENV)/.installed: pyproject.toml docs/frameworks/verl.md $(VERL_INSTALL) tests/documented_install.py $(VERL_CONSTRAINTS)
	rm -rf $(VERL_VENV)
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install --quiet --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" $(PYTHON) -m $(call module_of,$(VERL_INSTALL)) \
		--python $(VERL_PY) --constraints $(VERL_CONSTRAINTS) --editable
	$(VERL_PY) -m pip install --quiet -c $(VERL_CONSTRAINTS) pytest pytest-timeout hypothesis
	rm -rf "$$($(VERL_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tests"
	$(VERL_PY) -m pip freeze --all --exclude-editable | grep -Ev '^(lossreduce|pip)==' > $(VERL_VENV)/freeze.txt
	grep -v '^#' $(VERL_CONSTRAINTS) | diff -u - $(VERL_VENV)/freeze.txt
	touch $@

# verl's `verl-core` extra brings pytest-asyncio, whose plugin warns at start (an error
# under our filterwarnings) when its loop scope is unset; no test here is async.
# The Megatron folder runs in its own environment (test-verl-megatron), not skipped here.
test-verl:
	$(call venv_of,$(VERL_VENV))
	$(VERL_VENV)/bin/pytest -p no:asyncio tests/trainer_worker/integrations/verl \
		tests/trainer_worker/train/engines/verl \
		--ignore=tests/trainer_worker/integrations/verl/megatron $(PYTEST_ARGS) $(call pruned,$(VERL_VENV))

# verl's Megatron engine (tests/trainer_worker/integrations/verl/megatron) runs in an
# environment of its own, a verl Megatron user's less its GPU parts, on Python 3.12 (the
# Megatron environment's): verl's `vllm` extra without vllm, as .venv-verl, plus its `mcore`
# extra (mbridge) and mbridge's `megatron` extra (Megatron-Core, einops), at the versions
# pip's resolver picks for `verl[vllm,mcore]==0.9.1 mbridge[megatron]`
# (constraints/verl-megatron.txt; `verl[megatron]==0.9.1` itself does not resolve: it pins
# megatron-bridge 0.5.2, which the index does not have), then the documented install of
# docs/frameworks/verl.md, then the test tools. What a GPU user has and this has not:
# vllm, Transformer Engine, Apex and flash-attn (CUDA builds), and so Megatron-Bridge, verl's
# default bridge, which imports Transformer Engine: the tests build the model through mbridge
# (`vanilla_mbridge=True`) with lossreduce's CPU platform for Megatron
# (cpu_standins/megatron), and context parallelism, which only Transformer Engine's attention
# implements, is not run (scripts/gpu_check.sh holds its check). On 2 cores its build takes
# about 4 minutes (torch's CUDA wheels) and its suite 6 to 8.
VERL_MEGATRON_VENV        := .venv-verl-megatron
VERL_MEGATRON_PY          := $(VERL_MEGATRON_VENV)/bin/python
VERL_MEGATRON_CONSTRAINTS := constraints/verl-megatron.txt
$(VERL_MEGATRON_VENV)/.installed: pyproject.toml docs/frameworks/verl.md $(VERL_INSTALL) tests/documented_install.py $(VERL_MEGATRON_CONSTRAINTS)
	rm -rf $(VERL_MEGATRON_VENV)
	$(MEGATRON_PYTHON) -m venv $(VERL_MEGATRON_VENV)
	$(MATRIX_PIP) $(VERL_MEGATRON_PY) -m pip install --quiet --upgrade pip
	$(MATRIX_PIP) $(PYTHON) -m $(call module_of,$(VERL_INSTALL)) --python $(VERL_MEGATRON_PY) \
		--constraints $(VERL_MEGATRON_CONSTRAINTS) --editable --megatron
	$(MATRIX_PIP) $(VERL_MEGATRON_PY) -m pip install --quiet -c $(VERL_MEGATRON_CONSTRAINTS) \
		pytest pytest-timeout hypothesis
	$(VERL_MEGATRON_PY) -m pip check
	rm -rf "$$($(VERL_MEGATRON_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tests"
	$(VERL_MEGATRON_PY) -m pip freeze --all --exclude-editable | grep -Ev '^(lossreduce|pip)==' > $(VERL_MEGATRON_VENV)/freeze.txt
	grep -v '^#' $(VERL_MEGATRON_CONSTRAINTS) | diff -u - $(VERL_MEGATRON_VENV)/freeze.txt
	touch $@

test-verl-megatron:
	$(call venv_of,$(VERL_MEGATRON_VENV))
	$(VERL_MEGATRON_VENV)/bin/pytest -p no:asyncio tests/trainer_worker/integrations/verl/megatron \
		$(PYTEST_ARGS) $(call pruned,$(VERL_MEGATRON_VENV))

# AReaL 1.0.4 pins torch<2.11, so its tests (tests/trainer_worker/integrations/areal,
# and tests/trainer_worker/train/engines/areal: lossreduce train --engine areal)
# run in an environment of their own, built by the install commands of
# docs/frameworks/areal.md, read from the page (documented_install.py: this
# checkout for lossreduce[areal], editable, its dependencies pinned by the
# constraints file), then the test tools.
AREAL_VENV ?= .venv-areal
AREAL_PY := $(AREAL_VENV)/bin/python
# AReaL's own resolution (torch 2.10.0 from the index, protobuf 6), then what
# lossreduce[areal] and the test tools add. `pip check` fails the build on a broken
# requirement, the diff if the environment holds anything but the pinned versions.
AREAL_CONSTRAINTS := constraints/areal.txt
AREAL_INSTALL := tests/trainer_worker/integrations/areal/documented_install.py
$(AREAL_VENV)/.installed: pyproject.toml docs/frameworks/areal.md $(AREAL_CONSTRAINTS) $(AREAL_INSTALL)
	rm -rf $(AREAL_VENV)
	$(PYTHON) -m venv $(AREAL_VENV)
	$(AREAL_PY) -m pip install --quiet --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" $(AREAL_PY) $(AREAL_INSTALL) \
		--python $(AREAL_PY) --constraints $(AREAL_CONSTRAINTS) --editable
	$(AREAL_PY) -m pip install --quiet -c $(AREAL_CONSTRAINTS) pytest pytest-timeout hypothesis
	$(AREAL_PY) -m pip check
	$(AREAL_PY) -m pip freeze --all --exclude-editable | grep -Ev '^(lossreduce|pip)==' > $(AREAL_VENV)/freeze.txt
	grep -v '^#' $(AREAL_CONSTRAINTS) | diff -u - $(AREAL_VENV)/freeze.txt
	touch $@

# The Megatron folder runs in its own environment (test-megatron), not skipped here.
test-areal:
	$(call venv_of,$(AREAL_VENV))
	$(AREAL_VENV)/bin/pytest tests/trainer_worker/integrations/areal \
		tests/trainer_worker/train/engines/areal \
		--ignore=tests/trainer_worker/integrations/areal/megatron $(PYTEST_ARGS) $(call pruned,$(AREAL_VENV))

# AReaL's Megatron engine (tests/trainer_worker/integrations/areal/megatron) runs in an
# environment of its own: Python 3.12 (megatron-core's), AReaL 1.0.4 with megatron-core
# 0.17.0 and mbridge 0.15.1, and megatron-bridge 0.4.0 without its dependencies: AReaL's
# `[megatron]` extra does not resolve (areal pins hydra-core 1.4.0.dev1, megatron-bridge
# needs <=1.3.2) and megatron-bridge's CUDA-only dependencies (transformer-engine, mamba-ssm)
# do not build on CPU; docs/frameworks/areal.md says what that changes. On 2 quiet
# cores its build takes about 3 minutes and its suite 2 to 4.
MEGATRON_VENV   := .venv-megatron
MEGATRON_PY     := $(MEGATRON_VENV)/bin/python
MEGATRON_PYTHON ?= $(firstword $(wildcard $(PYENV_ROOT)/versions/3.12*/bin/python3.12) python3.12)
$(MEGATRON_VENV)/.installed: pyproject.toml constraints/megatron.txt
	rm -rf $(MEGATRON_VENV)
	$(MEGATRON_PYTHON) -m venv $(MEGATRON_VENV)
	$(MATRIX_PIP) $(MEGATRON_PY) -m pip install --quiet --upgrade pip
	$(MATRIX_PIP) $(MEGATRON_PY) -m pip install --quiet -c constraints/megatron.txt areal==1.0.4 megatron-core==0.17.0 mbridge==0.15.1
	$(MATRIX_PIP) $(MEGATRON_PY) -m pip install --quiet --no-deps -c constraints/megatron.txt megatron-bridge==0.4.0
	$(MATRIX_PIP) $(MEGATRON_PY) -m pip install --quiet -c constraints/megatron.txt -e '.[areal]' pytest pytest-timeout hypothesis
	$(MEGATRON_PY) -m pip freeze --all --exclude-editable | grep -Ev '^(lossreduce|pip)==' > $(MEGATRON_VENV)/freeze.txt
	grep -v '^#' constraints/megatron.txt | diff -u - $(MEGATRON_VENV)/freeze.txt
	touch $@

test-megatron:
	$(call venv_of,$(MEGATRON_VENV))
	$(MEGATRON_VENV)/bin/pytest tests/trainer_worker/integrations/areal/megatron $(PYTEST_ARGS) \
		$(call pruned,$(MEGATRON_VENV))

# SkyRL 0.4 needs Python 3.12, so its tests (tests/trainer_worker/integrations/skyrl) run in
# an environment of its own, a SkyRL user's as closely as PyPI and a machine without CUDA
# allow: the versions pip's resolver picks for `skyrl[fsdp]==0.4.0` with torch 2.13.0
# installed first (constraints/skyrl.txt; torch is the CUDA build from the index, which
# runs on CPU), all of skyrl[fsdp] but flashinfer-jit-cache and flashinfer-cubin
# 0.6.18.post1 (on FlashInfer's index only, so `pip install 'skyrl[fsdp]==0.4.0'` does not
# resolve from PyPI), with flash-attn 2.8.3 and causal-conv1d built from their sdists
# without their CUDA kernels (nvcc), then exactly the install docs/frameworks/skyrl.md
# gives (read from the page by documented_install.py; lossreduce editable) under the same
# pins, plus pytest. docs/frameworks/skyrl.md says what that changes. `pip check` fails the
# build on a broken requirement, the diff if anything moved. 3 to 10 minutes on 2 shared
# cores, most of it downloading and unpacking torch's and vllm's CUDA wheels.
SKYRL_VENV        := .venv-skyrl
SKYRL_PY          := $(SKYRL_VENV)/bin/python
SKYRL_PYTHON      ?= $(firstword $(wildcard $(PYENV_ROOT)/versions/3.12*/bin/python3.12) python3.12)
SKYRL_INSTALL     := tests/trainer_worker/integrations/skyrl/documented_install.py
SKYRL_CONSTRAINTS := constraints/skyrl.txt
$(SKYRL_VENV)/.installed: pyproject.toml docs/frameworks/skyrl.md $(SKYRL_INSTALL) tests/documented_install.py $(SKYRL_CONSTRAINTS)
	rm -rf $(SKYRL_VENV)
	$(SKYRL_PYTHON) -m venv $(SKYRL_VENV)
	$(MATRIX_PIP) $(SKYRL_PY) -m pip install --quiet --upgrade pip
	$(MATRIX_PIP) $(SKYRL_PY) -m $(call module_of,$(SKYRL_INSTALL)) \
		--python $(SKYRL_PY) --constraints $(SKYRL_CONSTRAINTS) --editable
	$(MATRIX_PIP) $(SKYRL_PY) -m pip install --quiet -c $(SKYRL_CONSTRAINTS) pytest pytest-timeout hypothesis
	$(SKYRL_PY) -m pip check
	$(SKYRL_PY) -m pip freeze --all --exclude-editable | grep -Ev '^(lossreduce|pip)==' > $(SKYRL_VENV)/freeze.txt
	grep -v '^#' $(SKYRL_CONSTRAINTS) | diff -u - $(SKYRL_VENV)/freeze.txt
	touch $@

# The worker against stock SkyRL on 1 and 2 gloo ranks (2 to 6 minutes), SkyRL's own
# main_base launch on CPU: 3 steps, a SIGKILL after step 2 and the resume, the refusals
# (7 to 12 minutes on 2 shared cores), and the bench on a small workload.
test-skyrl:
	$(call venv_of,$(SKYRL_VENV))
	$(SKYRL_VENV)/bin/pytest tests/trainer_worker/integrations/skyrl $(PYTEST_ARGS) $(call pruned,$(SKYRL_VENV))

# The test matrix: the core suite (wire contract, coordinator, client, reduction
# library, the coordinator as a Ray actor) at the floor and at the ceiling of the
# ranges pyproject.toml declares: Python 3.10 with torch 2.10, protobuf 6.30 and
# grpcio 1.72.1, and Python 3.13 with torch 2.15 and protobuf 7. Exact versions are
# in constraints/floor.txt and constraints/ceiling.txt. torch comes from the index
# (the CUDA build; the CPU wheel on the machines' disk is for Python 3.11 only), so
# these installs run without the machine's pip config, which caps torch and reads
# that folder. docs/development.md says what each cell runs.
MATRIX_PIP   := env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null PYTHONWARNINGS="ignore:Editable installation"
PYENV_ROOT   ?= $(HOME)/.pyenv
FLOOR_PYTHON   ?= $(firstword $(wildcard $(PYENV_ROOT)/versions/3.10*/bin/python3.10) python3.10)
CEILING_PYTHON ?= $(firstword $(wildcard $(PYENV_ROOT)/versions/3.13*/bin/python3.13) python3.13)
CORE_TESTS := tests/test_errors.py tests/test_import_rules.py tests/test_packaging.py \
	tests/test_proto_binding.py tests/test_settings_cli.py tests/test_versions.py \
	tests/test_service_side.py tests/server tests/client \
	$(wildcard tests/trainer_worker/test_*.py) tests/trainer_worker/integrations/test_coordinator_actor.py
# Left out of the cells: the benchmarks (tests/bench, not among CORE_TESTS: they time,
# not test) and the soak and restart stress runs (the main run has them); the
# stale-binding check needs grpcio-tools 1.72.1, which installs only beside protobuf 6
# (the main run and the floor have it).
CORE_IGNORE := --ignore=tests/server/reliability

.venv-%/.installed: pyproject.toml constraints/%.txt
	rm -rf .venv-$*
	$(if $(filter floor,$*),$(FLOOR_PYTHON),$(CEILING_PYTHON)) -m venv .venv-$*
	$(MATRIX_PIP) .venv-$*/bin/python -m pip install --quiet --upgrade pip
	$(MATRIX_PIP) .venv-$*/bin/python -m pip install --quiet -c constraints/$*.txt \
		-e '.[trainer]' pytest pytest-timeout hypothesis numpy $(if $(filter floor,$*),grpcio-tools tomli)
	.venv-$*/bin/python -m pip check
	touch $@

test-floor:
	$(call venv_of,.venv-floor)
	.venv-floor/bin/pytest $(CORE_TESTS) $(CORE_IGNORE) $(PYTEST_ARGS) $(call pruned,.venv-floor)

test-ceiling:
	$(call venv_of,.venv-ceiling)
	.venv-ceiling/bin/pytest $(CORE_TESTS) $(CORE_IGNORE) \
		--deselect tests/test_proto_binding.py::test_committed_binding_matches_regenerated $(PYTEST_ARGS) \
		$(call pruned,.venv-ceiling)

test-matrix: test-floor test-ceiling

# pip's resolver alone: each framework stack resolves with lossreduce added exactly as
# without it (docs/install.md). Needs the package index; about 10 minutes, 2 at a time.
test-resolve: $(VENV)/.installed-dev
	LOSSREDUCE_RESOLUTION=1 $(BIN)/pytest tests/install $(PYTEST_ARGS)

# Frameworks whose pins conflict with ours run in environments of their own. They are
# independent of each other and of the matrix cells (own venvs, own Ray sessions,
# loopback ports picked free), so they run side by side, each target's output kept
# together, the longest (verl's) first and the main suite beside it: one queue of two
# slots keeps both cores busy to the end. The resolution checks wait on the package
# index more than on the CPU.
test: lint docs typecheck
	$(MAKE) --no-print-directory -j2 --output-sync=target test-verl pytest test-resolve test-skyrl \
		test-areal test-verl-megatron test-megatron test-matrix

# Regenerate the gRPC binding from proto/lossreduce/v2/coordinator.proto.
proto: $(VENV)/.installed-dev
	$(PY) proto/generate.py

bench: $(VENV)/.installed
	$(BIN)/lossreduce bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VERL_VENV) $(VERL_MEGATRON_VENV) $(AREAL_VENV) $(MEGATRON_VENV) $(SKYRL_VENV) .venv-floor .venv-ceiling build *.egg-info .mypy_cache .ruff_cache .hypothesis
