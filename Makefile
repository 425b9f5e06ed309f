# The README's two commands: `make demo` runs a local network end to end, `make test` runs the tests.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# Where this machine keeps its local wheels, torch's CPU build among them: pip's find-links, which uv does not read.
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell python3 -m pip config get global.find-links 2>/dev/null))

.PHONY: demo test check bench clean test-tools

# Test runs keep bytecode in __pycache__ (git ignores it) even where PYTHONDONTWRITEBYTECODE is set: a worker's
# collection is then about a third shorter from the second run on.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml constraints.txt
	@# py-libp2p builds fastecdsa from source, which needs the GMP headers.
	@if ! dpkg -s libgmp-dev >/dev/null 2>&1 && command -v apt-get >/dev/null; then \
		apt-get update -q && apt-get install -y -q libgmp-dev gcc; fi
	@test -x $(PY) || python3 -m venv $(VENV)
	@# uv installs everything, torch's CPU wheel from the folder pip's configuration names (FIND_LINKS), several
	@# times faster than pip; it compiles the packages' bytecode once, so neither the test workers nor an operator's
	@# commands (where PYTHONDONTWRITEBYTECODE is set) compile transformers and the rest at every start.
	$(PY) -m pip install -q uv
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) $(foreach d,$(FIND_LINKS),--find-links $(d)) \
		-c constraints.txt -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tessera simulate --validators 2 --miners 4 --rounds 3 --dir .demo --force

# The browser test drives Debian's chromium; the compose test runs `docker-compose config`; the clock test
# runs a node under faketime; the alert test runs promtool.
test-tools:
	@if ! { command -v chromium && command -v docker-compose && command -v faketime; } >/dev/null \
			&& command -v apt-get >/dev/null; then \
		apt-get update -q && apt-get install -y -q chromium docker-compose faketime; fi
	@# promtool alone (tests/deploy/test_alerts.py runs the alert rules' unit tests), out of Debian's package
	@if ! command -v promtool >/dev/null && ! [ -x $(VENV)/bin/promtool ] && command -v apt-get >/dev/null; then \
		tmp=$$(mktemp -d) && (cd $$tmp && { apt-get download -q prometheus || { apt-get update -q && apt-get download -q prometheus; }; }) \
		&& dpkg-deb -x $$tmp/prometheus_*.deb $$tmp/x && cp $$tmp/x/usr/bin/promtool $(VENV)/bin/ && rm -rf $$tmp; fi

# Six pytest workers on two cores, a test file to one worker, in the order tests/scheduling.py gives them: the
# real networks spend much of their time waiting for round phases, which the other workers fill (with four, the
# first wave's networks left most of a core idle for minutes; six leave half of one idle for a minute). One torch
# thread a worker (OMP_NUM_THREADS=1, inherited by the processes tests start): OpenMP threads beside node processes
# spin instead of working. mypy (most of a minute of one core reading torch's types) runs beside the tests at a
# lower priority, on what they leave idle, and prints its report after theirs.
test: $(STAMP) test-tools
	$(VENV)/bin/ruff check .
	@types=$$(mktemp); nice -n 10 $(VENV)/bin/mypy >$$types 2>&1 & mypy=$$!; \
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 6 --dist loadfile --no-loadscope-reorder; tests=$$?; \
	wait $$mypy; typed=$$?; cat $$types; rm -f $$types; [ $$tests -eq 0 ] && [ $$typed -eq 0 ]

# The quick loop: lint, types, unit and in-memory twin tests, on two workers; no test that starts a node, a browser
# or an interpreter that imports torch, or runs a benchmark or a memory probe, and a check repeated over model
# families or settings on one of them (markers `integration` and `slow`: `make test` runs those).
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile -m "not integration and not slow"

bench: $(STAMP)
	mkdir -p .bench
	$(PY) bench/miner.py --out .bench/miner.json
	$(PY) bench/validator.py --out .bench/validator.json
	$(PY) bench/transfer.py --out .bench/transfer.json
	$(PY) bench/round.py --out .bench/round.json
	$(PY) bench/selection.py --out .bench/selection.json
	$(PY) bench/twins_load.py --out .bench/twins_load.json
	$(PY) bench/load.py --out .bench/load.json
	$(PY) bench/learning.py --out .bench/learning.json
	$(PY) bench/simulation.py --out .bench/simulation.json
	$(PY) bench/simulation.py --miners 8 --adversaries noise,copier,lazy,garbage --out .bench/simulation-adversarial.json
	$(PY) bench/soak.py --out .bench/soak.json
	$(PY) bench/successor.py --out .bench/successor.json
	$(PY) bench/gpu.py --out .bench/gpu.json
	$(PY) bench/real_size.py --work .bench/real-size --out .bench/real-size.json  # writes a 13.8 GB checkpoint there

clean:
	rm -rf $(VENV) .demo .bench
