"""The viewer, operator and admin groups with their permissions (datamanager/roles.py)."""

from django.contrib.auth.management import create_permissions
from django.db import migrations

from datamanager.roles import ROLES


def make_groups(apps, schema_editor):
    for app_config in apps.get_app_configs():  # permissions exist only after post_migrate
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for role, perms in ROLES.items():
        group, _ = Group.objects.get_or_create(name=role)
        wanted = []
        for perm in perms:
            app_label, codename = perm.split(".")
            wanted.append(
                Permission.objects.get(content_type__app_label=app_label, codename=codename)
            )
        group.permissions.set(wanted)


class Migration(migrations.Migration):
    dependencies = [
        ("datamanager", "0003_roles"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [migrations.RunPython(make_groups, migrations.RunPython.noop)]
