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
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

__all__ = ["ProtocolSettings", "setting", "add_options", "given_options", "option_name", "study_image_size"]


def setting(default: Any, help: str, *, choices: Sequence[str] | None = None):
    """A settings field: its default, the help of its command-line option and (optional) the
    values it may take."""
    return field(default=default, metadata={"help": help, "choices": tuple(choices) if choices else None})


@dataclass(frozen=True)
class ProtocolSettings:
    """Base of a protocol's settings; ``check(study)`` raises ``ValueError`` naming the field and
    the fix (``study``: the whole study config, e.g. for its dataset)."""

    def check(self, study) -> None:
        return None

    @classmethod
    def of(cls, config):
        """These settings as ``config`` (a study config, or any object with the fields) holds them."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value) -> str:
    if isinstance(value, tuple):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


#: the command-line type of a field's annotation; tuples are comma lists, parsed by the caller
_SCALARS = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float}


def add_options(parser: argparse.ArgumentParser, fields: Sequence[dataclasses.Field]) -> None:
    """One option per field (``--name-with-dashes``, default ``None``: only what is given is set),
    its help followed by the field's default."""
    for f in fields:
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f.metadata.get("help", "")
        if default is not None:
            help_text = f"{help_text} (default {_shown(default)})" if help_text else f"default {_shown(default)}"
        parser.add_argument(option_name(f.name), type=_SCALARS.get(str(f.type)), choices=f.metadata.get("choices"),
                            help=help_text)


#: the item types of tuple fields, which the command line takes as comma lists
_ITEM_TYPES = {"tuple[float, ...]": float, "tuple[int, ...]": int, "tuple[str, ...]": str}


def given_options(fields: Sequence[dataclasses.Field], args: argparse.Namespace,
                  parse_list: Callable[[str, type, str], list]) -> dict:
    """The fields the command line set (an option left out is not in it); a tuple field parsed
    from its comma list by ``parse_list(text, item type, option)`` (strings split and stripped)."""
    out = {}
    for f in fields:
        value = getattr(args, f.name, None)
        if value is None:
            continue
        item = _ITEM_TYPES.get(str(f.type))
        if item is str:
            value = [v.strip() for v in value.split(",") if v.strip()]
        elif item is not None:
            value = parse_list(value, item, option_name(f.name))
        out[f.name] = value
    return out


def study_image_size(study) -> tuple[int, int] | None:
    """The (height, width) of the study's images where the dataset alone says it; None where the
    data must be read first (``imagefolder``)."""
    from robust_attn.data import dataset_info

    try:
        return (dataset_info(study.dataset).image_size,) * 2
    except (KeyError, ValueError, FileNotFoundError):
        return None
