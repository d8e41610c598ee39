"""Study configs: ``robust-attn study CONFIG.toml``.

A study config is a TOML file naming the models (any model spec of :mod:`robust_attn.sources`),
the dataset and the protocols; every other key is a field of
:class:`robust_attn.study.config.StudyConfig` with the same name and meaning::

    dataset = "imagenet"                 # required
    root = "data"                        # data root (default: --root, $ROBUST_ATTN_DATA or ./data)
    split = "test"                       # ImageNet: "test" is val-original (the 50,000 val images)
    limit = 1000                         # a fixed-seed subset (default: every image)
    protocols = ["rotation", "pgd"]      # robust-attn study --help lists them
    baseline = "torchvision-resnet50"    # the convolutional reference of the findings: a model's label
    autoattack_eps = ["8/255"]           # radii in image units: "8/255" or 0.0314 (docs/eps.md)

    models = ["timm:resnet26t", "torchvision:resnet50:IMAGENET1K_V1"]   # spec strings, or tables:

    [[models]]
    spec = "san-official:checkpoints/san10_pairwise.pth:san10_pairwise"
    label = "san10_pairwise"             # default: robust_attn.sources.spec_label(spec)
    # checkpoint = "FILE"                # a weights file for the spec (as --checkpoint)
    # model_args = { pretrained = false }   # as --model-args

(``models = [...]`` and ``[[models]]`` tables are two ways to write the same list; use one.)
Paths are read as on the command line: relative to the folder the command runs in. Loading
validates everything it can without building a model: unknown keys (with the closest valid
key), types, values (:class:`~robust_attn.study.config.StudyConfig`'s checks), spec syntax and
sources, distinct labels, and a ``baseline`` that names one of the models. Each error names
the file and the key to fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser from PyPI (a dependency there)
    import tomli as tomllib

from robust_attn.protocols.settings import study_fields
from robust_attn.protocols.study_step import STUDY_PROTOCOLS, default_study_protocols, list_study_protocols

__all__ = ["StudyConfig", "StudySettings", "study_config_class", "protocol_settings", "protocol_fields", "StudyModel",
           "StudyConfigError", "load_study_config", "read_study_toml", "study_config_from_dict", "LABEL_PATTERN"]

#: what a label may hold: it names run folders and the transfer conditions (``attack.label``)
LABEL_PATTERN = re.compile(r"[A-Za-z0-9_+-]+")


class StudyConfigError(ValueError):
    """A study config that cannot be used; the message names the file, the key and the fix."""


@dataclass(frozen=True)
class StudyModel:
    """One model of a study: a model spec (:mod:`robust_attn.sources`) and its options.

    ``checkpoint``: a weights file for the spec (the CLI's ``--checkpoint``); ``model_args``: the
    constructor's keyword arguments (``--model-args``); ``label``: the model's name in run
    folders and report rows (default :func:`robust_attn.sources.spec_label`)."""

    spec: str
    checkpoint: str | None = None
    model_args: dict = field(default_factory=dict)
    label: str | None = None

    def __post_init__(self):
        from robust_attn.sources import check_spec

        if not isinstance(self.spec, str) or not self.spec.strip():
            raise ValueError(f"a study model needs a spec string, got {self.spec!r}")
        check_spec(self.spec)   # SourceError (a ValueError): unknown source, a missing file ...
        if self.checkpoint is not None and not isinstance(self.checkpoint, str):
            raise ValueError(f"model {self.spec!r}: checkpoint must be a path string, got {self.checkpoint!r}")
        if not isinstance(self.model_args, dict):
            raise ValueError(f"model {self.spec!r}: model_args must be a table, e.g. {{ pretrained = false }}")
        if self.label is not None and not (isinstance(self.label, str) and LABEL_PATTERN.fullmatch(self.label)):
            raise ValueError(f"model {self.spec!r}: label {self.label!r} may hold only letters, digits, _, + and - "
                             f"(it names run folders)")

    @property
    def name(self) -> str:
        from robust_attn.sources import spec_label

        return self.label or spec_label(self.spec)




@dataclass(frozen=True)
class StudySettings:
    """The study's own settings, shared by its protocols; :class:`StudyConfig` adds every field of
    every registered protocol's settings (:mod:`robust_attn.protocols.settings`)."""

    dataset: str = "fashion_mnist"
    split: str = "test"
    limit: int | None = None           # None: the whole split
    models: tuple[str | StudyModel, ...] = ()   # zoo entry names or StudyModels; empty: one per architecture
    root: str | None = None            # data root (None: run_study's root, $ROBUST_ATTN_DATA or ./data)
    batch_size: int | None = None      # None: the default of the dataset's resolution (robust_attn.study.batches)
    seed: int = 0                      # attack targets
    bootstrap: int = 1000
    baseline: str = "resnet26"         # the convolutional reference of the findings
    protocols: tuple[str, ...] = field(default_factory=default_study_protocols)   # the report covers what ran
    attack_limit: int | None = 1000    # the seeded subset of the attack protocols (apgd, autoattack, square, transfer)
    attack_batch_size: int | None = None   # None: as batch_size
    shift_seed: int = 0                # per-image corruptions, occlusions and permutations

    def __post_init__(self):
        from robust_attn.study.batches import default_batches

        for key, default in vars(default_batches(self.dataset)).items():   # by the dataset's image size
            if getattr(self, key) is None:
                object.__setattr__(self, key, default)
        if self.split not in ("train", "val", "test"):
            raise ValueError(f"split must be train, val or test, got {self.split!r}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be positive (or None for the whole split), got {self.limit}")
        if self.batch_size < 1 or self.bootstrap < 1:
            raise ValueError("batch_size and bootstrap must be positive")
        known = list_study_protocols()
        if not self.protocols or set(self.protocols) - set(known):
            raise ValueError(f"protocols must be a non-empty subset of {', '.join(known)}, got "
                             f"{', '.join(self.protocols) or 'none'}")
        if self.attack_limit is not None and self.attack_limit < 1:
            raise ValueError(f"attack_limit must be positive (or None for every image), got {self.attack_limit}")
        if self.attack_batch_size < 1:
            raise ValueError(f"attack_batch_size must be positive, got {self.attack_batch_size}")
        if any(not isinstance(m, (str, StudyModel)) for m in self.models):
            raise ValueError("models must be zoo entry names or StudyModel(spec, ...) entries")
        names = [m if isinstance(m, str) else m.name for m in self.models]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"two models are named {', '.join(twice)}: give each a distinct label")
        from robust_attn.data import dataset_info, list_datasets

        if self.dataset not in list_datasets():
            dataset_info(self.dataset)   # the unknown-dataset error, with the names it could have meant
        for settings in protocol_settings():
            if all(hasattr(self, f.name) for f in study_fields(settings)):   # (registered after this class)
                settings.of(self).check(self)

    def describe(self) -> dict:
        return asdict(self)


def protocol_settings() -> list[type]:
    """The settings class of every registered protocol that has one, in registration order."""
    return [step.settings for _, step in STUDY_PROTOCOLS.items() if step.settings is not None]


def protocol_fields() -> list[dataclasses.Field]:
    """The fields the protocols add to the study config: each name once (a field two protocols
    share, from a common settings class, is one field); a name the study itself has is an error."""
    own = {f.name for f in dataclasses.fields(StudySettings)}
    out: dict[str, dataclasses.Field] = {}
    for settings in protocol_settings():
        for f in study_fields(settings):
            if f.name in own:
                raise ValueError(f"{settings.__name__}.{f.name} is a setting of the study itself; rename it")
            if f.name in out and (out[f.name].default, out[f.name].type, out[f.name].metadata.get("radius")) != \
                    (f.default, f.type, f.metadata.get("radius")):
                raise ValueError(f"two protocols declare the setting {f.name!r} differently")
            out.setdefault(f.name, f)
    return list(out.values())


def _study_config() -> type:
    extra = [(f.name, f.type, field(default=f.default, metadata=f.metadata)) for f in protocol_fields()]
    cls = dataclasses.make_dataclass("StudyConfig", extra, bases=(StudySettings,), frozen=True)
    cls.__module__ = __name__
    cls.__doc__ = ("What the study runs: :class:`StudySettings` and every registered protocol's settings "
                   "(radii in image units, docs/eps.md).")
    return cls


_CLASSES: dict[tuple[str, ...], type] = {}


def study_config_class() -> type:
    """The study config class for the protocols registered now: :data:`StudyConfig`, or, once a
    protocol with settings was registered from outside :mod:`robust_attn.protocols` after it was
    made, a class with that protocol's fields too."""
    key = tuple(f.name for f in protocol_fields())
    if key not in _CLASSES:
        _CLASSES[key] = _study_config()
    return _CLASSES[key]


#: what a study runs; its fields: :class:`StudySettings` and the registered protocols' settings
StudyConfig = study_config_class()


def read_study_toml(path: str | Path) -> dict:
    """The raw table of a study config file; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise StudyConfigError(f"study config {path} does not exist; give a TOML file (e.g. zoo/studies/"
                               f"imagenet.toml), or --dataset NAME for every zoo model of a dataset")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise StudyConfigError(f"study config {path} is not valid TOML: {err}") from None


def load_study_config(path: str | Path, overrides: dict | None = None):
    """:class:`~robust_attn.study.config.StudyConfig` from the TOML file ``path`` (module docstring);
    ``overrides`` (config keys, e.g. the command line's ``--limit``) replace the file's values."""
    return study_config_from_dict({**read_study_toml(path), **(overrides or {})}, where=str(path))


def _field_value(key: str, value, annotation: str, where: str, radius: str | None = None):
    """``value`` checked against the StudyConfig field's annotation (``int``, ``float | None``,
    ``tuple[float, ...]``, ``tuple[str, ...]``, ...) and converted to it; a radius field takes
    numbers and ``"8/255"`` strings, in image units (:mod:`robust_attn.utils.radius`)."""
    def wrong(expected: str) -> StudyConfigError:
        return StudyConfigError(f"{where}: {key} must be {expected}, got {type(value).__name__} {value!r}")

    if radius is not None:
        from robust_attn.utils.radius import RadiusError, parse_radius

        norm = radius if radius in ("linf", "l2") else "linf"
        many = annotation.startswith("tuple")
        items = value if many and isinstance(value, list) else [value]
        if (many and not isinstance(value, list)) or any(not isinstance(v, (int, float, str)) for v in items):
            raise wrong("a list of radii (8/255 as a string, or numbers in image units)" if many else
                        "a radius (8/255 as a string, or a number in image units)")
        try:
            radii = tuple(parse_radius(v, key, norm) for v in items)
        except RadiusError as err:
            raise StudyConfigError(f"{where}: {err}") from None
        return radii if many else radii[0]

    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)   # noqa: E731
    base = annotation.replace(" | None", "").strip()
    if base.startswith("tuple"):
        item = base[base.index("[") + 1:].split(",")[0].strip()
        ok, kind = {"float": (number, "numbers"),
                    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "integers")}.get(
            item, (lambda v: isinstance(v, str), "strings"))
        if not isinstance(value, list) or not all(ok(v) for v in value):
            raise wrong(f"a list of {kind}")
        return tuple(float(v) if item == "float" else v for v in value)
    if base == "float":
        if not number(value):
            raise wrong("a number")
        return float(value)
    if base == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise wrong("an integer")
    if base == "str" and not isinstance(value, str):
        raise wrong("a string")
    return value


def _model(item, index: int, where: str) -> StudyModel:
    here = f"{where}: models[{index}]"
    if isinstance(item, str):
        item = {"spec": item}
    if not isinstance(item, dict):
        raise StudyConfigError(f"{here} must be a spec string or a table with spec (and checkpoint, model_args, "
                               f"label), got {item!r}")
    known = [f.name for f in dataclasses.fields(StudyModel)]
    unknown = sorted(set(item) - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        raise StudyConfigError(f"{here}: unknown key {unknown[0]!r}.{f' Did you mean {close[0]!r}?' if close else ''} "
                               f"A model takes {', '.join(known)}")
    if "spec" not in item:
        raise StudyConfigError(f"{here} has no spec; e.g. spec = \"timm:resnet26t\"")
    try:
        return StudyModel(**item)
    except ValueError as err:
        raise StudyConfigError(f"{here}: {err}") from None


def study_config_from_dict(raw: dict, where: str = "study config"):
    """Validate a study config given as a dict (what the TOML file holds)."""

    config_class = study_config_class()
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            raise StudyConfigError(f"{where}: unknown key {key!r}.{f' Did you mean {close[0]!r}?' if close else ''} "
                                   f"Valid keys: {', '.join(sorted(fields))}")
        if key == "models":
            if not isinstance(value, list) or not value:
                raise StudyConfigError(f"{where}: models must be a non-empty list of spec strings or [[models]] "
                                       f"tables")
            kwargs[key] = tuple(_model(item, i, where) for i, item in enumerate(value))
        else:
            kwargs[key] = _field_value(key, value, str(fields[key].type), where, fields[key].metadata.get("radius"))
    for required in ("dataset", "models"):
        if required not in kwargs:
            raise StudyConfigError(f"{where} lacks {required!r}: name the dataset (e.g. dataset = \"imagenet\") and "
                                   f"the models (models = [\"timm:resnet26t\", ...])")
    try:
        config = config_class(**kwargs)
    except ValueError as err:
        raise StudyConfigError(f"{where}: {err}") from None
    names = [m.name for m in config.models]
    if config.baseline not in names:
        raise StudyConfigError(f"{where}: baseline = {config.baseline!r} names none of the models; set it to one "
                               f"of their labels: {', '.join(names)}")
    return config
