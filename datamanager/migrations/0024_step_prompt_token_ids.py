from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("datamanager", "0023_slot_disk"),
    ]

    operations = [
        migrations.AddField(
            model_name="step",
            name="prompt_token_ids",
            field=models.BinaryField(
                blank=True,
                default=b"",
                help_text="The prompt's token ids as the policy's server tokenized it, image "
                "pads expanded (core.steps.pack_token_ids); the trainer trains on them. Empty "
                "for a demonstration recorded elsewhere, a scripted policy, or a step stored "
                "before they were kept (the trainer then encodes the stored prompt).",
            ),
        ),
    ]
