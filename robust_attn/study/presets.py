"""Named study sizes: ``robust-attn study --preset NAME``.

A preset is a set of study config values (:class:`robust_attn.study.config.StudyConfig` fields);
the options given on the command line override them. ``robust-attn study`` without a config file
and without ``--preset`` runs :data:`DEFAULT_CPU` on a CPU and :data:`DEFAULT_GPU` on a GPU.

* ``quick``: sized to finish, kernels' first build included, in about 20 minutes on a 2-core CPU
  with the seven zoo models: 500 test images for rotation (Table 9 and a 45° sweep) and targeted
  PGD (Table 10 and eps 2, 8), and a seeded subset of 100 for APGD-CE (20 iterations) at 1 and
  2/255, the transfer matrix and the gradient-masking checks (on 50 of them). Every finding of the report, with its
  bootstrap interval, at that size (the intervals are wide: ±4 points at 500 images, ±9 at 100).
* ``gpu``: the default on a GPU: the whole test split for rotation and PGD, 1,000 images for
  the attacks with AutoAttack at 8/255 (where its first member fools nearly every image of the
  undefended zoo), APGD-CE at 1, 2 and 4/255, Square, transfer and masking.
* ``full``: the settings of the committed report of the dataset (``reports/study-<dataset>/
  study.json``): the numbers there were made with exactly these.
"""
from __future__ import annotations

__all__ = ["PRESETS", "FULL", "DEFAULT_CPU", "DEFAULT_GPU", "preset_values", "list_presets"]

DEFAULT_CPU = "quick"
DEFAULT_GPU = "gpu"

PRESETS: dict[str, dict] = {
    "quick": {"limit": 500, "batch_size": 100, "angle_step": 45.0, "sweep_eps": (2 / 255, 8 / 255),
              "protocols": ("rotation", "pgd", "apgd", "transfer", "masking"),
              "attack_limit": 100, "attack_batch_size": 100, "apgd_eps": (1 / 255, 2 / 255), "attack_steps": 20,
              "masking_images": 50},
    "gpu": {"limit": None, "attack_limit": 1000, "attack_batch_size": 500, "autoattack_eps": (8 / 255,),
            "apgd_eps": (1 / 255, 2 / 255, 4 / 255),
            "protocols": ("rotation", "pgd", "apgd", "autoattack", "square", "transfer", "masking")},
}

#: ``full``: per dataset, the config of the committed report ``reports/study-<dataset>/study.json``
#: (the keys where it differs from the study's defaults)
FULL: dict[str, dict] = {
    "cifar10": {"limit": 2000, "attack_batch_size": 1000,
                "protocols": ("rotation", "pgd", "corruption", "occlusion", "shuffle", "apgd", "autoattack",
                              "square", "transfer", "masking")},
    "fashion_mnist": {"limit": None, "attack_batch_size": 1000, "autoattack_eps": (8 / 255,), "apgd_eps": (2 / 255, 4 / 255),
                      "protocols": ("rotation", "pgd", "corruption", "apgd", "autoattack", "square", "transfer",
                                    "masking")},
}


def list_presets() -> list[str]:
    return [*PRESETS, "full"]


def preset_values(name: str, dataset: str) -> dict:
    """The config values of preset ``name`` for ``dataset``; errors name the presets there are."""
    if name == "full":
        if dataset not in FULL:
            raise ValueError(f"--preset full is the committed report's study and there is none for {dataset!r} "
                             f"(there are: {', '.join(FULL)}); give the sizes as options or in a study config")
        return dict(FULL[dataset])
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; the presets are {', '.join(list_presets())}")
    from robust_attn.study.batches import preset_batches

    return preset_batches(PRESETS[name], dataset)   # batch sizes sized at 32 px, capped at larger ones
