"""`python manage.py grant_role USERNAME viewer|operator|admin`: put a user in a role
(datamanager/roles.py), creating the user with `--create` (asks for no password: set one
with `manage.py changepassword`)."""

from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError

from datamanager.roles import ROLES, role_group


class Command(BaseCommand):
    help = "Give a user a dashboard role: viewer, operator or admin."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("role", choices=sorted(ROLES))
        parser.add_argument("--create", action="store_true", help="Create the user if missing.")

    def handle(self, *args, username, role, create, **options):
        user = User.objects.filter(username=username).first()
        if user is None:
            if not create:
                raise CommandError(f"no user {username!r} (add --create to create one)")
            user = User.objects.create_user(username)
        user.groups.remove(*user.groups.filter(name__in=ROLES))
        user.groups.add(role_group(role))
        self.stdout.write(f"{username} is now {role}")
