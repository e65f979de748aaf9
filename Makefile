# On a fresh machine, two commands:
#   make demo   installs flce and runs the main job (tools/demo.py): flce vs materialised PyTorch
#   make test   installs flce and runs the test suite
# Both install into the Python that PYTHON names (default python3): first the pinned torch (an
# unpinned one may pull a multi-GB build that does not match), then flce with its test extras.
# `make test` also builds build/ascend-venv once (triton-ascend installs itself as `triton`, so it
# cannot share the test environment): tests/test_ascend_toolchain.py lowers the Ascend kernels there.

PYTHON ?= python3
TORCH_VERSION := 2.13.0
# One stamp per Python environment, so switching PYTHON reinstalls; pyproject changes too.
ENV_ID := $(shell $(PYTHON) -c "import hashlib, sys; print(hashlib.md5(sys.prefix.encode()).hexdigest()[:8])")
STAMP := build/.installed-$(ENV_ID)
PYTEST_ARGS ?=
# The triton-ascend toolchain check's environment (Python 3.9-3.11: triton-ascend's wheels).
ASCEND_PYTHON ?= python3
TRITON_ASCEND_VERSION := 3.2.0
ASCEND_VENV := build/ascend-venv
ASCEND_STAMP := $(ASCEND_VENV)/.installed-torch$(TORCH_VERSION)-triton-ascend$(TRITON_ASCEND_VERSION)

.PHONY: install ascend-venv demo test lint info bench-cpu

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m pip install "torch==$(TORCH_VERSION)"
	$(PYTHON) -m pip install -e ".[test]"
	@mkdir -p $(dir $@) && touch $@

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

# pytest exits 5 when it collected no tests: that is a failure here, not a pass.
test: install ascend-venv
	@$(PYTHON) -m pytest -rfEs $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

lint: install
	$(PYTHON) -m ruff check .

info: install
	$(PYTHON) -m flce info

bench-cpu: install
	$(PYTHON) tools/benchmarks/cpu.py --markdown
