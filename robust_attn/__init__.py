"""robust-attn: robustness evaluation of attention-based vision backbones.

    >>> import robust_attn
    >>> robust_attn.list_models("san10*")
    ['san10_pairwise', 'san10_patchwise']
    >>> model = robust_attn.create_model("resnet26", num_classes=10, resolution="cifar")
"""
from robust_attn.models.registry import create_model, list_models, model_info, register_model

__version__ = "0.1.0"


def load_model(name: str, dataset: str, **kwargs):
    """A trained zoo model, wrapped for [0, 1] input, in eval mode (see :mod:`robust_attn.models.manifest`)."""
    from robust_attn.models.manifest import load_model as _load_model

    return _load_model(name, dataset=dataset, **kwargs)


__all__ = ["create_model", "list_models", "model_info", "register_model", "load_model", "__version__"]
