"""The zoo of trained checkpoints: a verified manifest and one-line loading.

``zoo/manifest.json`` lists one entry per (model, dataset): where the weights are, their
sha256, the architecture and its arguments, the recipe that trained them (path and hash),
the clean test accuracy, the training log, the command that reproduces them, and for an
adversarially trained checkpoint how it was trained (``adversarial``: the method, eps and steps of
its recipe's ``[adversarial]`` table, as the checkpoint's sidecar records them,
:func:`robust_attn.train.adversarial.describe`), so it is never taken for a standard one.
:func:`load_model` checks the sha256 before reading anything, and the checkpoint loader
refuses weights that do not fit the architecture. Loading never unpickles: weights are
safetensors, torchvision weights go through torchvision's own ``weights_only`` loader.

Entries are of two kinds:

* ``source = "checkpoint"``: a robust-attn checkpoint (``.safetensors`` + ``.json`` sidecar),
  trained by a recipe of the project or added by a user with ``robust-attn zoo add``.
* ``source = "torchvision"``: a torchvision classification model and weights enum
  (e.g. ``resnet50`` / ``IMAGENET1K_V1``), fetched through torchvision's weights API where the
  network allows, so a well-known model can stand in the same tables.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch.nn as nn

from robust_attn.models.checkpoint import CheckpointError, load_checkpoint, read_sidecar, sidecar_path
from robust_attn.utils.io import atomic_path, atomic_write_json, sha256_file
from robust_attn.models.wrapper import NormalizedModel
from robust_attn.models.zoo_recipe import project_recipe, recipe_error

__all__ = ["ZooEntry", "Manifest", "ZOO_DIR", "default_manifest_path", "load_model", "verify_zoo", "training_label",
           "copy_into_zoo", "outside_manifest"]

ZOO_DIR = Path(__file__).resolve().parents[2] / "zoo"
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SOURCES = ("checkpoint", "torchvision")


def default_manifest_path() -> Path:
    return Path(os.environ.get("ROBUST_ATTN_ZOO_MANIFEST", ZOO_DIR / "manifest.json"))


@dataclass
class ZooEntry:
    """One trained model of the zoo. Paths are relative to the manifest's folder."""

    name: str
    dataset: str
    source: str = "checkpoint"
    weights: str = ""                      # checkpoint: path of the .safetensors file
    sha256: str = ""                       # checkpoint: sha256 of the weights file
    arch: dict = field(default_factory=dict)
    recipe: str = ""                       # recipe file that trained it, and its sha256
    recipe_sha256: str = ""
    metrics: dict = field(default_factory=dict)   # clean test top1/top5 (percent)
    log: str = ""                          # training log (metrics.csv)
    command: str = ""                      # the command that reproduces the checkpoint
    torchvision: dict = field(default_factory=dict)  # torchvision: {"model": ..., "weights": ...}
    notes: str = ""
    adversarial: dict = field(default_factory=dict)  # adversarial training (method, eps, steps, ...); {}: standard

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"zoo entry {self.name!r}: source must be one of {SOURCES}, got {self.source!r}")
        if self.source == "checkpoint" and not (self.weights and len(self.sha256) == 64):
            raise ValueError(f"zoo entry {self.name!r}: a checkpoint entry needs 'weights' and a 64-hex 'sha256'")
        if self.source == "torchvision" and not {"model", "weights"} <= set(self.torchvision):
            raise ValueError(f"zoo entry {self.name!r}: a torchvision entry needs torchvision.model and .weights")

    @property
    def key(self) -> tuple[str, str]:
        return self.name, self.dataset


def training_label(adversarial: dict) -> str:
    """How an entry (its ``adversarial`` record) was trained, in a few words: ``standard``, or e.g.
    ``adversarial pgd, eps 8/255, 10 steps``."""
    if not adversarial:
        return "standard"
    eps = adversarial.get("eps_255")
    if eps is None and isinstance(adversarial.get("eps"), (int, float)):
        eps = round(adversarial["eps"] * 255, 6)
    steps = adversarial.get("steps")
    return (f"adversarial {adversarial.get('method', '?')}" + (f", eps {eps:g}/255" if eps is not None else "")
            + (f", {steps} step{'s' if steps != 1 else ''}" if steps is not None else ""))


class Manifest:
    """The entries of a manifest file, keyed by (name, dataset)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else default_manifest_path()
        self.entries: dict[tuple[str, str], ZooEntry] = {}
        if self.path.is_file():
            known = {f.name for f in fields(ZooEntry)}
            try:
                listed = json.loads(self.path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"zoo manifest {self.path} is not valid JSON ({err}): fix the hand edit or "
                                 f"restore it (`git checkout zoo/manifest.json`; entries are added with "
                                 f"`robust-attn zoo add`)") from None
            if not isinstance(listed, dict) or not isinstance(listed.get("models", []), list):
                raise ValueError(f"zoo manifest {self.path} must be an object {{\"models\": [...]}}; restore it "
                                 f"or rebuild it with `robust-attn zoo add`")
            for i, raw in enumerate(listed.get("models", [])):
                if not isinstance(raw, dict) or not {"name", "dataset"} <= set(raw):
                    raise ValueError(f"{self.path}: entry {i} of \"models\" must be an object with at least "
                                     f"\"name\" and \"dataset\", got {raw!r}; restore the manifest or "
                                     f"re-add the model with `robust-attn zoo add`")
                unknown = set(raw) - known
                if unknown:
                    raise ValueError(f"{self.path}: unknown keys {sorted(unknown)} in entry {raw.get('name')!r}")
                entry = ZooEntry(**raw)
                self.entries[entry.key] = entry

    def resolve(self, relative: str) -> Path:
        return (self.path.parent / relative).resolve()

    def get(self, name: str, dataset: str) -> ZooEntry:
        if (name, dataset) not in self.entries:
            have = sorted(f"{n} ({d})" for n, d in self.entries) or ["nothing yet"]
            raise KeyError(f"the zoo at {self.path} has no {name!r} trained on {dataset!r}; it has: "
                           f"{', '.join(have)}. Train one with `robust-attn train zoo/recipes/...` and "
                           f"register it with `robust-attn zoo add`.")
        return self.entries[(name, dataset)]

    def add(self, entry: ZooEntry) -> None:
        self.entries[entry.key] = entry

    def save(self) -> None:
        models = [asdict(e) for _, e in sorted(self.entries.items())]
        atomic_write_json(self.path, {"models": models})


def _load_torchvision(entry: ZooEntry, device: str) -> NormalizedModel:
    """A torchvision entry has no weights file: torchvision's weights API fetches them (the spec
    ``torchvision:MODEL:WEIGHTS``, :mod:`robust_attn.sources.torchvision_source`)."""
    from robust_attn.data import dataset_info
    from robust_attn.sources import load_model_spec

    spec = f"torchvision:{entry.torchvision['model']}:{entry.torchvision['weights']}"
    return load_model_spec(spec, dataset_info=dataset_info(entry.dataset), device=device, check=False).model


def load_entry(entry: ZooEntry, manifest: Manifest, device: str = "cpu") -> NormalizedModel:
    if entry.source == "torchvision":
        return _load_torchvision(entry, device)
    weights = manifest.resolve(entry.weights)
    if not weights.is_file():
        raise CheckpointError(f"zoo entry {entry.name!r} ({entry.dataset}) of the manifest {manifest.path}: its "
                              f"weights file {weights} does not exist; fetch it (git lfs pull, or copy it there), train it "
                              f"again with its recipe, or remove the entry from the manifest")
    model = load_checkpoint(weights, expected_sha256=entry.sha256, map_location=device)
    if entry.arch and model.arch_args != entry.arch:
        raise CheckpointError(f"zoo entry {entry.name!r}: the checkpoint's sidecar describes {model.arch_args}, "
                              f"the manifest {entry.arch}; one of them was edited by hand")
    return model


def load_model(name: str, dataset: str, manifest: str | os.PathLike | Manifest | None = None,
               device: str = "cpu") -> nn.Module:
    """The trained zoo model ``name`` for ``dataset``: sha256-checked, wrapped for [0, 1] input,
    in eval mode (RobustBench's ``load_model``, without special cases by name). ``name`` may be
    written as the model spec the command line and the reports use (``zoo:resnet26-adv``)."""
    manifest = manifest if isinstance(manifest, Manifest) else Manifest(manifest)
    return load_entry(manifest.get(name.removeprefix("zoo:"), dataset), manifest, device)


def verify_zoo(manifest: Manifest | None = None) -> list[tuple[ZooEntry, str | None]]:
    """Check every checkpoint entry: file present, sha256, architecture fits the weights.
    Returns ``(entry, error or None)`` per entry; torchvision entries are checked by torchvision."""
    manifest = manifest or Manifest()
    results = []
    for entry in manifest.entries.values():
        if entry.source != "checkpoint":
            results.append((entry, None))
            continue
        try:
            load_entry(entry, manifest)
            error = recipe_error(entry, manifest.resolve(entry.weights)) or _training_error(entry, manifest)
        except (CheckpointError, KeyError, ValueError) as err:
            error = str(err)
        results.append((entry, error))
    return results


def _training_error(entry: ZooEntry, manifest: Manifest) -> str | None:
    """The entry must record the adversarial training its checkpoint's sidecar records (none
    for a standard one)."""
    trained = read_sidecar(manifest.resolve(entry.weights)).get("adversarial") or {}
    if entry.adversarial == trained:
        return None
    return (f"the manifest says {entry.name} was trained {training_label(entry.adversarial)!r}, its checkpoint's "
            f"sidecar {training_label(trained)!r}; register it again with `robust-attn zoo add {entry.name} "
            f"--dataset {entry.dataset} --checkpoint {entry.weights} --force`")


def _relative_to(manifest: Manifest, path: Path) -> str:
    """``path`` as the manifest stores it: relative to the manifest's folder where possible."""
    try:
        return os.path.relpath(path, manifest.path.parent.resolve())
    except ValueError:
        return str(path)


def outside_manifest(manifest: Manifest, path: str | os.PathLike) -> bool:
    """Whether ``path`` lies outside the manifest's folder, where a copy of that folder (a clone of
    the repository, for the project's zoo) would not have it."""
    folder = manifest.path.parent.resolve()
    return folder not in Path(path).resolve().parents


def copy_into_zoo(manifest: Manifest, entry: ZooEntry, force: bool = False) -> None:
    """Copy the checkpoint ``entry`` names (weights and sidecar) and its training log into the
    manifest's folder as ``checkpoints/<dataset>/<name>.safetensors``, ``<name>.json`` and
    ``<name>_metrics.csv``, the layout of the shipped zoo, and point the entry at the copies. The
    entry comes from :func:`entry_from_checkpoint`, which has checked the checkpoint, so here it is
    only copied: each file atomically, weights last; an existing different file is replaced only
    with ``force``."""
    weights = manifest.resolve(entry.weights)
    folder = manifest.path.parent / "checkpoints" / entry.dataset
    dest = folder / f"{entry.name}.safetensors"
    pairs = [(sidecar_path(weights), sidecar_path(dest))]
    log_dest = folder / f"{entry.name}_metrics.csv"
    if entry.log:
        pairs.append((manifest.resolve(entry.log), log_dest))
    pairs.append((weights, dest))
    clashes = [str(d) for src, d in pairs if d.is_file() and d.resolve() != src.resolve()
               and sha256_file(d) != sha256_file(src)]
    if clashes and not force:
        raise ValueError(f"{', '.join(clashes)} already exist with other contents; pass --force to replace them, "
                         f"or give the entry another name")
    for src, d in pairs:
        if d.is_file() and d.resolve() == src.resolve():
            continue
        with atomic_path(d) as tmp:
            shutil.copyfile(src, tmp)
    entry.weights = _relative_to(manifest, dest.resolve())
    if entry.log:
        entry.log = _relative_to(manifest, log_dest.resolve())


def entry_from_checkpoint(name: str, dataset: str, weights: str | os.PathLike, manifest: Manifest,
                          **extra) -> ZooEntry:
    """A manifest entry for an existing robust-attn checkpoint (its sidecar supplies the rest:
    architecture, recipe, metrics and how it was trained)."""
    if not Path(weights).is_file():   # before its sidecar is looked for, which would be named instead
        raise ValueError(f"checkpoint {weights} does not exist"
                         + (" (it is a folder; give the .safetensors file in it)" if Path(weights).is_dir()
                            else "; give the .safetensors file `robust-attn train` wrote"))
    weights = Path(weights).resolve()
    load_checkpoint(weights)  # refuse a file that is no checkpoint, or does not fit its architecture
    meta = read_sidecar(weights)
    relative = _relative_to(manifest, weights)
    if extra.get("log"):
        log = Path(extra["log"]).resolve()
        if not log.is_file():
            raise ValueError(f"training log {extra['log']} does not exist")
        extra["log"] = _relative_to(manifest, log)
    return ZooEntry(name=name, dataset=dataset, weights=relative, sha256=sha256_file(weights), arch=meta["arch"],
                    recipe=extra.pop("recipe", project_recipe(meta.get("recipe_source", ""))),
                    recipe_sha256=extra.pop("recipe_sha256", meta.get("recipe_sha256", "")),
                    metrics=extra.pop("metrics", meta.get("metrics", {})),
                    adversarial=extra.pop("adversarial", meta.get("adversarial") or {}), **extra)
