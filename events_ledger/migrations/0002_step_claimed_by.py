from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("events_ledger", "0001_initial")]

    operations = [
        migrations.AddField(
            model_name="eventrunstep",
            name="claimed_by",
            field=models.CharField(blank=True, editable=False, max_length=128, null=True),
        ),
    ]
