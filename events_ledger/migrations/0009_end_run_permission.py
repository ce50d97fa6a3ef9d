# The permission to end a run that will not end by itself (manage.py end_run, the console).

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('events_ledger', '0008_run_status_checks'),
    ]

    operations = [
        migrations.AlterModelOptions(
            name='eventrun',
            options={'permissions': [('retry_cleanup', 'Can retry the cleanup of a run (resets revert attempts)'), ('reconcile_resources', "Can reconcile a module's resources with its world"), ('end_run', 'Can end a run that will not end by itself')], 'verbose_name': 'event run'},
        ),
    ]
