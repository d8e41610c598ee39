"""The input contract of a model: what its ``forward`` takes.

Every attack and protocol hands the model [0, 1] images; the wrapper (:class:`NormalizedModel`)
normalizes them where the model expects normalized input. So every model source must say which
of the two conventions its model follows:

* ``unit``: the model takes [0, 1] images and normalizes inside (RobustBench's convention);
* ``normalized``: it takes images normalized with the dataset's mean/std (or its weights'
  preprocessing mean/std), which the wrapper applies.

Where it comes from, first match wins: ``--model-input`` (the CLI flag); the model's own
declaration, an ``input_range`` attribute (``"unit"`` or ``"normalized"``) on the module a
user's function returns or on the function itself; a user's function that returns a
:class:`NormalizedModel` (normalizes inside: ``unit`` at the wrapper); the source's convention
(the registry, the zoo, timm, torchvision and the SAN authors' weights take normalized input).
A user's model with none of these is probed (:func:`probe_input_contract`): the first images
(64, or all there are) are classified both ways, and when [0, 1] input scores clearly higher than
the assumed normalized input the run stops with an error naming ``--model-input unit``, so a
model that normalizes inside is never silently evaluated on doubly normalized images. The run
prints what it assumed and records it in ``run.json`` (``input_contract``, and how in
``input_contract_from``).
"""
from __future__ import annotations

import sys

import torch
from torch.utils.data import DataLoader, Subset

from robust_attn.sources.base import SourceError

__all__ = ["CONTRACTS", "ATTRIBUTE", "PROBE_IMAGES", "declared_contract", "apply_input_contract",
           "probe_input_contract", "clearly_higher"]

CONTRACTS = ("unit", "normalized")
ATTRIBUTE = "input_range"
PROBE_IMAGES = 64
FLAG_HELP = ("what the model's forward takes: 'unit' = [0, 1] images, it normalizes inside (RobustBench's "
             "convention); 'normalized' = images normalized with the dataset's (or its preprocessing's) mean/std, "
             "which robust-attn applies. Default: the model's input_range attribute, else its source's convention; "
             "a FILE.py/module model with neither is probed on the first 64 images")


def _check_value(value, where: str) -> str:
    if value not in CONTRACTS:
        raise SourceError(f"{where} must be 'unit' ([0, 1] images, normalized inside) or 'normalized' "
                          f"(dataset-normalized input), got {value!r}")
    return value


def declared_contract(net, function=None) -> str | None:
    """The ``input_range`` a user's module (or the function that built it) declares, or None."""
    for owner, where in ((net, "the model's input_range attribute"),
                         (function, "the function's input_range attribute")):
        value = getattr(owner, ATTRIBUTE, None) if owner is not None else None
        if value is not None:
            return _check_value(value, where)
    return None


def _wrapper(model):
    from robust_attn.models.wrapper import NormalizedModel

    return model if isinstance(model, NormalizedModel) else None


def _set_unit(model) -> None:
    """Make the wrapper hand the model [0, 1] images unchanged (mean 0, std 1)."""
    wrapper = _wrapper(model)
    if wrapper is None:
        raise SourceError("the model is not wrapped by robust-attn, so its input cannot be switched to [0, 1]")
    with torch.no_grad():
        wrapper.mean.zero_()
        wrapper.std.fill_(1.0)


def _first_images(dataset, n: int, batch_size: int):
    n = min(n, len(dataset))
    return DataLoader(Subset(dataset, range(n)), batch_size=max(1, int(batch_size)))


def _correct(model, loader, device, unit: bool) -> int:
    wrapper = _wrapper(model)
    saved = (wrapper.mean.clone(), wrapper.std.clone())
    try:
        if unit:
            _set_unit(model)
        total = 0
        with torch.no_grad():
            for images, labels in loader:
                logits = model(images.to(device))
                total += int((logits.argmax(1).cpu() == torch.as_tensor(labels).long()).sum())
        return total
    finally:
        with torch.no_grad():
            wrapper.mean.copy_(saved[0])
            wrapper.std.copy_(saved[1])


def clearly_higher(other: int, assumed: int, n: int) -> bool:
    """Whether ``other`` correct of ``n`` is clearly above ``assumed``: by at least 5 images and 10
    percentage points (a random model scores about the same either way)."""
    return other - assumed >= max(5, 0.1 * n)


def probe_input_contract(model, dataset, device, batch_size: int, images: int = PROBE_IMAGES) -> dict:
    """Top-1 on the first ``images`` images with the wrapper's normalization and with [0, 1] input
    (at most ``batch_size`` images at a time): ``{"images", "normalized_correct", "unit_correct"}``."""
    loader = _first_images(dataset, images, batch_size)
    n = min(images, len(dataset))
    return {"images": n, "normalized_correct": _correct(model, loader, device, unit=False),
            "unit_correct": _correct(model, loader, device, unit=True)}


def apply_input_contract(model, description: dict, flag: str | None, dataset, device, batch_size: int,
                         declared: str | None = None, log=None) -> dict:
    """Settle and apply the model's input contract (module docstring); returns ``description``
    (below). ``declared``: the model's own declaration
    (a user's function: :func:`declared_contract`; the sources record it in the description's
    ``input_range``). ``log``: where the line saying what was assumed goes (default stderr)."""
    log = log or (lambda line: print(line, file=sys.stderr))
    source = description.get("source")
    own = declared or description.get("input_range")
    inside = _wrapper(model) is None or description.get("normalization") == "the function's own NormalizedModel"
    probe = None
    if flag is not None:
        contract, origin = _check_value(flag, "--model-input"), "flag"
        if source not in ("callable",) and contract == "unit":
            raise SourceError(f"--model-input unit is for a FILE.py:FUNCTION or module model; a {source} model "
                              f"takes input normalized with its own mean/std, which robust-attn applies")
    elif own is not None:
        contract, origin = _check_value(own, "input_range"), "declaration"
    elif inside:
        contract, origin = "unit", "declaration"
    elif source != "callable":
        contract, origin = "normalized", "source"
    else:
        probe = probe_input_contract(model, dataset, device, batch_size)
        if clearly_higher(probe["unit_correct"], probe["normalized_correct"], probe["images"]):
            raise SourceError(
                f"the model scores {probe['unit_correct']} of {probe['images']} on [0, 1] images but "
                f"{probe['normalized_correct']} on images normalized with the dataset's mean/std (what robust-attn "
                f"assumes for a model that does not say): it looks like it normalizes inside. Run again with "
                f"--model-input unit (or set input_range = 'unit' on the module your function returns); "
                f"--model-input normalized keeps the assumption")
        contract, origin = "normalized", "probe"
    if contract == "unit" and not inside:
        _set_unit(model)
    record = {"from": origin, **({"probe": probe} if probe is not None else {})}
    said = ("[0, 1] images (it normalizes inside)" if contract == "unit" else
            "normalized images (robust-attn applies the mean/std)")
    how = {"flag": "--model-input", "declaration": "its declaration",
           "source": f"the {source or 'registry and zoo'} convention",
           "probe": (f"not declared; probed on {probe['images']} images: {probe['normalized_correct']} correct "
                     f"normalized, {probe['unit_correct']} on [0, 1]; --model-input to say" if probe else "")}[origin]
    log(f"model input: {said} ({how})")
    description = dict(description, input_contract=contract, input_contract_from=record)
    description.pop("input_range", None)
    if contract == "unit" and not inside:
        description["normalization"] = "none: the model takes [0, 1] images and normalizes inside"
        if description.get("weights_origin") == "user":
            from robust_attn.sources.base import state_dict_sha256

            description["weights_sha256"] = state_dict_sha256(model)
    return description
