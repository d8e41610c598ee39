"""``san-official:PATH.pth[:ARCH]``: the SAN authors' ImageNet checkpoint (hszhao/SAN), converted
by name with :func:`robust_attn.importers.san_official.convert_san_official` (read with
``weights_only=True``). ``ARCH`` (e.g. ``san10_pairwise``) defaults to the one the file's keys
describe.

Preprocessing is the authors' evaluation transform (``tool/test.py``): ``Resize(256)`` (PIL's
default, bilinear), ``CenterCrop(224)``, ImageNet mean/std (inside the wrapper).
"""
from __future__ import annotations

from pathlib import Path

from robust_attn.sources import register_source
from robust_attn.sources.base import LoadedModel, Preprocessing, SourceError, SourceRequest

PREPROCESSING_KW = dict(input_size=224, resize_size=256, crop_size=224, interpolation="bilinear")


def split_target(target: str) -> tuple[Path, str | None]:
    """``PATH[:ARCH]`` -> (PATH, ARCH or None)."""
    from robust_attn.importers.san_official import SAN_ARCHS

    head, sep, tail = target.rpartition(":")
    return (Path(head), tail) if sep and tail in SAN_ARCHS else (Path(target), None)


def check_san_official(target: str, spec: str) -> None:
    path = split_target(target)[0]
    if not path.is_file():
        raise SourceError(f"SAN authors' checkpoint {path} does not exist; give the path of their .pth file "
                          f"(san-official:PATH.pth[:ARCH])")


def label_san_official(target: str) -> str:
    """The architecture of ``PATH[:ARCH]``, else the file's stem."""
    path, arch = split_target(target)
    return arch or path.stem


@register_source("san-official", check=check_san_official, label=label_san_official,
                 form="san-official:PATH.pth[:ARCH]")
def load_san_official(request: SourceRequest) -> LoadedModel:
    from robust_attn.importers import IMAGENET_MEAN, IMAGENET_STD, ConversionError, fc_classes, read_state_dict
    from robust_attn.importers.san_official import SAN_ARCHS, convert_san_official, guess_san_arch
    from robust_attn.models.registry import create_model
    from robust_attn.utils.io import sha256_file
    from robust_attn.models.wrapper import NormalizedModel

    if request.checkpoint or request.model_args:
        raise SourceError(f"{request.spec!r} names its weights file: drop --checkpoint and --model-args")
    check_san_official(request.target, request.spec)
    path, arch = split_target(request.target)
    try:
        state = read_state_dict(path)
        if arch is None:
            arch = guess_san_arch(state)
            if arch is None:
                raise SourceError(f"{path}: its keys do not have the layout of any of the authors' SAN models; "
                                  f"name the architecture: san-official:{path}:ARCH, ARCH one of "
                                  f"{', '.join(SAN_ARCHS)}")
        net = create_model(arch, fc_classes(state), "imagenet")
        net.load_state_dict(convert_san_official(state, arch, net), strict=True)
    except ConversionError as err:
        raise SourceError(str(err)) from None
    model = NormalizedModel(net, IMAGENET_MEAN, IMAGENET_STD).eval()
    sha = sha256_file(path)
    preprocessing = Preprocessing(mean=tuple(IMAGENET_MEAN), std=tuple(IMAGENET_STD), **PREPROCESSING_KW)
    return LoadedModel(model, preprocessing, {
        "source": "san-official", "model": arch, "arch": net.arch_args,
        "checkpoint": {"path": str(path), "sha256": sha}, "weights_origin": "checkpoint", "weights_sha256": sha})
