"""factory-boy factories for the ledger's models."""

from __future__ import annotations

import factory

from events_ledger.db import ledger_db
from events_ledger.models import EventRun, EventRunLog, EventRunResource, EventRunStep


class RunFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = EventRun
        # factory-boy names an alias itself (default's): the ledger's own, in its run.
        database = ledger_db()

    name = factory.Sequence(lambda n: f"run-{n}")
    scope = "test"
    status = EventRun.Status.RUNNING


class StepFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = EventRunStep
        # factory-boy names an alias itself (default's): the ledger's own, in its run.
        database = ledger_db()

    run = factory.SubFactory(RunFactory)
    phase = "main"
    seq = factory.Sequence(lambda n: n)
    action_id = "test.make"
    params = factory.LazyFunction(dict)


class ResourceFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = EventRunResource
        # factory-boy names an alias itself (default's): the ledger's own, in its run.
        database = ledger_db()

    run = factory.SubFactory(RunFactory)
    step = None
    owner_module = "test"
    kind = "thing"
    ref = factory.Sequence(lambda n: f"ref-{n}")
    status = EventRunResource.Status.CONFIRMED


class LogFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = EventRunLog
        # factory-boy names an alias itself (default's): the ledger's own, in its run.
        database = ledger_db()

    run = factory.SubFactory(RunFactory)
    kind = "test.entry"
    detail = factory.LazyFunction(dict)
