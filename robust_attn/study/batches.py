"""The study's batch sizes: defaults by image size, and which one a step runs with.

A study runs its models on ``batch_size`` images at a time (rotation, Table 10's PGD, the
corruptions, occlusion, shuffling) and on ``attack_batch_size`` images in the steps on the attack
subset (APGD, AutoAttack, Square, transfer, the masking checks). Memory grows with the batch and
the image size (``docs/memory.md``), so a config that gives neither takes the default of its
dataset's resolution (:data:`DEFAULT_BATCHES`): at 32 px the sizes the zoo's studies were made
with; at ImageNet resolution (224 px) ``eval``'s default of 16: twice as many images would still
fit 6 GB of resident memory (a machine with 8 GB, less the system's share) in every step measured
at 224 px, whose peaks grow by up to 156 MB per image (SAN10 pairwise's PGD), which leaves room for
SAN's deeper variants and the masking checks (``benchmarks/results/memory_224.json``,
``docs/memory.md``). A preset's batch
sizes are sized at 32 px; at a larger resolution they are capped at that default
(:func:`preset_batches`). Values given in the config or on the command line are kept as given.
A CPU study at ImageNet resolution runs one process by default
(:func:`robust_attn.study.run.default_workers`): each process holds its own batch.

An out-of-memory error in a step names the batch size that step ran with and the option that
sets it (:func:`step_memory`, :mod:`robust_attn.utils.memory`).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

from robust_attn.utils.memory import names_batch_size

__all__ = ["StudyBatches", "DEFAULT_BATCHES", "dataset_resolution", "default_batches", "preset_batches",
           "step_memory", "WORKER_OUT_OF_MEMORY"]

#: exit code of a study worker process that ran out of memory (it printed which batch size to lower)
WORKER_OUT_OF_MEMORY = 3


@dataclass(frozen=True)
class StudyBatches:
    batch_size: int
    attack_batch_size: int


#: per model resolution (:data:`robust_attn.models.resolution.RESOLUTIONS`): the defaults
DEFAULT_BATCHES = {"cifar": StudyBatches(250, 100), "imagenet": StudyBatches(16, 16)}


def dataset_resolution(dataset: str) -> str | None:
    """The resolution name of ``dataset``'s models ("cifar", "imagenet"); None for an unknown
    dataset. Needs no data (a folder dataset's resolution does not depend on its folder)."""
    from robust_attn.data.base import DATASETS

    module = DATASETS.get(dataset) if dataset in DATASETS else None
    info = getattr(module, "INFO", None)
    return getattr(info, "resolution", None)


def default_batches(dataset: str) -> StudyBatches:
    """The default batch sizes of a study of ``dataset`` (the 32 px ones for an unknown dataset)."""
    return DEFAULT_BATCHES.get(dataset_resolution(dataset), DEFAULT_BATCHES["cifar"])


def preset_batches(values: dict, dataset: str) -> dict:
    """A preset's ``values`` for ``dataset``: its batch sizes (sized at 32 px) capped at the
    dataset's defaults."""
    defaults = default_batches(dataset)
    out = dict(values)
    for key in ("batch_size", "attack_batch_size"):
        if out.get(key) is not None:
            out[key] = min(out[key], getattr(defaults, key))
    return out


def step_memory(step, config) -> AbstractContextManager:
    """Around a study step: an out-of-memory error names the batch size the step ran with and its
    option (``--attack-batch-size`` for the steps on the attack subset, else ``--batch-size``)."""
    if step.attack_subset:
        return names_batch_size(config.attack_batch_size, "--attack-batch-size", f"the study's {step.name} step")
    return names_batch_size(config.batch_size, "--batch-size", f"the study's {step.name} step")
