"""What a study will cost, said before it starts: a plan of every (protocol, model) it runs, with
an estimated time from a measured probe.

The estimate is a small cost model: for each protocol, how many forward passes and how many
forward-backward passes (an attack iteration: the loss and its input gradient) it makes per
image (:func:`protocol_passes`: each protocol's study step declares them, counted from the same
settings the protocol runs with), times
the seconds one image takes through the model, measured on the actual model, device and images
by a short probe (:func:`probe_model`) just before the study starts. Chunked steps shared by
``workers`` processes divide by ``workers``.

Two kinds of number are bounds rather than estimates: an attack that stops early on an image it
has fooled (APGD, AutoAttack's members, Square) is counted as if no image were fooled, so its
figure is an upper bound (marked ``<=`` in the plan); AutoAttack at a radius where most images are
fooled by its first member costs a small fraction of it. Image transforms (corruptions,
rotations) and the report's bootstrap are not counted: on the zoo's models they are small next
to the passes through the model.

A resumed study plans what is left: a (protocol, model) whose run already holds some of its
record chunks is counted for the rest (:func:`done_fractions`), and one that holds them all is
shown as ``done``. As steps finish, :class:`StudyClock` rescales what is left by how long the
computed part of each protocol took against its estimate.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from robust_attn.protocols.study_step import Passes
from robust_attn.utils.durations import format_seconds

__all__ = ["Passes", "PlanRow", "protocol_passes", "probe_model", "plan_rows", "format_plan", "format_seconds",
           "StudyClock", "log_plan", "log_unprobed_plan", "probe_images", "study_total",
           "done_fractions", "reuse_note"]

def protocol_passes(name: str, config) -> Passes | None:
    """The passes per image of protocol ``name`` under ``config``, as its study step registered
    them (:func:`robust_attn.protocols.study_step.study_protocol`; None: not known)."""
    from robust_attn.protocols.study_step import STUDY_PROTOCOLS

    step = STUDY_PROTOCOLS.get(name) if name in STUDY_PROTOCOLS else None
    return step.passes(config) if step is not None and step.passes is not None else None


def probe_model(model, images, device, *, repeats: int = 2) -> tuple[float, float]:
    """(forward, forward-backward) seconds per image of ``model`` on ``images`` (a small batch of
    the study's own images, in [0, 1]), measured: one warm-up pass each (kernels load, caches
    fill), then the best of ``repeats`` timed passes."""
    import torch

    images = images.to(device)
    model.eval()

    def forward():
        with torch.no_grad():
            model(images)

    def backward():
        x = images.clone().requires_grad_(True)
        model(x).logsumexp(1).sum().backward()

    out = []
    for fn in (forward, backward):
        fn()
        best = math.inf
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        out.append(best / len(images))
    model.zero_grad(set_to_none=True)
    return out[0], out[1]


@dataclass(frozen=True)
class PlanRow:
    """One (protocol, model) of the plan: the images it sees, its passes per image and the
    estimated seconds (None: a protocol without a pass count)."""

    protocol: str
    model: str
    images: int
    passes: Passes | None
    seconds: float | None
    least: float | None = None   # for a bound: the seconds if every image were fooled at once
    done: float = 0.0            # the part its run already holds (a resumed study); seconds count the rest

    @property
    def bound(self) -> bool:
        return self.passes is not None and self.passes.bound


def plan_rows(config, models: list[str], probes: dict[str, tuple[float, float]], num_images: int,
              num_attack_images: int, workers: int = 1, done: dict[tuple[str, str], float] | None = None
              ) -> list[PlanRow]:
    """Every (protocol, model) the study runs, in the order it runs them (per-model steps for each
    model, then the steps across models, each once per model), with its estimated seconds from
    ``probes`` (model -> (forward, forward-backward) seconds per image) for the part not in
    ``done`` ((protocol, model) -> the fraction its run already holds, :func:`done_fractions`)."""
    from robust_attn.protocols.study_step import STUDY_PROTOCOLS

    steps = [STUDY_PROTOCOLS[p] for p in config.protocols]
    order = [(s, m) for m in models for s in steps if s.per_model] + \
            [(s, m) for s in steps if not s.per_model for m in models]
    rows = []
    for step, model in order:
        passes = protocol_passes(step.name, config)
        count = {"study": num_images, "attack": num_attack_images,
                 "autoattack": min(config.autoattack_limit or num_attack_images, num_attack_images),
                 "masking": min(config.masking_images, num_attack_images)}[passes.images] if passes else \
            (num_attack_images if step.attack_subset else num_images)
        seconds = least = None
        held = (done or {}).get((step.name, model), 0.0)
        if passes is not None and model in probes:
            forward_s, backward_s = probes[model]
            others = sum(probes[m][0] for m in models if m in probes)
            scale = (1.0 - held) / (workers if step.chunked and workers > 1 else 1)
            seconds = passes.seconds(forward_s, backward_s, count, others) * scale
            least = (passes.least or passes).seconds(forward_s, backward_s, count, others) * scale
        rows.append(PlanRow(step.name, model, count, passes, seconds, least, held))
    return rows


def format_plan(rows: list[PlanRow], *, device: str, workers: int, header: str = "") -> list[str]:
    """The plan as lines: a table of protocol x model with estimated times, the total per
    protocol and for the study. ``<=``: an upper bound (attacks that stop early on fooled images)."""
    protocols = list(dict.fromkeys(r.protocol for r in rows))
    models = list(dict.fromkeys(r.model for r in rows))
    cell = {(r.protocol, r.model): r for r in rows}
    width = max(len(m) for m in models) if models else 5

    def shown(r: PlanRow | None) -> str:
        if r is None:
            return "-"
        if r.done >= 1.0:
            return "done"
        return "?" if r.seconds is None else ("<=" if r.bound else "") + format_seconds(r.seconds)

    lines = [header] if header else []
    probed = any(r.seconds is not None for r in rows)
    lines.append(f"study plan ({device}, {workers} process(es); " + (
        "estimated from a probe of each model on this machine now; <= is an upper bound):" if probed else
        "no model could be timed, so no time is estimated):"))
    if any(r.done > 0 for r in rows):
        lines.append("  (resumed: the times count what the runs do not hold yet; done: every record is written)")
    images = {p: next(r.images for r in rows if r.protocol == p) for p in protocols}
    lines.append(f"  {'model':<{width}}  " + "  ".join(f"{p} ({images[p]} img)" for p in protocols))
    for m in models:
        lines.append(f"  {m:<{width}}  " + "  ".join(f"{shown(cell.get((p, m))):>{len(p) + len(str(images[p])) + 7}}"
                                                      for p in protocols))
    totals = {p: [cell[(p, m)] for m in models if (p, m) in cell] for p in protocols}
    total_cells = []
    for p in protocols:
        known = [r.seconds for r in totals[p] if r.seconds is not None]
        bound = any(r.bound for r in totals[p])
        total_cells.append(("<=" if bound else "") + format_seconds(sum(known)) if known else "?")
    lines.append(f"  {'total':<{width}}  " + "  ".join(f"{c:>{len(p) + len(str(images[p])) + 7}}"
                                                      for c, p in zip(total_cells, protocols)))
    total, bound = study_total(rows)
    least = sum(r.least for r in rows if r.least is not None)
    said = f"between {format_seconds(least)} and {format_seconds(total)}" if bound and least < 0.8 * total else \
        f"{'at most ' if bound else 'about '}{format_seconds(total)}"
    if probed:
        lines.append(f"  estimated time of the study: {said}"
                     + (" (protocols of unknown cost not counted)" if any(r.seconds is None for r in rows) else ""))
    return lines


def study_total(rows: list[PlanRow]) -> tuple[float, bool]:
    """(the summed estimated seconds, whether any part of it is an upper bound)."""
    return sum(r.seconds for r in rows if r.seconds is not None), any(r.bound for r in rows)


class StudyClock:
    """The study's ETA as its steps finish: the plan's remaining seconds, each protocol's scaled by
    how long its computed steps took against their estimates (so a machine busier than at the
    probe, or a bound that was loose, corrects the rest of that protocol); a protocol not yet
    computed is scaled by the pace of the exact estimates (steps that are not bounds) so far. A
    step that was already complete, or partly, counts only the part it computed. :meth:`line`
    leaves the study's first step out of the scaling: it also pays for the helper processes'
    start (importing, loading every model).

    Where the plan holds bounds (attacks that stop early on fooled images), the time left is a
    range: the bounds' ``least`` (every image fooled at once) scaled the same way gives its lower
    end, and :meth:`line` says both until the attacks' own steps have narrowed them."""

    def __init__(self, rows: list[PlanRow]):
        self.left = {(r.protocol, r.model): r.seconds for r in rows}
        self.least = {(r.protocol, r.model): r.least if r.bound and r.least is not None else r.seconds
                      for r in rows}
        self.bound = {r.protocol for r in rows if r.bound}
        self.estimated_done: dict[str, float] = {}   # protocol -> estimated seconds of what was computed
        self.estimated_least: dict[str, float] = {}  # the same, of the bounds' lower ends
        self.spent: dict[str, float] = {}            # protocol -> seconds it took
        self.steps = 0

    def finished(self, protocol: str, model: str | None, seconds: float, calibrate: bool = True,
                 computed: float = 1.0) -> None:
        """Step ``protocol`` of ``model`` (None: of every model, a step across models) took
        ``seconds`` to compute the fraction ``computed`` of the work its plan row counts (of the
        record chunks its run lacked, those written now: 0 for a run found complete, less than 1
        where some were adopted from another study's runs); ``calibrate=False``: it leaves the plan
        without scaling the rest (the study's first step, which also pays for starting the helper
        processes)."""
        keys = [k for k in self.left if k[0] == protocol and (model is None or k[1] == model)]
        estimate = sum(self.left.pop(k) or 0.0 for k in keys)
        least = sum(self.least.pop(k) or 0.0 for k in keys)
        self.steps += 1
        if estimate > 0 and computed > 0 and calibrate:
            self.estimated_done[protocol] = self.estimated_done.get(protocol, 0.0) + estimate * computed
            self.estimated_least[protocol] = self.estimated_least.get(protocol, 0.0) + least * computed
            self.spent[protocol] = self.spent.get(protocol, 0.0) + seconds

    def _ratio(self, protocols, estimated: dict[str, float]) -> float | None:
        total = sum(estimated[p] for p in protocols)
        return sum(self.spent[p] for p in protocols) / total if total > 0 else None

    def remaining(self, least: bool = False) -> float:
        """The seconds left: the plan's estimates (``least``: the bounds' lower ends) scaled by the
        pace so far (class docstring)."""
        exact = self._ratio([p for p in self.estimated_done if p not in self.bound], self.estimated_done)
        pace = exact if exact is not None else 1.0
        done = self.estimated_least if least else self.estimated_done
        left = 0.0
        for (protocol, model), seconds in (self.least if least else self.left).items():
            if seconds is not None:
                own = self._ratio([protocol], done) if protocol in done else None
                left += seconds * (own if own is not None else pace)
        return left

    def line(self, protocol: str, model: str | None, seconds: float, computed: float = 1.0) -> str:
        self.finished(protocol, model, seconds, calibrate=self.steps > 0, computed=computed)
        left, least = self.remaining(), self.remaining(least=True)
        took = f"study: {protocol} of {model or 'every model'} took {format_seconds(seconds)}; "
        if least < 0.8 * left:
            return took + f"between {format_seconds(least)} and {format_seconds(left)} left " \
                          f"(ETA {_clock_time(least)} to {_clock_time(left)})"
        return took + f"about {format_seconds(left)} left (ETA {_clock_time(left)})"


def _clock_time(seconds_from_now: float) -> str:
    """The local time ``seconds_from_now``: ``"14:05"`` within a day, else with its date."""
    when = time.localtime(time.time() + seconds_from_now)
    return time.strftime("%H:%M" if seconds_from_now < 86400 else "%b %d %H:%M", when)


def probe_images(dataset, n: int = 16):
    """The first ``n`` images of ``dataset`` as one batch (the probe's input)."""
    import torch

    return torch.stack([dataset[i][0] for i in range(min(n, len(dataset)))])


def log_unprobed_plan(config, models: list[str], root, device, workers: int, log, runs_dir=None,
                      reuse=()) -> None:
    """Log the plan of a study whose models cannot be loaded: what would run, on how many images,
    and what ``runs_dir``'s runs hold already, without times (the study's images are counted; no
    model is built); ``reuse``: as for :func:`log_plan`."""
    from robust_attn.data import build_dataset

    num_images = len(build_dataset(config.dataset, root=root, split=config.split, limit=config.limit))
    done = done_fractions(config, models, runs_dir) if runs_dir is not None else None
    rows = plan_rows(config, models, {}, num_images, min(num_images, config.attack_limit or num_images), workers,
                     done)
    for line in format_plan(rows, device=str(device), workers=workers) + reuse_note(config, models, runs_dir, reuse):
        log(line)


def reuse_note(config, models: list[str], runs_dir, reuse=()) -> list[str]:
    """The plan's note on adoption (:mod:`robust_attn.runs.adopt`): which of the study's runs have
    a run of their name in a folder of runs it reuses (``runs_dir``'s ``reuse.json`` and the
    folders ``reuse``, --reuse-runs). Whether their records are the same computation is known only
    when each run opens, so the plan's times count them as still to compute; [] when nothing is
    reused."""
    from robust_attn.protocols.study_step import STUDY_PROTOCOLS, study_run_dir
    from robust_attn.runs.adopt import reuse_folders

    try:
        folders = reuse_folders(runs_dir) if runs_dir is not None else []
    except ValueError:   # a damaged reuse.json: the study itself says so when a run opens
        folders = []
    for folder in (Path(f).resolve() for f in reuse):
        if folder not in folders:
            folders.append(folder)
    if not folders:
        return []
    held = [f"{protocol}-{model}" for protocol in config.protocols if STUDY_PROTOCOLS[protocol].per_model
            for model in models
            if any((study_run_dir(folder, protocol, model) / "run.json").is_file() for folder in folders)]
    shown = ", ".join(held[:6]) + (f" and {len(held) - 6} more" if len(held) > 6 else "")
    return [f"  (reusing {', '.join(map(str, folders))}: " + (
        f"{len(held)} of these runs have a run of their name there ({shown}); each adopts its records of the "
        f"same computation when it opens, so those runs may take less than planned)" if held else
        "no run of this study has a run of its name there)")]


def done_fractions(config, models: list[str], runs_dir) -> dict[tuple[str, str], float]:
    """``{(protocol, model): fraction}`` of the record chunks the study's per-model runs in
    ``runs_dir`` already hold (a resumed study; runs not started are left out)."""
    from robust_attn.protocols.study_step import STUDY_PROTOCOLS, study_run_dir
    from robust_attn.runs.store import RunStore

    fractions = {}
    for protocol in config.protocols:
        if not STUDY_PROTOCOLS[protocol].per_model:
            continue
        for model in models:
            store = RunStore(study_run_dir(runs_dir, protocol, model))
            try:
                if not store.exists():
                    continue
                held, missing = len(store.chunks()), len(store.missing())
            except (OSError, ValueError, KeyError):   # unreadable: the study itself will say why
                continue
            if held + missing:
                fractions[(protocol, model)] = held / (held + missing)
    return fractions


def log_plan(config, loaded: dict, inputs: dict, device, workers: int, log, runs_dir=None,
             reuse=()) -> StudyClock:
    """Probe every model (:func:`probe_model`, on the first images of its attack subset), log the
    plan (:func:`format_plan`; what ``runs_dir``'s runs hold already is left out of the times, and
    :func:`reuse_note` says which runs may adopt records from the folders of runs reused: those
    ``runs_dir``'s ``reuse.json`` names and ``reuse``) and return the clock that tells the time
    left as steps finish."""
    log("study: timing each model on a few images to estimate the study's cost ...")
    probes = {}
    for name, model in loaded.items():
        probes[name] = probe_model(model.model, probe_images(inputs[name][1]), device)
    dataset, attack_dataset, _ = next(iter(inputs.values()))
    done = done_fractions(config, list(loaded), runs_dir) if runs_dir is not None else None
    rows = plan_rows(config, list(loaded), probes, len(dataset), len(attack_dataset), workers, done)
    for line in format_plan(rows, device=str(device), workers=workers) + reuse_note(config, list(loaded), runs_dir,
                                                                                   reuse):
        log(line)
    return StudyClock(rows)
