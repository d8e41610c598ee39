"""Training recipes: TOML files loaded into a validated, frozen :class:`Recipe`.

A recipe is flat settings plus three tables::

    inherit = "imagenet_san.toml"   # optional: a base recipe, path relative to this file
    model = "resnet26"               # a name from robust_attn.list_models()
    model_args = { width = 0.25 }    # overrides passed to create_model
    dataset = "imagenet"             # a name from robust_attn.data.list_datasets()
    epochs = 100
    seed = 0
    [data]     root, batch_size (global), eval_batch_size, workers, holdout, eval_split, limits
    [optim]    lr (at base_batch), base_batch, momentum, nesterov, weight_decay, ...
    [runtime]  device, amp, channels_last, compile
    [adversarial]  method, eps, steps, step, eps_warmup_epochs, trades_beta, guard settings
                   (adversarial training, robust_attn.train.adversarial; absent: standard training)

``inherit`` chains are merged table by table (the child wins), so a family's recipe states only
what differs from the base it names. Command-line overrides use dotted keys
(``optim.lr=0.05 epochs=2``) and are applied last. Loading validates everything it can without
training: unknown keys (with the closest valid key), types, a model the registry lacks, a
dataset whose files are not where ``data.root`` says.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser from PyPI (a dependency there)
    import tomli as tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = ["Recipe", "DataConfig", "OptimConfig", "RuntimeConfig", "AdversarialConfig", "RecipeError", "load_recipe",
           "recipe_from_dict", "parse_overrides"]


class RecipeError(ValueError):
    """A recipe that cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class DataConfig:
    root: str | None = None           # data root (default: $ROBUST_ATTN_DATA or ./data)
    batch_size: int = 256             # global batch, split evenly over the processes
    eval_batch_size: int = 256        # per process
    workers: int = 4                  # DataLoader workers per process
    augment: bool = True              # the dataset's training augmentation (see robust_attn.data.transforms)
    holdout: bool = False             # exclude SAN's held-out "val" images from training
    eval_split: str = "test"          # evaluated after every epoch: "test" or "val"
    limit_train: int | None = None    # train on a fixed random subset (smoke runs)
    limit_eval: int | None = None
    translate: int | None = None      # random translation in pixels (zero padding); None: the dataset's
    flip: str = "random"              # "random", "alternating" (airbench) or "none"; with augment only


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 0.1                   # learning rate at base_batch; scaled by batch_size / base_batch
    base_batch: int = 256
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4
    no_decay_norm_bias: bool = False  # no weight decay on biases and normalization weights
    label_smoothing: float = 0.0
    schedule: str = "cosine"          # "cosine" or "step"
    warmup_epochs: float = 0.0        # linear warm-up from 0, per step
    min_lr: float = 0.0               # cosine floor, as a fraction of the peak learning rate
    milestones: tuple[float, ...] = ()  # "step": epochs at which the rate is multiplied by gamma
    gamma: float = 0.1
    clip_grad_norm: float = 0.0       # 0: no clipping
    bias_lr_scale: float = 1.0        # learning-rate multiplier of the biases (airbench: 64)
    ema_decay: float = 0.0            # per-step decay of the weight average evaluated and saved; 0: none
    ema_every: int = 1                # update the average every this many steps


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = "auto"              # "auto" (cuda if available), "cpu", "cuda"
    amp: str = "none"                 # "none", "bf16", "fp16" (autocast; GradScaler for fp16), or "auto":
                                      # bf16 where the device has it in hardware, else none
    channels_last: bool = False
    compile: bool = False             # torch.compile the model
    deterministic: bool = False       # torch.use_deterministic_algorithms (slower on GPU)


ADVERSARIAL_METHODS = ("none", "fgsm", "pgd", "trades")


@dataclass(frozen=True)
class AdversarialConfig:
    """Adversarial training (robust_attn.train.adversarial). ``eps`` and ``step`` are L-inf radii
    in [0, 1] image units; in TOML a number or a fraction string such as "8/255"."""
    method: str = "none"              # "fgsm" (with random start), "pgd", "trades"; "none": standard training
    eps: float = 8 / 255
    steps: int | None = None          # attack iterations; None: 1 for fgsm, 10 for pgd and trades
    step: float | None = None         # step size; None: 1.25 eps for fgsm (Wong et al.), eps / 4 otherwise
    eps_warmup_epochs: float = 0.0    # eps (and step) ramp linearly from 0 over these epochs, per step
    trades_beta: float = 6.0          # TRADES's 1/lambda (Zhang et al. 2019, eq. 5)
    guard_images: int = 1000          # training images held out for the overfitting guard (0: no guard)
    guard_steps: int = 10             # PGD steps of the guard
    guard_collapse: float = 0.5       # stop when guard accuracy falls below this fraction of its best


@dataclass(frozen=True)
class Recipe:
    model: str
    dataset: str
    epochs: int
    model_args: dict = field(default_factory=dict)
    seed: int = 0
    description: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    adversarial: AdversarialConfig = field(default_factory=AdversarialConfig)
    source: str = ""                  # the file it was loaded from (not part of the hash)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("source")
        out["optim"]["milestones"] = list(out["optim"]["milestones"])
        for section, key in _LATER_KEYS:  # at their defaults they change nothing: keep older hashes
            if out[section][key] == _LATER_KEYS[(section, key)]:
                del out[section][key]
        if self.adversarial == AdversarialConfig():
            del out["adversarial"]
        return out

    def sha256(self) -> str:
        """Hash of the resolved settings (after inheritance and overrides), canonical JSON."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def lr_at(self, global_batch: int | None = None) -> float:
        """Peak learning rate by the linear scaling rule (Goyal et al. 2017)."""
        return self.optim.lr * (global_batch or self.data.batch_size) / self.optim.base_batch


_SECTIONS = {"data": DataConfig, "optim": OptimConfig, "runtime": RuntimeConfig, "adversarial": AdversarialConfig}
# Keys added after recipes were first hashed, with the default at which they are left out of
# to_dict(), so that a run started before they existed still resumes (its hash is unchanged).
_LATER_KEYS = {("data", "translate"): None, ("data", "flip"): "random", ("optim", "bias_lr_scale"): 1.0,
               ("optim", "ema_decay"): 0.0, ("optim", "ema_every"): 1}
_CHOICES = {("adversarial", "method"): ADVERSARIAL_METHODS, ("optim", "schedule"): ("cosine", "step", "linear"),
            ("data", "flip"): ("random", "alternating", "none"),
            ("runtime", "amp"): ("none", "bf16", "fp16", "auto"), ("runtime", "device"): ("auto", "cpu", "cuda"),
            ("data", "eval_split"): ("test", "val")}


def _merge(base: dict, child: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read_toml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in seen:
        raise RecipeError(f"recipe {path} inherits itself (chain: {' -> '.join(map(str, seen + (path,)))})")
    if not path.is_file():
        raise RecipeError(f"recipe {path} does not exist" + (f" (inherited by {seen[-1]})" if seen else ""))
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise RecipeError(f"recipe {path} is not valid TOML: {err}") from err
    parent = raw.pop("inherit", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise RecipeError(f"{path}: inherit must be a file name, got {parent!r}")
    return _merge(_read_toml(path.parent / parent, seen + (path,)), raw)


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word such as model=resnet26


def parse_overrides(items: Sequence[str]) -> dict:
    """``["optim.lr=0.05", "epochs=2", "model_args.width=0.5"]`` -> a nested dict."""
    out: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"override {item!r} is not KEY=VALUE (e.g. optim.lr=0.05 or epochs=2)")
        parts = key.strip().split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {item!r} conflicts with another override of {part}")
        node[parts[-1]] = _parse_value(text.strip())
    return out


def _unknown(key: str, valid: Sequence[str], where: str) -> RecipeError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return RecipeError(f"unknown recipe key {where}{key!r}.{hint} Valid keys: {', '.join(sorted(valid))}.")


def _fraction(text: str, where: str) -> float:
    """``"8/255"`` -> 8/255: a radius in image units, read as every command and config reads one
    (:func:`robust_attn.utils.radius.parse_radius`)."""
    from robust_attn.utils.radius import RadiusError, parse_radius

    try:
        return parse_radius(text, f"recipe key {where}")
    except RadiusError as err:
        raise RecipeError(f"{err} (a number or a fraction such as \"8/255\")") from None


def _check_type(value: Any, annotation: str, where: str) -> Any:
    kinds = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "dict": (dict,)}
    optional = "None" in annotation
    if value is None:
        if optional:
            return None
        raise RecipeError(f"recipe key {where} may not be empty")
    base = annotation.replace(" | None", "").strip()
    if base.startswith("tuple"):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                          for v in value):
            raise RecipeError(f"recipe key {where} must be a list of numbers, got {value!r}")
        return tuple(float(v) for v in value)
    ok = kinds[base]
    if isinstance(value, bool) and base != "bool" or not isinstance(value, ok):
        raise RecipeError(f"recipe key {where} must be {base}, got {type(value).__name__} {value!r}")
    return float(value) if base == "float" else value


def _build(cls, raw: dict, where: str):
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            raise _unknown(key, list(fields) + (["inherit"] if not where else []), where)
        if key in _SECTIONS and not where:
            if not isinstance(value, dict):
                raise RecipeError(f"recipe key {key!r} must be a table ([{key}])")
            kwargs[key] = _build(_SECTIONS[key], value, f"{key}.")
            continue
        if where == "adversarial." and key in ("eps", "step") and isinstance(value, str):
            value = _fraction(value, where + key)
        kwargs[key] = _check_type(value, str(fields[key].type), where + key)
        if (where.rstrip("."), key) in _CHOICES and kwargs[key] not in _CHOICES[(where.rstrip("."), key)]:
            raise RecipeError(f"recipe key {where}{key} = {value!r}; choose one of "
                              f"{_CHOICES[(where.rstrip('.'), key)]}")
    missing = [name for name, f in fields.items() if f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING and name not in kwargs]
    if missing:
        raise RecipeError(f"recipe lacks required key(s) {', '.join(where + m for m in missing)}")
    return cls(**kwargs)


def recipe_from_dict(raw: dict, source: str = "", check_data: bool = True) -> Recipe:
    """Validate a recipe given as a dict (what a TOML file holds after inheritance)."""
    recipe = dataclasses.replace(_build(Recipe, raw, ""), source=source)
    _validate(recipe, check_data)
    return recipe


def load_recipe(path: str | Path, overrides: Sequence[str] | dict = (), check_data: bool = True) -> Recipe:
    """Load ``path`` (following ``inherit``), apply ``overrides``, validate; see the module docstring.

    ``check_data=False`` skips looking for the dataset's files (e.g. to print a recipe).
    """
    raw = _read_toml(Path(path))
    extra = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
    raw = _merge(raw, extra)
    return recipe_from_dict(raw, source=str(path), check_data=check_data)


def _validate_adversarial(a: AdversarialConfig, epochs: int) -> None:
    where = "[adversarial]"
    if a.method == "none":
        if a != AdversarialConfig():
            raise RecipeError(f"{where} has settings but method = \"none\" (standard training); set method to one "
                              f"of {', '.join(ADVERSARIAL_METHODS[1:])} or remove the table")
        return
    if not 0 < a.eps <= 1:
        raise RecipeError(f"{where} eps must be in (0, 1] image units (e.g. \"8/255\"), got {a.eps}; "
                          f"{a.eps:g} in 1/255 units is \"{a.eps:g}/255\"")
    if a.steps is not None and a.steps < 1:
        raise RecipeError(f"{where} steps must be at least 1 (or unset for the method's default), got {a.steps}")
    if a.method == "fgsm" and a.steps not in (None, 1):
        raise RecipeError(f"{where} method \"fgsm\" takes one step (steps = 1 or unset); for more use "
                          f"method = \"pgd\"")
    if a.step is not None and not 0 < a.step <= 2 * a.eps:
        raise RecipeError(f"{where} step must be in (0, 2 eps] (default: 1.25 eps for fgsm, eps / 4 otherwise), "
                          f"got {a.step}")
    if not 0 <= a.eps_warmup_epochs <= epochs:
        raise RecipeError(f"{where} eps_warmup_epochs must be in [0, epochs = {epochs}], got {a.eps_warmup_epochs}")
    if a.trades_beta <= 0:
        raise RecipeError(f"{where} trades_beta must be positive (Zhang et al. use 6), got {a.trades_beta}")
    if a.guard_images < 0 or a.guard_steps < 1 or not 0 <= a.guard_collapse < 1:
        raise RecipeError(f"{where} guard_images >= 0 (0: no guard), guard_steps >= 1 and 0 <= guard_collapse < 1 "
                          f"(0: never stop); got {a.guard_images}, {a.guard_steps}, {a.guard_collapse}")


def _validate(recipe: Recipe, check_data: bool) -> None:
    from robust_attn.data import dataset_info, locate_dataset
    from robust_attn.models.registry import list_models

    models = list_models()
    if recipe.model not in models:
        close = difflib.get_close_matches(recipe.model, models, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise RecipeError(f"recipe model {recipe.model!r} is not in the registry.{hint} "
                          f"`robust-attn zoo list` shows the {len(models)} architectures.")
    try:
        info = dataset_info(recipe.dataset)
    except ValueError as err:
        raise RecipeError(f"recipe dataset: {err}") from err
    if recipe.epochs < 1:
        raise RecipeError(f"epochs must be at least 1, got {recipe.epochs}")
    d, o = recipe.data, recipe.optim
    for name, value in [("data.batch_size", d.batch_size), ("data.eval_batch_size", d.eval_batch_size),
                        ("optim.base_batch", o.base_batch)]:
        if value < 1:
            raise RecipeError(f"{name} must be positive, got {value}")
    if d.workers < 0:
        raise RecipeError(f"data.workers must be 0 (load in the main process) or more, got {d.workers}")
    for name, value in [("data.limit_train", d.limit_train), ("data.limit_eval", d.limit_eval)]:
        if value is not None and value < 1:
            raise RecipeError(f"{name} must be at least 1, or unset for the whole split; got {value}")
    if o.lr <= 0 or not 0 <= o.label_smoothing < 1 or o.weight_decay < 0 or not 0 <= o.momentum < 1:
        raise RecipeError(f"optim settings out of range: lr {o.lr} > 0, 0 <= label_smoothing {o.label_smoothing} < 1, "
                          f"weight_decay {o.weight_decay} >= 0, 0 <= momentum {o.momentum} < 1")
    if o.nesterov and o.momentum == 0:
        raise RecipeError("optim.nesterov needs optim.momentum > 0")
    if o.warmup_epochs < 0 or o.min_lr < 0 or o.clip_grad_norm < 0:
        raise RecipeError("optim.warmup_epochs, optim.min_lr and optim.clip_grad_norm must not be negative")
    if o.bias_lr_scale <= 0:
        raise RecipeError(f"optim.bias_lr_scale must be positive (1: the biases train at the common rate), "
                          f"got {o.bias_lr_scale}")
    if not 0 <= o.ema_decay < 1 or o.ema_every < 1:
        raise RecipeError(f"optim.ema_decay must be in [0, 1) (0: no weight average; e.g. 0.999) and "
                          f"optim.ema_every at least 1; got {o.ema_decay} and {o.ema_every}")
    if d.translate is not None and d.translate < 0:
        raise RecipeError(f"data.translate must be 0 or more pixels, or unset for the dataset's; got {d.translate}")
    if (d.translate is not None or d.flip != "random") and not d.augment:
        raise RecipeError("data.translate and data.flip set the training augmentation; they need data.augment = true")
    _validate_adversarial(recipe.adversarial, recipe.epochs)
    if o.schedule == "step" and not o.milestones:
        raise RecipeError('optim.schedule = "step" needs optim.milestones (epochs), e.g. [30, 60, 90]')
    if d.eval_split == "val" and not d.holdout:
        raise RecipeError('data.eval_split = "val" evaluates on held-out training images; set data.holdout = true '
                          'so that they are not also trained on')
    if "val" not in info.splits and d.holdout:
        raise RecipeError(f"dataset {recipe.dataset} has no val split; set data.holdout = false")
    if check_data:
        try:
            locate_dataset(recipe.dataset, d.root, split="train")
            locate_dataset(recipe.dataset, d.root, split="test" if d.eval_split == "test" else "train")
        except FileNotFoundError as err:
            raise RecipeError(f"recipe {recipe.source or ''}: {err}") from err
