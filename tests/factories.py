"""factory-boy factories for the ledger's models."""

from __future__ import annotations

import factory

from events_ledger.models import EventRun, EventRunLog, EventRunResource, EventRunStep


class RunFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = EventRun

    name = factory.Sequence(lambda n: f"run-{n}")
    scope = "test"
    status = EventRun.Status.RUNNING


class StepFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = EventRunStep

    run = factory.SubFactory(RunFactory)
    phase = "main"
    seq = factory.Sequence(lambda n: n)
    action_id = "test.make"
    params = factory.LazyFunction(dict)


class ResourceFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = EventRunResource

    run = factory.SubFactory(RunFactory)
    step = None
    owner_module = "test"
    kind = "thing"
    ref = factory.Sequence(lambda n: f"ref-{n}")
    status = EventRunResource.Status.CONFIRMED


class LogFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = EventRunLog

    run = factory.SubFactory(RunFactory)
    kind = "test.entry"
    detail = factory.LazyFunction(dict)
