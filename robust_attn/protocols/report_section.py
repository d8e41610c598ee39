"""How a protocol's runs enter the report: one registered section per protocol.

A function decorated with :func:`report_section` writes the report's part for the runs of the
protocols it names (``run.json``'s ``protocol``): it takes a :class:`ReportContext` and returns
the Markdown lines and the files it wrote. :func:`robust_attn.reports.make_report` asks every
registered section, in ``order``, and refuses runs of a protocol no section names. A section
lives beside its protocol (any module of :mod:`robust_attn.protocols`) or in
:mod:`robust_attn.reports`; both packages are imported when the sections are first asked for.

``shift=True``: the protocol's runs hold a ``clean`` condition and shifted ones (corruptions,
occlusion, ...), so the findings compare models by their top-1 drop from clean
(:func:`robust_attn.reports.comparison.compare_models`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from robust_attn.utils.plugins import Registry

__all__ = ["ReportContext", "ReportSection", "REPORT_SECTIONS", "report_section", "report_sections",
           "reported_protocols", "shift_protocols"]


@dataclass(frozen=True)
class ReportContext:
    """What a section gets: the runs (:class:`robust_attn.reports.runs.Run`), the report folder,
    the bootstrap settings, whether to draw plots and the baseline model's label."""

    runs: list
    out: Path
    n_boot: int = 1000
    seed: int = 0
    level: float = 0.95
    plots: bool = True
    baseline: str = "resnet26"


@dataclass(frozen=True)
class ReportSection:
    name: str
    protocols: tuple[str, ...]
    order: int
    write: Callable[[ReportContext], tuple[list[str], list[Path]]]
    shift: bool = False


#: every report section, from the modules of robust_attn.protocols and robust_attn.reports
REPORT_SECTIONS: Registry[ReportSection] = Registry("report section",
                                                    package=("robust_attn.protocols", "robust_attn.reports"),
                                                    error=ValueError)


def report_section(name: str, *, order: int, protocols: tuple[str, ...] | None = None, shift: bool = False):
    """Decorator: register ``write(ctx) -> (markdown lines, files)`` as the report section
    ``name`` for the runs of ``protocols`` (default: the protocol ``name``), placed by ``order``
    (the tables of SAN come first: rotation 10, pgd 20; attacks 30; shifts 40 on)."""

    def add(write: Callable) -> Callable:
        REPORT_SECTIONS.register(name, ReportSection(name, tuple(protocols or (name,)), order, write, shift))
        return write

    return add


def report_sections() -> list[ReportSection]:
    """The sections in report order."""
    return sorted((section for _, section in REPORT_SECTIONS.items()), key=lambda s: (s.order, s.name))


def reported_protocols() -> tuple[str, ...]:
    """Every protocol whose runs the report takes."""
    return tuple(dict.fromkeys(p for section in report_sections() for p in section.protocols))


def shift_protocols() -> tuple[str, ...]:
    """The protocols whose runs hold a clean condition and shifted ones."""
    return tuple(p for section in report_sections() if section.shift for p in section.protocols)
