"""Backbone families, one module each. Importing this package registers every architecture."""
from robust_attn.models import aa, ea, gsa, resnet, san, sasa  # noqa: F401  (registration side effects)
