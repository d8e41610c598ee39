"""The models of a study (:mod:`robust_attn.study.run`): which, loaded from their specs, and the
images each is evaluated on.

Every model is loaded through its spec (:mod:`robust_attn.sources`; a zoo entry as
``zoo:NAME``) and gets the study's images through its own preprocessing
(:mod:`robust_attn.sources.inputs`): the same fixed-seed subset for every model, resized and
cropped as its weights expect, built once per distinct preprocessing. The steps that compare
models on the same tensors (``per_model=False``) need one preprocessing for all.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from robust_attn.study.config import StudyModel

__all__ = ["StudyEntry", "study_models", "default_zoo_models", "missing_zoo_models", "missing_zoo_message",
           "load_models", "model_inputs"]


@dataclass
class StudyEntry:
    """A loaded model of the study, as the protocol steps get it (``entry``): ``name`` labels its
    run folders and report rows; ``description`` says where it came from (run.json)."""

    name: str
    description: dict


def _architecture(entry) -> str:
    return (entry.arch or {}).get("name") or (entry.torchvision or {}).get("model") or entry.name


def default_zoo_models(entries) -> tuple[list[str], list[str]]:
    """The zoo entries a study without ``models`` covers, and those it leaves out, by name in
    manifest order: one model per architecture, the entry named after it (``resnet26``, not
    ``resnet26-efficient`` or ``resnet26-adv``: the other versions of a family are studied by a
    config that names them, e.g. ``zoo/studies/cifar10_efficient.toml``); an architecture without
    such an entry (a user's own names) keeps every entry of it."""
    named_after = {e.name for e in entries if e.name == _architecture(e)}
    chosen = [e.name for e in entries if e.name in named_after or _architecture(e) not in named_after]
    return chosen, [e.name for e in entries if e.name not in chosen]


def study_models(config, manifest, log=None) -> list[StudyModel]:
    """The models the study covers: ``config.models`` (a zoo entry name becomes ``zoo:NAME``), or
    the dataset's zoo entries of :func:`default_zoo_models` (``log`` says which it leaves out); a
    named zoo model the zoo lacks is an error that lists what it has."""
    zoo_names = [m for m in config.models if isinstance(m, str)]
    if config.models and not zoo_names:
        return list(config.models)
    have = [e for e in manifest.entries.values() if e.dataset == config.dataset]
    if not have:
        raise ValueError(f"the zoo at {manifest.path} has no model trained on {config.dataset!r}; train one "
                         f"(zoo/recipes) and register it with `robust-attn zoo add`")
    by_name = {e.name: e for e in have}
    unknown = [m for m in zoo_names if m not in by_name]
    if unknown:
        raise ValueError(f"no zoo model {unknown} for {config.dataset!r}; the zoo has {sorted(by_name)}")
    chosen = config.models
    if not chosen:
        chosen, left = default_zoo_models(have)
        if left and log is not None:
            log(f"study: {len(chosen)} of the {len(have)} {config.dataset} zoo entries, one per architecture (the "
                f"entry named after it); left out: {', '.join(left)} (name them with --models, or use a study "
                f"config such as zoo/studies/)")
    return [StudyModel(f"zoo:{m}", label=m) if isinstance(m, str) else m for m in chosen]


def missing_zoo_models(chosen: list[StudyModel], manifest, dataset: str) -> list[str]:
    """The zoo entries (``zoo:NAME`` specs) among ``chosen`` that ``manifest`` lacks for ``dataset``."""
    from robust_attn.sources import parse_spec

    named = [parse_spec(m.spec) for m in chosen]
    return [target for source, target in named if source == "zoo" and (target, dataset) not in manifest.entries]


def missing_zoo_message(missing: list[str], chosen: list[StudyModel], manifest, dataset: str) -> str:
    """What to do when the zoo lacks some of the study's models (:func:`missing_zoo_models`)."""
    have = sorted(name for name, d in manifest.entries if d == dataset)
    return (f"the zoo at {manifest.path} has no {dataset} entry for {len(missing)} of the study's {len(chosen)} "
            f"models: {', '.join(missing)}. Train each with its recipe (`robust-attn train zoo/recipes/RECIPE.toml "
            f"model=ARCH ...`) and register it under that name (`robust-attn zoo add NAME --dataset {dataset} "
            f"--checkpoint FILE`), or leave them out of the study (--models LABEL,...). Its {dataset} entries: "
            f"{', '.join(have) or 'none'}")


def load_models(chosen: list[StudyModel], info, device, manifest, seed: int, log) -> dict:
    """name -> LoadedModel of every study model (errors name the model and the fix; every zoo
    model the manifest lacks is named at once, before any model is loaded)."""
    from robust_attn.sources import load_model_spec

    missing = missing_zoo_models(chosen, manifest, info.name)
    if missing:
        raise ValueError(missing_zoo_message(missing, chosen, manifest, info.name))
    loaded = {}
    for i, m in enumerate(chosen, start=1):
        log(f"[{i}/{len(chosen)}] {m.name}: loading {m.spec}")
        try:
            loaded[m.name] = load_model_spec(m.spec, dataset_info=info, checkpoint=m.checkpoint,
                                             model_args=m.model_args, seed=seed, device=str(device),
                                             manifest=str(manifest.path))
        except ValueError as err:
            raise ValueError(f"study model {m.name} ({m.spec}): {err}") from None
    return loaded


def model_inputs(config, root, loaded: dict, across: list) -> dict:
    """name -> (dataset, attack_dataset, applied preprocessing): the study's images through each
    model's preprocessing, built once per distinct preprocessing. ``across`` (steps comparing
    models on the same images) is refused when the models' preprocessing differ."""
    from robust_attn.sources.inputs import model_dataset, same_preprocessing

    built, out = {}, {}
    for name, model in loaded.items():
        key = json.dumps(model.preprocessing.as_dict() if model.preprocessing else None, sort_keys=True)
        if key not in built:
            dataset, applied = model_dataset(config.dataset, model.preprocessing, root=root, split=config.split,
                                             limit=config.limit)
            attack_limit = min(x for x in (config.limit, config.attack_limit, len(dataset)) if x is not None)
            attack_dataset = dataset if attack_limit >= len(dataset) else model_dataset(
                config.dataset, model.preprocessing, root=root, split=config.split, limit=attack_limit)[0]
            built[key] = (dataset, attack_dataset, applied)
        out[name] = built[key]
    if across:
        same_preprocessing({name: applied for name, (_, _, applied) in out.items()},
                           f"protocols {', '.join(s.name for s in across)} compare the models on the same images",
                           "leave them out of protocols, or study the models of one preprocessing together")
    return out
