# On a fresh machine, two commands:
#   make demo   installs flce and runs the main job (tools/demo.py): flce vs materialised PyTorch
#   make test   installs flce and runs the test suite
#   (make test-compat runs part of it at both ends of the supported torch/Triton range)
# Both install into a virtual environment of this checkout, .venv (made with BASE_PYTHON when missing):
# first the pinned torch (an unpinned one may pull a multi-GB build that does not match), then flce
# with its test extras. PYTHON=... installs into another interpreter instead (e.g. an activated venv's
# `python`); VENV=... moves the project's environment.
# `make test ASCEND=1` also builds build/ascend-venv once (triton-ascend installs itself as `triton`,
# so it cannot share the test environment; 1.1 GB) for tests/test_ascend_toolchain.py, which lowers
# the Ascend kernels there; without it that test skips and says so. CI (.ci/run) always builds it.

BASE_PYTHON ?= python3
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
ASCEND ?= 0
TORCH_VERSION := 2.13.0
# The CPU build of torch pins no Triton: the main environment's is pinned here (the GPU image's release).
TRITON_VERSION := 3.6.0
PYTEST_ARGS ?=
# The triton-ascend toolchain check's environment (Python 3.9-3.11: triton-ascend's wheels).
ASCEND_PYTHON ?= python3
TRITON_ASCEND_VERSION := 3.2.0
ASCEND_VENV := build/ascend-venv
ASCEND_STAMP := $(ASCEND_VENV)/.installed-torch$(TORCH_VERSION)-triton-ascend$(TRITON_ASCEND_VERSION)

# The project environment is made only when PYTHON is its interpreter (the default).
PYTHON_PREREQ := $(filter $(VENV)/bin/python,$(PYTHON))
ASCEND_PREREQ := $(if $(filter 1,$(ASCEND)),ascend-venv)

.PHONY: install ascend-venv trainer-packages demo test test-compat lint info bench-cpu

$(VENV)/bin/python:
	$(BASE_PYTHON) -m venv $(VENV)

# One stamp per Python environment (its sys.prefix, read when the rule runs, so a venv made just
# before counts), so switching PYTHON reinstalls; a newer pyproject.toml does too.
install: $(PYTHON_PREREQ)
	@stamp=build/.installed-$$($(PYTHON) -c "import hashlib, sys; print(hashlib.md5(sys.prefix.encode()).hexdigest()[:8])"); \
	if [ -f "$$stamp" ] && [ "$$stamp" -nt pyproject.toml ]; then exit 0; fi; \
	set -e; \
	$(PYTHON) -m pip install "torch==$(TORCH_VERSION)" "triton==$(TRITON_VERSION)"; \
	$(PYTHON) -m pip install -e ".[test]"; \
	mkdir -p build && touch "$$stamp"

# pybind11: triton-ascend's driver builds its NPU launcher with it; pyyaml: flce's own dependency.
ascend-venv: $(ASCEND_STAMP)

$(ASCEND_STAMP):
	rm -rf $(ASCEND_VENV)
	$(ASCEND_PYTHON) -m venv $(ASCEND_VENV)
	$(ASCEND_VENV)/bin/python -m pip install "torch==$(TORCH_VERSION)"
	$(ASCEND_VENV)/bin/python -m pip install "triton-ascend==$(TRITON_ASCEND_VERSION)" pybind11 pyyaml
	touch $@

demo: install
	$(PYTHON) tools/demo.py

# The trainers and kernels whose own code flce's drop-ins are checked against (tests/test_trainer_dropins.py,
# test_distillation_trainers.py, test_distillation_liger.py): their code only (--no-deps: verl's dependencies
# pull ray, TRL's datasets and pandas; Liger's chunked losses need torch alone).
TRAINER_PACKAGES := verl==0.9.1 trl==1.16.0 liger-kernel==0.8.5

trainer-packages: install
	$(PYTHON) -m pip install -q --no-deps $(TRAINER_PACKAGES)

# pytest exits 5 when it collected no tests: that is a failure here, not a pass.
test: install trainer-packages $(ASCEND_PREREQ)
	@FLCE_REQUIRE_ASCEND_VENV=$(ASCEND) $(PYTHON) -m pytest -rfEs $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

# Both ends of the supported range (torch 2.9.1 + triton 3.5.1 on Python 3.10, torch 2.15.0 + triton 3.9.0
# on Python 3.13), each in its own environment under build/compat/ (built once from cached wheels, about
# 19 GB with both; reused afterwards): flce's wheel must install without changing that torch or Triton, then
# the reference contract, the interpreted Triton kernels and the sm_90a compile tests run there.
# COMPAT_PAIRS=oldest runs one end; COMPAT_DISCARD=1 (CI) keeps nothing (tools/compat/test_compat.sh).
COMPAT_PAIRS ?= oldest newest

test-compat: install
	PYTHON=$(PYTHON) tools/compat/test_compat.sh $(COMPAT_PAIRS)

lint: install
	$(PYTHON) -m ruff check .

info: install
	$(PYTHON) -m flce info

bench-cpu: install
	$(PYTHON) tools/benchmarks/cpu.py --markdown
