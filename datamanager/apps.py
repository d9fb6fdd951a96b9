from django.apps import AppConfig


class DatamanagerConfig(AppConfig):
    name = "datamanager"
    verbose_name = "Data manager"
