# On a fresh machine, two commands:
#   make demo   installs flce and runs the main job (tools/demo.py): flce vs materialised PyTorch
#   make test   installs flce and runs the test suite
# Both install into the Python that PYTHON names (default python3): first the pinned torch (an
# unpinned one may pull a multi-GB build that does not match), then flce with its test extras.

PYTHON ?= python3
TORCH_VERSION := 2.13.0
# One stamp per Python environment, so switching PYTHON reinstalls; pyproject changes too.
ENV_ID := $(shell $(PYTHON) -c "import hashlib, sys; print(hashlib.md5(sys.prefix.encode()).hexdigest()[:8])")
STAMP := build/.installed-$(ENV_ID)
PYTEST_ARGS ?=

.PHONY: install demo test lint info bench-cpu

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m pip install "torch==$(TORCH_VERSION)"
	$(PYTHON) -m pip install -e ".[test]"
	@mkdir -p $(dir $@) && touch $@

demo: install
	$(PYTHON) tools/demo.py

# pytest exits 5 when it collected no tests: that is a failure here, not a pass.
test: install
	@$(PYTHON) -m pytest -rfEs $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

lint: install
	$(PYTHON) -m ruff check .

info: install
	$(PYTHON) -m flce info

bench-cpu: install
	$(PYTHON) tools/bench_cpu.py --markdown
