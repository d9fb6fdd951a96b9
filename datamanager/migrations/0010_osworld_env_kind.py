# The osworld backend (envmanager/osworld_env.py): tasks in OSWorld's format, env slots on
# OSWorld VMs or Dartboard desktops serving OSWorld's protocol.

from django.db import migrations, models

CHOICES = [("miniwob", "Miniwob"), ("desktop", "Desktop"), ("sim", "Sim"), ("osworld", "Osworld")]


class Migration(migrations.Migration):

    dependencies = [
        ("datamanager", "0009_trajectory_run_task_finished"),
    ]

    operations = [
        migrations.AlterField(
            model_name="envslot",
            name="backend",
            field=models.CharField(choices=CHOICES, max_length=32),
        ),
        migrations.AlterField(
            model_name="task",
            name="env_kind",
            field=models.CharField(choices=CHOICES, max_length=32),
        ),
    ]
