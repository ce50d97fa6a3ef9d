from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("events_ledger", "0002_step_claimed_by")]

    operations = [
        migrations.AddIndex(
            model_name="eventrunstep",
            index=models.Index(fields=["claim_token"], name="evstep_claim_token_idx"),
        ),
    ]
