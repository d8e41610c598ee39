"""The SAN authors' ImageNet checkpoints (hszhao/SAN, ``model/san.py``) as robust-attn SAN models.

``robust-attn zoo import san-official PATH.pth --arch san10_pairwise``. The authors save
``{"state_dict": model.state_dict(), ...}`` of a DataParallel model (``module.`` prefix). Their
module names and ours, for stage ``s`` (0-4) with ``n_s`` blocks (SAN10: 2, 1, 2, 4, 1):

=================================  ==========================================================
authors                            ours (:mod:`robust_attn.models.san`)
=================================  ==========================================================
``conv_in``, ``bn_in``             ``stem.0``, ``stem.1``
``conv{s}``                        ``stages.{s}.1`` (``stages.{s}.0`` is the 2x2 max pool)
``layer{s}.{i}.bn1/bn2/conv``      ``stages.{s}.{2+i}.bn1/bn2/conv``
``layer{s}.{i}.sam.conv1/2/3``     ``stages.{s}.{2+i}.attn.phi/psi/beta``
``layer{s}.{i}.sam.conv_w.*``      ``stages.{s}.{2+i}.attn.gamma.*`` (same Sequential indices)
``layer{s}.{i}.sam.conv_p``        ``stages.{s}.{2+i}.attn.pos`` (pairwise only)
``bn{s}``                          ``stages.{s}.{2+n_s}``
``fc``                             ``fc``
=================================  ==========================================================

The conversion is a renaming only: every tensor is taken as is. What was checked against the
authors' code (``model/san.py``, ``lib/sa/functions/*_refpad.py``) for this to hold:

* Same sub-layers in the same places: 1x1 stem conv without bias, BN, ReLU; per stage max pool,
  bias-free 1x1 conv, blocks, BN, ReLU; pre-activation blocks BN-ReLU-SAM-BN-ReLU-conv(bias) + x;
  ``conv1/conv2/conv3`` with bias (``C/16, C/16, C/4``); ``conv_w`` =
  BN-ReLU-conv(no bias)-BN-ReLU-conv(bias) with pairwise widths ``C/16+2 -> C/16 -> C/32`` and
  patchwise ``C/16 (k^2+1) -> C/32 -> k^2 C/32``; ``conv_p`` 2 -> 2 with bias.
* Pairwise relation ``x1_i - x2_j`` (``Subtraction2``: center of the first input minus the
  neighbour of the second) concatenated with ``p_i - p_j`` (``Subtraction`` of the encoded
  grid), relation channels first; softmax over the footprint axis.
* Position grid: channel 0 varies along the width (x), channel 1 along the height (y), both
  ``linspace(-1, 1)``; :func:`robust_attn.layers.san.position_grid` has the same (x, y) order.
* Patchwise input ``[x1_i (C/16), unfold(pad(x2)) (C/16 k^2, channel-major c k^2 + j)]``; weight
  ``(g, j)`` is ``conv_w``'s output channel ``g k^2 + j``; ours is ordered the same.
* Aggregation: channel ``c`` of ``conv3(x)`` is weighted by group ``c % G`` (the kernel's
  ``c % weight_channels``), footprint ``j = kh k + kw`` with reflection padding; ours the same.
* Reflection padding: the authors' kernels mirror once (``-h``, ``2(H-1)-h``), valid where the
  map is larger than half the footprint; at 224 px the smallest map is 7x7 for a 7x7 footprint
  (pad 3), where ours (repeated mirroring) is identical. Below 128 px input the last stage's map
  is smaller than 4 and the authors' kernel would read out of bounds; ours stays defined.

The model is built with ``create_model(arch, num_classes, "imagenet")`` (224 px; ``num_classes``
from ``fc.weight``, 1000 for the authors' files) and wrapped with ImageNet mean/std, as the
authors' data loader normalizes.
"""
from __future__ import annotations

import os
import re

import torch

from robust_attn.importers import (ConversionError, convert_and_save, register_importer, remap, strip_module_prefix,
                                   target_model)
from robust_attn.models.san import SAN_LAYERS
from robust_attn.models.registry import list_models, model_info

__all__ = ["SAN_ARCHS", "official_key", "convert_san_official", "guess_san_arch", "import_san_official"]

SAN_ARCHS = tuple(n for n in list_models("san*") if model_info(n).family == "san")
_SAM = {"phi": "conv1", "psi": "conv2", "beta": "conv3", "gamma": "conv_w", "pos": "conv_p"}
_DESCRIPTION = "SAN authors' ImageNet checkpoint (hszhao/SAN, Zhao, Jia, Koltun CVPR 2020), converted by name"


def official_key(key: str, blocks: tuple[int, ...]) -> str:
    """The authors' name of our SAN parameter/buffer ``key`` (``blocks``: blocks per stage)."""
    if key.startswith("stem."):
        index, rest = key[len("stem."):].split(".", 1)
        return {"0": "conv_in", "1": "bn_in"}[index] + "." + rest
    if key.startswith("fc."):
        return key
    m = re.fullmatch(r"stages\.(\d)\.(\d+)\.(.+)", key)
    if m is None:
        raise KeyError(f"no official name for {key!r}")
    s, j, rest = int(m[1]), int(m[2]), m[3]
    if j == 1:
        return f"conv{s}.{rest}"
    if j == 2 + blocks[s]:
        return f"bn{s}.{rest}"
    block = f"layer{s}.{j - 2}"
    if rest.startswith("attn."):
        part, tail = rest[len("attn."):].split(".", 1)
        return f"{block}.sam.{_SAM[part]}.{tail}"
    return f"{block}.{rest}"


def guess_san_arch(state_dict: dict[str, torch.Tensor]) -> str | None:
    """The SAN arch whose layout the authors'-layout keys describe, or None."""
    counts = [len({k.split(".")[1] for k in state_dict if k.startswith(f"layer{s}.")}) for s in range(5)]
    depth = next((d for d, layers in SAN_LAYERS.items() if tuple(counts) == layers), None)
    if depth is None:
        return None
    return f"san{depth}_{'pairwise' if any('.sam.conv_p.' in k for k in state_dict) else 'patchwise'}"


def _check_arch(arch: str) -> None:
    if arch not in SAN_ARCHS:
        raise ConversionError(f"--arch {arch!r} is not a SAN architecture; choose one of {', '.join(SAN_ARCHS)}")


def convert_san_official(state_dict: dict[str, torch.Tensor], arch: str, model: torch.nn.Module | None = None
                         ) -> dict[str, torch.Tensor]:
    """Our state dict (of ``create_model(arch, num_classes, "imagenet")``) from the authors' layout.

    ``state_dict`` may carry the ``module.`` prefix. Unknown, missing or mis-shaped keys raise
    :class:`ConversionError` naming them (and the arch the keys look like, if another)."""
    _check_arch(arch)
    state_dict = strip_module_prefix(state_dict)
    model = target_model(state_dict, arch, model)
    target = model.state_dict()
    blocks = tuple(len(stage) - 4 for stage in model.stages)  # pool, conv, blocks..., BN, ReLU
    mapping = {k: official_key(k, blocks) for k in target}
    guess = guess_san_arch(state_dict)
    hint = (f"The keys look like the authors' {guess}: pass --arch {guess}" if guess and guess != arch else
            "Pass a checkpoint of the authors' SAN (hszhao/SAN model/san.py) and the --arch it was trained as")
    return remap(state_dict, mapping, target, f"not an official {arch} state dict", hint)


@register_importer("san-official", "the SAN authors' .pth (hszhao/SAN)")
def import_san_official(path: str | os.PathLike, arch: str, out: str | os.PathLike) -> str:
    """Convert the authors' checkpoint ``path`` into a robust-attn checkpoint ``out``; its sha256."""
    _check_arch(arch)
    return convert_and_save("san-official", path, arch, out, convert_san_official, _DESCRIPTION)
