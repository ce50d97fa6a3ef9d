# #25: "Not required" as the other labels read ("Pending"); choices only, no SQL anywhere.
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("events_ledger", "0004_step_status_claimed_index")]

    operations = [
        migrations.AlterField(
            model_name="eventrun",
            name="cleanup_status",
            field=models.CharField(
                choices=[
                    ("not_required", "Not required"),
                    ("pending", "Pending"),
                    ("complete", "Complete"),
                    ("incomplete", "Incomplete"),
                ],
                default="not_required",
                max_length=16,
            ),
        ),
    ]
