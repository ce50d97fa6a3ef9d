"""The example project's benchmark of events_ledger: ``manage.py ledger_bench``."""
