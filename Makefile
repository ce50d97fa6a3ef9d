# events-ledger: `make demo` tells the story on SQLite; `make test` runs everything.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt | sha1sum | cut -c1-12)
DEMO_DB := $(CURDIR)/project/demo.sqlite3

.PHONY: venv demo serve test bench clean

venv: $(STAMP)

$(STAMP): requirements.txt
	@scripts/sysdeps
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	@rm -f $(VENV)/.installed-* && touch $@

demo: venv
	@rm -f $(DEMO_DB)
	@DATABASE_URL=sqlite:///$(DEMO_DB) $(PY) manage.py migrate -v0
	@DATABASE_URL=sqlite:///$(DEMO_DB) $(PY) manage.py demo

serve: venv
	@test -f $(DEMO_DB) || $(MAKE) demo
	DATABASE_URL=sqlite:///$(DEMO_DB) $(PY) manage.py runserver 127.0.0.1:8000

test: venv
	scripts/test-all

bench: venv
	scripts/bench-all

clean:
	-scripts/rig/down
	rm -rf $(VENV) .rig $(DEMO_DB) .test-db.sqlite3 .test-run.sqlite3
