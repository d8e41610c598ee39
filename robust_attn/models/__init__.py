"""Backbone families, one module each, and what supports them: the model registry
(:mod:`.registry`), resolutions, complexity, the papers' reference figures, the [0, 1]-input
wrapper, checkpoints and the zoo's manifest. A family module registers its architectures with
``@register_model``; the registry imports every module of this package when first asked, so a new
family is one new file here."""
