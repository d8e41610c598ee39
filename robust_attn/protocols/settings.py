"""A protocol's settings in a study: a frozen dataclass of its own, registered with its study step.

    >>> @dataclass(frozen=True)
    ... class RotationSettings(ProtocolSettings):
    ...     angle_step: float = setting(30.0, "rotation sweep every this many degrees, 0 for none")
    ...
    ...     def check(self, study) -> None:
    ...         if not 0 <= self.angle_step < 360:
    ...             raise ValueError(...)
    >>> @study_protocol("rotation", settings=RotationSettings)

The study's config (:class:`robust_attn.study.config.StudyConfig`) has a field for every field of
every registered protocol's settings (same name, type and default), so a study TOML file and
``robust-attn study --angle-step 15`` set it; :func:`add_options` builds the command line's
options from the fields (``--angle-step``; a tuple field is a comma list), with their ``help``;
the study checks its config with each protocol's :meth:`ProtocolSettings.check`. Field names
are shared by every protocol: a field two protocols declare (e.g. from a common base class)
must be the same field.

The same dataclass makes the protocol's ``robust-attn eval NAME`` options
(:mod:`robust_attn.protocols.eval_step`), so the study and ``eval`` have one default per
setting. A field only one of them has says so (``scope``); ``eval`` may name an option
differently (``eval_option``: ``eval occlusion --areas`` for the study's ``occlusion_areas``).
A radius field (``radius=``) is in image units everywhere: ``8/255`` or a float
(:mod:`robust_attn.utils.radius`).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

__all__ = ["ProtocolSettings", "setting", "add_options", "given_options", "option_name", "field_option",
           "field_default", "field_norm", "is_eval", "study_fields", "eval_fields", "study_image_size", "SCOPES"]


#: where a settings field is an option: in the study and ``eval`` (``both``), or in one of them
SCOPES = ("both", "eval", "study")


def setting(default: Any, help: str | Callable[[], str], *, choices: Sequence[str] | None = None, scope: str = "both",
            eval_option: str | None = None, radius: str | None = None, repeat: bool = False):
    """A settings field: its default (the one default of the study and of ``eval``), the help of
    its command-line option (or a function making it when the parser is built, e.g. from a
    registry) and (optional) the values it may take.

    ``scope``: ``"both"`` (a field of the study config and an option of ``eval NAME``), ``"eval"``
    (only ``eval NAME``: a choice the study makes for every model, named in the help) or
    ``"study"``. ``eval_option``: the option's name in ``eval NAME`` where it is not the field's
    (e.g. ``areas`` for ``occlusion_areas``: the study's fields are shared by every protocol and
    carry the protocol's name). ``radius``: the field holds attack radii in image units, read by
    :func:`robust_attn.utils.radius.parse_radius` on the command line and in TOML (``8/255`` or
    a float; the value the norm, ``"linf"`` or ``"l2"``, or the name of the field holding it).
    ``repeat``: a tuple option given once per value (``--source A --source B``). A ``bool`` field
    is a flag (default False)."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    meta = {"help": help, "choices": tuple(choices) if choices else None, "scope": scope,
            "eval_option": eval_option, "radius": radius, "repeat": repeat}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ProtocolSettings:
    """Base of a protocol's settings; ``check(study)`` raises ``ValueError`` naming the field and
    the fix (``study``: the whole study config, e.g. for its dataset; for ``eval NAME`` an object
    with the command's ``dataset``, ``root``, ``split`` and ``limit``)."""

    def check(self, study) -> None:
        return None

    @classmethod
    def of(cls, config):
        """These settings as ``config`` (a study config, or any object with the fields) holds them;
        the fields only ``eval`` has take their defaults."""
        return cls(**{f.name: getattr(config, f.name) for f in study_fields(cls)})


def is_eval(study) -> bool:
    """Whether :meth:`ProtocolSettings.check` checks an ``eval NAME`` command line (else a study)."""
    return getattr(study, "command", "study") == "eval"


def study_fields(settings: type) -> list[dataclasses.Field]:
    """The fields of ``settings`` that are study config fields."""
    return [f for f in dataclasses.fields(settings) if f.metadata.get("scope", "both") != "eval"]


def eval_fields(settings: type) -> list[dataclasses.Field]:
    """The fields of ``settings`` that are options of ``eval NAME``."""
    return [f for f in dataclasses.fields(settings) if f.metadata.get("scope", "both") != "study"]


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_option(f: dataclasses.Field, command: str = "study") -> str:
    """The option of field ``f`` in ``command`` (``study`` or ``eval``)."""
    return option_name((command == "eval" and f.metadata.get("eval_option")) or f.name)


def field_default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _shown(value, radius: bool = False) -> str:
    from robust_attn.utils.radius import shown_radius

    if isinstance(value, tuple):
        return ",".join(_shown(v, radius) for v in value)
    if radius and isinstance(value, float):
        return shown_radius(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


#: the command-line type of a field's annotation; tuples are comma lists, parsed by the caller
_SCALARS = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float, "str | None": str}


def add_options(parser: argparse.ArgumentParser, fields: Sequence[dataclasses.Field], command: str = "study") -> None:
    """One option per field (:func:`field_option`; default ``None``: only what is given is set,
    stored under the field's name), its help followed by the field's default; a ``bool`` field is
    a flag, a ``repeat`` field is given once per value."""
    for f in fields:
        default = field_default(f)
        help_text = f.metadata.get("help", "")
        help_text = help_text() if callable(help_text) else help_text   # e.g. from a registry, when asked
        radius = f.metadata.get("radius")
        if str(f.type) == "bool":
            parser.add_argument(field_option(f, command), dest=f.name, action="store_true", default=None,
                                help=help_text)
            continue
        if default is not None and default != ():
            shown = _shown(default, radius is not None and radius != "l2")   # L-inf radii in grey levels
            help_text = f"{help_text} (default {shown})" if help_text else f"default {shown}"
        kind = None if radius else _SCALARS.get(str(f.type))
        if f.metadata.get("repeat"):
            parser.add_argument(field_option(f, command), dest=f.name, action="append", help=help_text)
        else:
            parser.add_argument(field_option(f, command), dest=f.name, type=kind, choices=f.metadata.get("choices"),
                                help=help_text)


#: the item types of tuple fields, which the command line takes as comma lists
_ITEM_TYPES = {"tuple[float, ...]": float, "tuple[int, ...]": int, "tuple[str, ...]": str}


def field_norm(f: dataclasses.Field, values: dict) -> str:
    """The norm of a radius field: its own (``linf``, ``l2``) or the value of the field it names."""
    radius = f.metadata.get("radius")
    return radius if radius in ("linf", "l2") else values.get(radius, "linf")


def given_options(fields: Sequence[dataclasses.Field], args: argparse.Namespace,
                  parse_list: Callable[[str, type, str], list], command: str = "study") -> dict:
    """The fields the command line set (an option left out is not in it); a tuple field parsed
    from its comma list by ``parse_list(text, item type, option)`` (strings split and stripped),
    a radius field by :func:`robust_attn.utils.radius.parse_radii`."""
    from robust_attn.utils.radius import parse_radii

    out = {}
    for f in fields:
        value = getattr(args, f.name, None)
        if value is None:
            continue
        option = field_option(f, command)
        item = _ITEM_TYPES.get(str(f.type))
        if f.metadata.get("repeat"):
            value = tuple(value)
        elif f.metadata.get("radius"):
            norm = field_norm(f, {g.name: getattr(args, g.name, None) or field_default(g) for g in fields})
            value = parse_radii(value, option, norm)
            value = tuple(value) if str(f.type).startswith("tuple") else _single(value, option)
        elif item is str:
            value = [v.strip() for v in value.split(",") if v.strip()]
        elif item is not None:
            value = parse_list(value, item, option)
        out[f.name] = value
    return out


def _single(values: list, option: str):
    if len(values) != 1:
        raise ValueError(f"{option} takes one radius, got {len(values)}")
    return values[0]


def study_image_size(study) -> tuple[int, int] | None:
    """The (height, width) of the study's images where the dataset alone says it; None where the
    data must be read first (``imagefolder``)."""
    from robust_attn.data import dataset_info

    try:
        return (dataset_info(study.dataset, root=getattr(study, "root", None)).image_size,) * 2
    except (KeyError, ValueError, FileNotFoundError):
        return None
