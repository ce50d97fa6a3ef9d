# The database refuses a run status, or a cleanup status, that is none: a typo stranded a
# run where no sweep looks.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('events_ledger', '0007_resource_run_index_in_composite'),
    ]

    operations = [
        migrations.AddConstraint(
            model_name='eventrun',
            constraint=models.CheckConstraint(condition=models.Q(('status__in', ('pending', 'running', 'completed', 'cancelled', 'failed', 'missed'))), name='evrun_status_valid'),
        ),
        migrations.AddConstraint(
            model_name='eventrun',
            constraint=models.CheckConstraint(condition=models.Q(('cleanup_status__in', ('not_required', 'pending', 'complete', 'incomplete'))), name='evrun_cleanup_status_valid'),
        ),
    ]
