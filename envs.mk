# The test environments of the framework lanes and the matrix cells (included by the
# Makefile). Each lives outside the clone, in $(ENV_ROOT)/<name>.<key>, where <key>
# (tests/env_key.py) hashes everything its build reads: this file's recipes (not its
# comments), pyproject.toml's install tables, its constraints, the scripts the build runs,
# the framework page's install block and the interpreter's version. A clone whose inputs match finds its environments built (a
# second clone, CI after a session, a branch that touched no input); a change of any input
# builds that environment anew under its new key and removes the old one. `make
# clean-envs` removes them all. Each recipe ends by hard-linking identical files across
# the environments (their CUDA libraries are the same wheels), so disk holds one copy.

ENV_ROOT ?= $(HOME)/.cache/lossreduce/envs
env_key   = $(shell $(PYTHON) -m tests.env_key $(1) $(2))
env_dir   = $(ENV_ROOT)/$(1).$(call env_key,$(1),$(2))

MATRIX_PIP      := env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null PYTHONWARNINGS="ignore:Editable installation"
PYENV_ROOT      ?= $(HOME)/.pyenv
FLOOR_PYTHON    ?= $(firstword $(wildcard $(PYENV_ROOT)/versions/3.10*/bin/python3.10) python3.10)
CEILING_PYTHON  ?= $(firstword $(wildcard $(PYENV_ROOT)/versions/3.13*/bin/python3.13) python3.13)
MEGATRON_PYTHON ?= $(firstword $(wildcard $(PYENV_ROOT)/versions/3.12*/bin/python3.12) python3.12)
SKYRL_PYTHON    ?= $(MEGATRON_PYTHON)

VERL_VENV          := $(call env_dir,verl,$(PYTHON))
VERL_MEGATRON_VENV := $(call env_dir,verl-megatron,$(MEGATRON_PYTHON))
AREAL_VENV         := $(call env_dir,areal,$(PYTHON))
MEGATRON_VENV      := $(call env_dir,megatron,$(MEGATRON_PYTHON))
SKYRL_VENV         := $(call env_dir,skyrl,$(SKYRL_PYTHON))
FLOOR_VENV         := $(call env_dir,floor,$(FLOOR_PYTHON))
CEILING_VENV       := $(call env_dir,ceiling,$(CEILING_PYTHON))

# A recipe's first line: the environment's other keys (stale) and a half-built one of
# this key go; the new one starts from `python -m venv`. $(1): the name, $(2): the folder,
# $(3): the interpreter.
define fresh_env
	rm -rf $(ENV_ROOT)/$(1).* && mkdir -p $(ENV_ROOT)
	$(3) -m venv $(2)
	date +%s > $(2)/.started
	$(MATRIX_PIP) $(2)/bin/python -m pip install --quiet --upgrade pip
endef

# A recipe's last lines: the checkout the editable install points at, one copy of each
# identical large file across the environments, and the stamp.
define done_env
	echo "$(CURDIR)" > $(1)/.checkout
	if command -v hardlink >/dev/null; then hardlink --quiet --content --minimum-size 1M $(ENV_ROOT); fi
	touch $(1)/.installed
	@echo "envs.mk: $(notdir $(1)) built in $$(( $$(date +%s) - $$(cat $(1)/.started) )) s, $$(du -sh $(1) | cut -f1) of its own"
endef

# An environment built from another clone imports that clone's lossreduce (an editable
# install points at one folder): point it at this one before its suite runs.
repoint = { [ "$$(cat $(1)/.checkout)" = "$(CURDIR)" ] || { \
	$(MATRIX_PIP) $(1)/bin/python -m pip install --quiet --no-deps -e . && echo "$(CURDIR)" > $(1)/.checkout; }; }

# The last step of every framework environment: pip freeze must equal its constraints.
define frozen_as
	$(1)/bin/python -m pip freeze --all --exclude-editable | grep -Ev '^(lossreduce|pip)==' > $(1)/freeze.txt
	grep -v '^#' $(2) | diff -u - $(1)/freeze.txt
endef

# verl's wheel also installs its own test suite as a top-level `tests` package, which
# would shadow ours: that folder goes.
drop_tests_package = rm -rf "$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tests"

# verl 0.9.1 (docs: the Makefile's test-verl): verl's `vllm` extra without vllm at the
# versions pip's resolver picks for `verl[vllm]==0.9.1` (constraints/verl.txt: torch
# 2.11.0, the CUDA build from the index, which runs on CPU), then exactly the install
# docs/frameworks/verl.md gives a verl user (read from the page by documented_install.py;
# lossreduce editable) under the same pins, plus pytest. This build is the documented-install
# check: the freeze must hold exactly the pinned versions.
VERL_INSTALL     := tests/trainer_worker/integrations/verl/documented_install.py
VERL_CONSTRAINTS := constraints/verl.txt
$(VERL_VENV)/.installed:
	$(call fresh_env,verl,$(VERL_VENV),$(PYTHON))
	PYTHONWARNINGS="ignore:Editable installation" $(PYTHON) -m $(call module_of,$(VERL_INSTALL)) \
		--python $(VERL_VENV)/bin/python --constraints $(VERL_CONSTRAINTS) --editable
	$(VERL_VENV)/bin/python -m pip install --quiet -c $(VERL_CONSTRAINTS) pytest pytest-timeout hypothesis
	$(call drop_tests_package,$(VERL_VENV))
	$(call frozen_as,$(VERL_VENV),$(VERL_CONSTRAINTS))
	$(call done_env,$(VERL_VENV))

# verl's Megatron engine: a verl Megatron user's environment less its GPU parts, on Python
# 3.12: verl's `vllm` extra without vllm, its `mcore` extra (mbridge) and mbridge's
# `megatron` extra (Megatron-Core, einops), at the versions pip's resolver picks for
# `verl[vllm,mcore]==0.9.1 mbridge[megatron]` (constraints/verl-megatron.txt;
# `verl[megatron]==0.9.1` itself does not resolve: it pins megatron-bridge 0.5.2, which the
# index does not have), then the documented install, then the test tools. What a GPU user
# has and this has not: vllm, Transformer Engine, Apex and flash-attn (CUDA builds), and so
# Megatron-Bridge, verl's default bridge, which imports Transformer Engine: the tests build
# the model through mbridge (`vanilla_mbridge=True`) with lossreduce's CPU platform for
# Megatron (cpu_standins/megatron); context parallelism, which only Transformer Engine's
# attention implements, is not run (scripts/gpu_check.sh holds its check).
VERL_MEGATRON_CONSTRAINTS := constraints/verl-megatron.txt
$(VERL_MEGATRON_VENV)/.installed:
	$(call fresh_env,verl-megatron,$(VERL_MEGATRON_VENV),$(MEGATRON_PYTHON))
	$(MATRIX_PIP) $(PYTHON) -m $(call module_of,$(VERL_INSTALL)) --python $(VERL_MEGATRON_VENV)/bin/python \
		--constraints $(VERL_MEGATRON_CONSTRAINTS) --editable --megatron
	$(MATRIX_PIP) $(VERL_MEGATRON_VENV)/bin/python -m pip install --quiet -c $(VERL_MEGATRON_CONSTRAINTS) \
		pytest pytest-timeout hypothesis
	$(VERL_MEGATRON_VENV)/bin/python -m pip check
	$(call drop_tests_package,$(VERL_MEGATRON_VENV))
	$(call frozen_as,$(VERL_MEGATRON_VENV),$(VERL_MEGATRON_CONSTRAINTS))
	$(call done_env,$(VERL_MEGATRON_VENV))

# AReaL 1.0.4 pins torch<2.11: the install commands of docs/frameworks/areal.md, read from
# the page (documented_install.py: this checkout for lossreduce[areal], editable, its
# dependencies pinned by constraints/areal.txt: AReaL's own resolution, torch 2.10.0 from
# the index, protobuf 6), then the test tools. `pip check` fails the build on a broken
# requirement, the diff if the environment holds anything but the pinned versions.
AREAL_CONSTRAINTS := constraints/areal.txt
AREAL_INSTALL     := tests/trainer_worker/integrations/areal/documented_install.py
$(AREAL_VENV)/.installed:
	$(call fresh_env,areal,$(AREAL_VENV),$(PYTHON))
	PYTHONWARNINGS="ignore:Editable installation" $(AREAL_VENV)/bin/python $(AREAL_INSTALL) \
		--python $(AREAL_VENV)/bin/python --constraints $(AREAL_CONSTRAINTS) --editable
	$(AREAL_VENV)/bin/python -m pip install --quiet -c $(AREAL_CONSTRAINTS) pytest pytest-timeout hypothesis
	$(AREAL_VENV)/bin/python -m pip check
	$(call frozen_as,$(AREAL_VENV),$(AREAL_CONSTRAINTS))
	$(call done_env,$(AREAL_VENV))

# AReaL's Megatron engine: Python 3.12 (megatron-core's), AReaL 1.0.4 with megatron-core
# 0.17.0 and mbridge 0.15.1, and megatron-bridge 0.4.0 without its dependencies: AReaL's
# `[megatron]` extra does not resolve (areal pins hydra-core 1.4.0.dev1, megatron-bridge
# needs <=1.3.2) and megatron-bridge's CUDA-only dependencies (transformer-engine,
# mamba-ssm) do not build on CPU; docs/frameworks/areal.md says what that changes.
$(MEGATRON_VENV)/.installed:
	$(call fresh_env,megatron,$(MEGATRON_VENV),$(MEGATRON_PYTHON))
	$(MATRIX_PIP) $(MEGATRON_VENV)/bin/python -m pip install --quiet -c constraints/megatron.txt areal==1.0.4 megatron-core==0.17.0 mbridge==0.15.1
	$(MATRIX_PIP) $(MEGATRON_VENV)/bin/python -m pip install --quiet --no-deps -c constraints/megatron.txt megatron-bridge==0.4.0
	$(MATRIX_PIP) $(MEGATRON_VENV)/bin/python -m pip install --quiet -c constraints/megatron.txt -e '.[areal]' pytest pytest-timeout hypothesis
	$(call frozen_as,$(MEGATRON_VENV),constraints/megatron.txt)
	$(call done_env,$(MEGATRON_VENV))

# SkyRL 0.4 needs Python 3.12: a SkyRL user's environment as closely as PyPI and a machine
# without CUDA allow: the versions pip's resolver picks for `skyrl[fsdp]==0.4.0` with torch
# 2.13.0 installed first (constraints/skyrl.txt; torch is the CUDA build from the index,
# which runs on CPU), all of skyrl[fsdp] but flashinfer-jit-cache and flashinfer-cubin
# 0.6.18.post1 (on FlashInfer's index only, so `pip install 'skyrl[fsdp]==0.4.0'` does not
# resolve from PyPI), with flash-attn 2.8.3 and causal-conv1d built from their sdists
# without their CUDA kernels (nvcc), then exactly the install docs/frameworks/skyrl.md
# gives (read from the page by documented_install.py; lossreduce editable) under the same
# pins, plus pytest. docs/frameworks/skyrl.md says what that changes.
SKYRL_INSTALL     := tests/trainer_worker/integrations/skyrl/documented_install.py
SKYRL_CONSTRAINTS := constraints/skyrl.txt
$(SKYRL_VENV)/.installed:
	$(call fresh_env,skyrl,$(SKYRL_VENV),$(SKYRL_PYTHON))
	$(MATRIX_PIP) $(SKYRL_VENV)/bin/python -m $(call module_of,$(SKYRL_INSTALL)) \
		--python $(SKYRL_VENV)/bin/python --constraints $(SKYRL_CONSTRAINTS) --editable
	$(MATRIX_PIP) $(SKYRL_VENV)/bin/python -m pip install --quiet -c $(SKYRL_CONSTRAINTS) pytest pytest-timeout hypothesis
	$(SKYRL_VENV)/bin/python -m pip check
	$(call frozen_as,$(SKYRL_VENV),$(SKYRL_CONSTRAINTS))
	$(call done_env,$(SKYRL_VENV))

# The matrix cells: the core suite at the floor and at the ceiling of the ranges
# pyproject.toml declares (constraints/floor.txt, constraints/ceiling.txt). torch comes
# from the index (the CUDA build; the CPU wheel on the machines' disk is for Python 3.11
# only), so these installs run without the machine's pip config, which caps torch and
# reads that folder.
$(FLOOR_VENV)/.installed:
	$(call fresh_env,floor,$(FLOOR_VENV),$(FLOOR_PYTHON))
	$(MATRIX_PIP) $(FLOOR_VENV)/bin/python -m pip install --quiet -c constraints/floor.txt \
		-e '.[trainer]' pytest pytest-timeout hypothesis numpy grpcio-tools tomli
	$(FLOOR_VENV)/bin/python -m pip check
	$(call done_env,$(FLOOR_VENV))

$(CEILING_VENV)/.installed:
	$(call fresh_env,ceiling,$(CEILING_VENV),$(CEILING_PYTHON))
	$(MATRIX_PIP) $(CEILING_VENV)/bin/python -m pip install --quiet -c constraints/ceiling.txt \
		-e '.[trainer]' pytest pytest-timeout hypothesis numpy
	$(CEILING_VENV)/bin/python -m pip check
	$(call done_env,$(CEILING_VENV))

ALL_ENVS := $(VERL_VENV) $(VERL_MEGATRON_VENV) $(AREAL_VENV) $(MEGATRON_VENV) $(SKYRL_VENV) \
	$(FLOOR_VENV) $(CEILING_VENV)

.PHONY: envs clean-envs
# Every environment, one at a time (`make -j2 envs` builds two at once).
envs: $(addsuffix /.installed,$(ALL_ENVS))

clean-envs:
	rm -rf $(ENV_ROOT)
