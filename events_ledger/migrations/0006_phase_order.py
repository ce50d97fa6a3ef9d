from django.db import migrations, models


def rank_existing_phases(apps, schema_editor):
    """C8: the steps of runs planned before phases had a rank ran by their phase's name
    compared as text; each keeps that meaning, its phase's place among its run's phases
    in text order. Only runs of more than one phase are touched (the rest rank 0)."""
    step = apps.get_model("events_ledger", "EventRunStep")
    db = schema_editor.connection.alias
    phases: dict[int, list[str]] = {}
    # In the database's own order (its collation), as the driver compared them.
    pairs = step.objects.using(db).order_by("run_id", "phase").values_list("run_id", "phase")
    for run_id, phase in pairs.distinct().iterator():
        phases.setdefault(run_id, []).append(phase)
    for run_id, names in phases.items():
        for rank, phase in enumerate(names):
            if rank:
                step.objects.using(db).filter(run_id=run_id, phase=phase).update(phase_rank=rank)


class Migration(migrations.Migration):
    dependencies = [("events_ledger", "0005_cleanup_status_label")]

    operations = [
        migrations.AlterModelOptions(
            name="eventrunstep",
            options={
                "ordering": ["run_id", "phase_rank", "phase", "seq", "id"],
                "verbose_name": "event run step",
            },
        ),
        # NULL: the rows recorded before #26 stand alone, given back in no order, as
        # they always were.
        migrations.AddField(
            model_name="eventrunresource",
            name="phase_rank",
            field=models.PositiveIntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="eventrunstep",
            name="phase_rank",
            field=models.PositiveIntegerField(db_default=0),
        ),
        # C8: the claim's question, "does this run hold an unresolved row of a phase
        # later than k?", a range of one index per status; (run, status), its prefix,
        # is replaced by it.
        migrations.AddIndex(
            model_name="eventrunresource",
            index=models.Index(
                fields=["run", "status", "phase_rank"], name="evres_run_status_rank_idx"
            ),
        ),
        migrations.RemoveIndex(model_name="eventrunresource", name="evres_run_status_idx"),
        migrations.RunPython(rank_existing_phases, migrations.RunPython.noop, elidable=True),
    ]
