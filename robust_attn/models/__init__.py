"""Backbone families. Importing this package registers every architecture."""
import importlib

# One module per family; each registers its architectures with @register_model.
FAMILY_MODULES = ["resnet", "san", "sasa", "gsa", "aa", "ea"]

for _name in FAMILY_MODULES:
    try:
        importlib.import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as err:  # a family still being written is skipped, not fatal
        if err.name != f"{__name__}.{_name}":
            raise
