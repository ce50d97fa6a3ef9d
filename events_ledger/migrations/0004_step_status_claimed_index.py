from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("events_ledger", "0003_step_claim_token_index")]

    operations = [
        migrations.AddIndex(
            model_name="eventrunstep",
            index=models.Index(fields=["status", "claimed_at"], name="evstep_status_claimed_idx"),
        ),
    ]
