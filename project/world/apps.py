from django.apps import AppConfig


class WorldConfig(AppConfig):
    name = "project.world"
    label = "world"
    verbose_name = "Demo world"
    default_auto_field = "django.db.models.BigAutoField"
