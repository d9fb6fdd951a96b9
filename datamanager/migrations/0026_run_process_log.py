import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("datamanager", "0025_cluster_placement"),
    ]

    operations = [
        migrations.CreateModel(
            name="RunProcessLog",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "host",
                    models.CharField(help_text="The host the process runs on.", max_length=200),
                ),
                (
                    "process",
                    models.CharField(
                        help_text='Its name in the run: "inference-0".', max_length=200
                    ),
                ),
                (
                    "tail",
                    models.TextField(
                        blank=True, help_text="The log's last lines, at most a bound."
                    ),
                ),
                (
                    "size",
                    models.BigIntegerField(default=0, help_text="The whole log's size, in bytes."),
                ),
                (
                    "running",
                    models.BooleanField(
                        default=True, help_text="Whether the process ran when the tail was copied."
                    ),
                ),
                ("updated_at", models.DateTimeField(auto_now=True)),
                (
                    "run",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="process_logs",
                        to="datamanager.run",
                    ),
                ),
            ],
            options={
                "ordering": ["host", "process"],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("run", "host", "process"), name="uniq_run_process_log"
                    )
                ],
            },
        ),
    ]
