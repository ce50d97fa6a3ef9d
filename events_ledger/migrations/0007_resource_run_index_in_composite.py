import django.db.models.deletion
from django.db import migrations, models

#: The name Django gave the run's own index (0001): a prefix of evres_run_status_rank_idx.
RUN_INDEX = "events_ledger_eventrunresource_run_id_5179a3fb"
TABLE = "events_ledger_eventrunresource"


def drop_run_index(apps, schema_editor):
    # Only the index goes. An AlterField would drop and add the foreign key again,
    # which checks every row of the ledger (on MariaDB by copying the table) to change
    # nothing; MariaDB has no such index (its key uses the composite one).
    if schema_editor.connection.vendor in ("postgresql", "sqlite"):
        quote = schema_editor.quote_name
        schema_editor.execute(f"DROP INDEX IF EXISTS {quote(RUN_INDEX)}")


def add_run_index(apps, schema_editor):
    if schema_editor.connection.vendor in ("postgresql", "sqlite"):
        quote = schema_editor.quote_name
        schema_editor.execute(
            f"CREATE INDEX IF NOT EXISTS {quote(RUN_INDEX)} ON {quote(TABLE)} ({quote('run_id')})"
        )


class Migration(migrations.Migration):
    dependencies = [("events_ledger", "0006_phase_order")]

    operations = [
        # #26: on PostgreSQL every claim and verdict (each changes an indexed column)
        # wrote a new entry in each of the row's indexes, this one included.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="eventrunresource",
                    name="run",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="resources",
                        to="events_ledger.eventrun",
                    ),
                )
            ],
            database_operations=[migrations.RunPython(drop_run_index, add_run_index)],
        ),
    ]
