# events-ledger: `make demo` tells the story on SQLite; `make test` runs everything.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Python 3.12 for the Django 6 line: pyenv's (not on PATH when 3.11 is the global one), or the system's.
PYTHON312 ?= $(or $(lastword $(sort $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12))),$(shell command -v python3.12 2>/dev/null),python3.12)
VENV6 := .venv-django6
STAMP := $(VENV)/.installed-$(shell cat requirements.txt | sha1sum | cut -c1-12)
STAMP6 := $(VENV6)/.installed-$(shell cat requirements-django6.txt | sha1sum | cut -c1-12)
DEMO_DB := $(CURDIR)/project/demo.sqlite3

.PHONY: venv venv6 demo serve test bench chaos clean

venv: $(STAMP)

$(STAMP): requirements.txt
	@scripts/sysdeps
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	@rm -f $(VENV)/.installed-* && touch $@

# The newest Django line needs Python 3.12 (the machine's pyenv has it).
venv6: $(STAMP6)

$(STAMP6): requirements-django6.txt
	@scripts/sysdeps
	@test -x $(VENV6)/bin/python || $(PYTHON312) -m venv $(VENV6)
	$(VENV6)/bin/python -m pip install -q --disable-pip-version-check -r requirements-django6.txt
	@rm -f $(VENV6)/.installed-* && touch $@

demo: venv
	@rm -f $(DEMO_DB)
	@DATABASE_URL=sqlite:///$(DEMO_DB) $(PY) manage.py migrate -v0
	@DATABASE_URL=sqlite:///$(DEMO_DB) $(PY) manage.py demo

serve: venv
	@test -f $(DEMO_DB) || $(MAKE) demo
	DEBUG=true DATABASE_URL=sqlite:///$(DEMO_DB) $(PY) manage.py runserver 127.0.0.1:8000

test: venv venv6
	scripts/test-all

# The benchmark on servers of its own, durable as production ones (see scripts/bench-all).
bench: venv
	scripts/bench-all

# Every fault-injection scenario at full size on the three databases (long; not in CI).
chaos: venv
	scripts/chaos

clean:
	-scripts/rig/down
	-RIG_DIR=.rig-bench scripts/rig/down
	rm -rf $(VENV) $(VENV6) .rig $(DEMO_DB) .test-db.sqlite3 .test-run.sqlite3 .chaos*.sqlite3 .bench-results .bench.sqlite3*
