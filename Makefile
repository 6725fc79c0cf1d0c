# shardio developer entry points. `make test` and `make demo` install what is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch goes in first, pinned, so the project's own range (torch>=2.1,<3) installs nothing more.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.stamp-install
DEV_STAMP := $(VENV)/.stamp-dev
BENCH_STAMP := $(VENV)/.stamp-bench
# The compiled read path: a change rebuilds it (pip install -e builds it in place).
NATIVE_SRC := $(wildcard shardio/storage/_fastread.c)
PYTEST_ARGS ?= -q

.PHONY: install install-dev test test-fast test-durations test-pfs lint typecheck wheel-smoke docs docs-serve check bench demo stage-nvme clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Users: shardio with PyTorch and Pillow (the `decode` extra), without DALI (about 1 GB):
# `pip install -e '.[dali]'` adds it.
$(STAMP): pyproject.toml $(NATIVE_SRC) | $(PY)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[torch,decode]"
	touch $@

# Developers and CI: everything the tests use, DALI and the lint/type tools included.
$(DEV_STAMP): pyproject.toml $(NATIVE_SRC) | $(PY)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[torch,decode,dali,dev]"
	touch $(STAMP) $@

install: $(STAMP)

install-dev: $(DEV_STAMP)

# The whole suite (GPU tests and benchmarks deselected), after the system packages it uses
# (as root: MooseFS, SLURM, Prometheus, strace, shellcheck, the en_US locale). Two pytest runs
# side by side: the tests on the real MooseFS bed, SLURM cluster and Prometheus server (they
# mostly wait on daemons and deadlines) beside all the others, each line prefixed by its run as
# it happens, a progress line every 20 s. The summary: each group (pfs, slurm, prometheus,
# dali, gpu), what ran and what was skipped and why, the wall time, the slowest 20 tests and
# the 12-minute budget (scripts/suite.py).
test: install-dev
	scripts/system_packages.sh
	$(PY) scripts/suite.py test $(PYTEST_ARGS)

# The tests recorded under 0.2 s in tests/durations.json (tests/suite_plugin.py), on every CPU
# (pytest-xdist): under a minute on 2 cores. A test the record has not seen is left out.
test-fast: install-dev
	$(PY) scripts/suite.py fast $(PYTEST_ARGS)

# The whole suite, then its measured times into tests/durations.json (the fast selection).
test-durations: test
	$(PY) scripts/suite.py record

# Only the tests on the MooseFS bed (root; scripts/pfs/moosefs.sh installs the packages).
# SHARDIO_PFS=required makes a bed that cannot start, or a skipped pfs test, a failure.
test-pfs: install-dev
	SHARDIO_PFS=$${SHARDIO_PFS:-required} $(PY) -m pytest -m pfs $(PYTEST_ARGS) tests/pfs

lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install-dev
	$(VENV)/bin/mypy

# The wheel and sdist built, the wheel installed in a fresh venv and tried (pack, verify, read).
wheel-smoke: install-dev
	scripts/wheel_smoke.sh $(PY)

# The docs site (mkdocs.yml, docs/) into site/; a broken link, a missing page, a name the API
# reference cannot find or a docstring it cannot read fails the build. (Not --quiet: that hides
# the warnings strict mode counts, and the build then passes.) Every code block of its pages runs in `make test`.
docs: install-dev
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The site on http://127.0.0.1:8000, rebuilt as pages change.
docs-serve: install-dev
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8000

check: lint typecheck test

# Peers for benchmarks only. mosaicml-streaming pulls a CUDA torchvision that cannot import
# beside the CPU torch: remove it (the benchmarks use streaming's writer/reader modules only).
$(BENCH_STAMP): $(DEV_STAMP)
	$(PY) -m pip install -q "$(TORCH_SPEC)" -e ".[bench]"
	-$(PY) -m pip uninstall -q -y torchvision
	touch $@

bench: $(BENCH_STAMP)
	$(PY) benchmarks/bench_pack.py
	$(PY) benchmarks/bench_read.py
	$(PY) benchmarks/bench_stage.py
	$(PY) benchmarks/bench_open.py
	$(PY) benchmarks/bench_faults.py
	$(PY) benchmarks/bench_decode.py
	$(PY) benchmarks/bench_hardening.py
	$(PY) benchmarks/bench_pfs.py

# Job prologue: stage this node's shards of $(SHARDIO_DATA) to node-local storage, verified.
# SHARDIO_STAGE_DIR defaults (in the CLI) to <base>/shardio-<uid>-<job>/<name>-<hash>, private
# (0700), with <base> = $SLURM_TMPDIR, $TMPDIR, then /mnt/nvme, <name> the dataset directory's
# name and <hash> 8 hex digits of the SHA-256 of its real path (one area per source):
# printf %s "$(realpath -m -- "$SHARDIO_DATA")" | sha256sum | cut -c1-8
SHARDIO_STAGE_ARGS ?=
stage-nvme: install
	@test -n "$(SHARDIO_DATA)" || { echo "make stage-nvme: set SHARDIO_DATA=/path/to/dataset" >&2; exit 2; }
	$(VENV)/bin/shardio stage "$(SHARDIO_DATA)" $(if $(SHARDIO_STAGE_DIR),"$(SHARDIO_STAGE_DIR)") --node auto $(SHARDIO_STAGE_ARGS)

demo: install
	$(PY) scripts/demo.py

clean:
	rm -rf .demo .bench build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
	find . -name __pycache__ -type d -prune -not -path './$(VENV)/*' -exec rm -rf {} +
