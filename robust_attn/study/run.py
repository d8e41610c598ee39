"""The complete SAN-style study over a zoo, or over any models: SAN section 5.4 in one call.

For every zoo model trained on ``config.dataset`` (or the models ``config.models`` names: zoo
entries, or any model spec of :mod:`robust_attn.sources` as :class:`StudyModel`, e.g. from a
study config file, :mod:`robust_attn.study.config`) this runs the rotation protocol (Table 9 plus
the left-right flip and an angle sweep) and targeted PGD (Table 10's two settings plus an eps
sweep) on the same images with the same attack targets (drawn from the labels with one seed,
so every model and every resumed or parallel call gets the same ones), then writes the report: Tables 9 and
10, the plots, bootstrap intervals and the findings (which model loses least, paired bootstrap;
:mod:`robust_attn.reports.comparison`).

    >>> from robust_attn.study.batches import WORKER_OUT_OF_MEMORY, dataset_resolution, step_memory
from robust_attn.study.config import StudyConfig, StudyModel
from robust_attn.study.estimate import log_plan
    >>> from robust_attn.study.run import run_study
    >>> run_study(StudyConfig(dataset="fashion_mnist"), runs_dir="runs/study", report_dir="reports/study")
    >>> run_study(StudyConfig(dataset="imagenet", limit=1000, baseline="torchvision-resnet50",
    ...                       models=(StudyModel("timm:resnet26t"), StudyModel("torchvision:resnet50:IMAGENET1K_V1"))),
    ...           runs_dir="runs/study-imagenet", report_dir="reports/study-imagenet", root="data")

Every model is loaded through its spec and evaluated on the same images through its own
preprocessing (:mod:`robust_attn.study.models`); the steps that compare models on the same
tensors (transfer, masking) are refused for models of different preprocessing.

Every run directory is resumable (:mod:`robust_attn.runs.store`): calling again after an
interruption computes only what is missing, and a finished model costs nothing. The report
folder gets a packed copy of every run (``<report_dir>/runs``: per-image records in one gzip CSV
each), so ``robust-attn report <report_dir>/runs/* --out DIR`` derives the report again from
what is committed. The wall time
each call spent per model and protocol is appended to ``<runs_dir>/timings.csv``, so the report
can say what the study cost. Under ``torchrun --nproc_per_node=N -m robust_attn.cli study`` each
rank evaluates a disjoint shard of every run's images and rank 0 writes the report.
"""
from __future__ import annotations

import fcntl
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch

from robust_attn.distributed import init_distributed, world_size as process_count
from robust_attn.layers.paths import check_attention_path, set_attention_path
from robust_attn.protocols.study_step import STUDY_PROTOCOLS, StudyContext, replace
from robust_attn.runs.adopt import adopted_chunks
from robust_attn.runs.store import RunStore, library_versions
from robust_attn.runs.study_file import write_study_file
from robust_attn.study.batches import WORKER_OUT_OF_MEMORY, dataset_resolution, step_memory
from robust_attn.study.config import StudyConfig, StudyModel
from robust_attn.study.estimate import log_plan, log_unprobed_plan
from robust_attn.study.models import (StudyEntry, load_models, missing_zoo_message, missing_zoo_models, model_inputs,
                                      study_models)
from robust_attn.utils.io import atomic_path
from robust_attn.utils.memory import OutOfMemory, out_of_memory_message

__all__ = ["run_study", "default_workers", "TIMINGS_FILE"]

TIMINGS_FILE = "timings.csv"
def _append_timing(runs_dir: Path, row: dict) -> None:
    """Add ``row`` to ``timings.csv``; under a file lock, so studies of different models may
    share ``runs_dir`` from parallel processes."""
    path = runs_dir / TIMINGS_FILE
    with open(runs_dir / ".timings.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        frame = pd.read_csv(path) if path.is_file() else pd.DataFrame()
        frame = pd.concat([frame, pd.DataFrame([row])], ignore_index=True)
        with atomic_path(path) as tmp:
            frame.to_csv(tmp, index=False)


def _timed(runs_dir: Path, model: str, protocol: str, out: Path, device, rank: int, fn,
           workers: int = 1) -> tuple[float, float]:
    """Run ``fn`` (a protocol call writing into ``out``; it ends with a barrier under torchrun)
    and log, on rank 0, its wall time and how many record chunks were computed (0: the run was
    already complete) and adopted from another study's runs (:mod:`robust_attn.runs.adopt`); returns
    the wall time and the fraction computed now of the chunks the run lacked when the step began
    (the part the plan's seconds count, :class:`~robust_attn.study.estimate.PlanRow`)."""
    before, adopted_before = len(RunStore(out).chunks()), adopted_chunks(RunStore(out))
    start = time.perf_counter()
    fn()
    if rank != 0:
        return time.perf_counter() - start, 1.0
    after, adopted = len(RunStore(out).chunks()), adopted_chunks(RunStore(out)) - adopted_before
    _append_timing(runs_dir, {"model": model, "protocol": protocol, "seconds": round(time.perf_counter() - start, 1),
                              "chunks_written": after - before - adopted, "chunks_adopted": adopted,
                              "chunks_total": after,
                              "device": str(device), "threads": torch.get_num_threads(),
                              "processes": process_count(), "workers": workers,
                              "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return time.perf_counter() - start, (after - before - adopted) / (after - before) if after > before else 0.0


def _chunk_counts(run_dirs) -> dict[Path, int]:
    """``{run folder: record chunks it holds}`` (how much of a step a resumed study finds done)."""
    return {Path(d): len(RunStore(d).chunks()) for d in run_dirs if Path(d).is_dir()}


def default_workers(dataset: str | None = None) -> int:
    """Processes of a CPU study of ``dataset``: one per core (each on one thread: small models use
    one core better in two processes than in one process with two threads); at ImageNet resolution
    one (each process holds a batch's activations, gigabytes at 224 px, :mod:`robust_attn.study.batches`;
    one process uses every core through its threads)."""
    if dataset is not None and dataset_resolution(dataset) == "imagenet":
        return 1
    return max(1, os.cpu_count() or 1)


def _study_worker(config: StudyConfig, runs_dir: str, root, device, manifest_path: str,
                  attention_path: str) -> None:
    from robust_attn.utils.allocator import keep_freed_memory

    keep_freed_memory()   # a spawned process: as robust-attn's own start does
    torch.set_num_threads(1)
    try:
        run_study(config, runs_dir, None, root=root, device=device, manifest=manifest_path, progress=False,
                  log=lambda *_: None, attention_path=attention_path, _worker=True)
    except OutOfMemory as err:   # one line naming the batch size to lower, as the main process says it
        print(f"robust-attn study: worker error: {out_of_memory_message(err, SimpleNamespace(device=device))}",
              file=sys.stderr, flush=True)
        sys.exit(WORKER_OUT_OF_MEMORY)


def autoattack_cost_note(config: StudyConfig, num_models: int, runs_dir) -> str:
    """What AutoAttack will cost on a CPU, said when a study starts it there: per image that no
    member fools, APGD-CE's iterations, APGD-T's and FAB-T's for each of 9 target classes (a
    forward and a backward pass each) and Square's queries (a forward pass each)."""
    steps = config.attack_steps or 100
    radii = "/".join(f"{round(e * 255, 6):g}" for e in config.autoattack_eps)
    limit = min(x for x in (config.attack_limit, config.autoattack_limit, float("inf")) if x is not None)
    images = f"{limit:,} images" if limit != float("inf") else "every image"
    return (f"study: AutoAttack on a CPU: each image it cannot fool costs about {19 * steps:,} forward-backward "
            f"and {config.square_queries:,} forward passes per radius ({images}, radii {radii}/255, {num_models} "
            f"model(s)); at radii where most images survive (1-4/255) that is hours per model and radius on one "
            f"core. `robust-attn status {runs_dir}` shows how far each radius is; `--preset quick` (the CPU's "
            f"default) is the CPU-sized study (docs/study-presets.md).")


def run_study(config: StudyConfig, runs_dir, report_dir, *, root=None, device=None, manifest=None,
              progress: bool = True, log=print, workers: int = 1, attention_path: str = "lean",
              plan_only: bool = False, reuse=(), _worker: bool = False) -> list[Path]:
    """Run (or resume) the study and write the report; returns the report's files.

    The protocols run in the order of ``config.protocols``: every per-model step
    (:mod:`robust_attn.protocols.study_step`) for each model, then the steps across models.

    ``workers`` > 1 (CPU, not under torchrun) starts that many processes in all, one thread each,
    working through the same runs: every record chunk is claimed before it is computed
    (:mod:`robust_attn.runs.store`), so they share each run's chunks and finish it together before
    the next. Only this process runs the steps that are not chunked (the masking checks), logs
    the timings and writes the report.

    ``attention_path``: the implementation the SAN and SASA layers compute with
    (:mod:`robust_attn.layers.paths`: ``"reference"`` is the faster on a GPU), recorded in each
    run's ``run.json`` as how it ran.

    Before it starts, the study logs its plan: every (protocol, model) it will run with the
    estimated time (:mod:`robust_attn.study.estimate`, from a short probe of each model), and
    after each step the time left. ``plan_only``: log the plan and return ``[]``. ``reuse``: the
    folders of runs given with ``--reuse-runs``, for the plan's note on adoption (the study adopts
    from those its ``reuse.json`` names, :mod:`robust_attn.runs.adopt`)."""
    from robust_attn.data import dataset_info, locate_dataset
    from robust_attn.reports import make_report
    from robust_attn.sources.inputs import record_preprocessing
    from robust_attn.models.manifest import Manifest

    check_attention_path(attention_path)   # before any model is loaded
    manifest = manifest if isinstance(manifest, Manifest) else Manifest(manifest)
    chosen = study_models(config, manifest, log=log)
    root = root if root is not None else config.root
    info = dataset_info(config.dataset, root=root)
    if info.num_classes < 2:
        raise ValueError(f"dataset {info.name} has {info.num_classes} class(es): accuracy and attacks need at least 2; "
                         f"give a folder with one subfolder per class, two or more")
    locate_dataset(config.dataset, root, config.split)   # the data is there before any model is loaded
    steps = [STUDY_PROTOCOLS[p] for p in config.protocols]
    rank, world_size, device = init_distributed(device)   # under torchrun: each rank a shard of the images
    missing = missing_zoo_models(chosen, manifest, config.dataset)
    if missing:   # said before anything is loaded; --plan still shows what would run
        if plan_only and rank == 0 and not _worker:
            log_unprobed_plan(config, [m.name for m in chosen], root, device, workers, log, runs_dir, reuse)
        raise ValueError(missing_zoo_message(missing, chosen, manifest, config.dataset))
    loaded = load_models(chosen, info, device, manifest, config.seed, log)
    for name, entry in loaded.items():
        if set_attention_path(entry.model, attention_path) and attention_path != "lean":
            log(f"{name}: its attention layers compute on the {attention_path} path")
    if "autoattack" in config.protocols and device.type == "cpu" and rank == 0 and not _worker:
        log(autoattack_cost_note(config, len(loaded), runs_dir))
    inputs = model_inputs(config, root, loaded, [s for s in steps if not s.per_model])
    dataset, attack_dataset, _ = next(iter(inputs.values()))
    clock = None
    if rank == 0 and not _worker:
        clock = log_plan(config, loaded, inputs, device, workers if world_size == 1 else world_size, log, runs_dir,
                         reuse)
    if plan_only:
        return []
    runs_dir = Path(runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    helpers = []
    if workers > 1 and world_size == 1 and not _worker:
        spawn = multiprocessing.get_context("spawn")
        helpers = [spawn.Process(target=_study_worker, args=(config, str(runs_dir), root, str(device),
                                                            str(manifest.path), attention_path),
                                     name=f"study-worker-{w}")
                   for w in range(1, workers)]
        for helper in helpers:
            helper.start()
        torch.set_num_threads(1)
        log(f"study: {workers} processes of one thread share the runs in {runs_dir}")
    base_info = {"dataset": {"name": config.dataset, "split": config.split, "limit": config.limit},
                 "data_root": str(root) if root else None, "data_source": getattr(dataset, "source", None),
                 "data_variant": getattr(dataset, "variant", config.dataset), "command": list(sys.argv),
                 "device": str(device), "attention_path": attention_path,
                 "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    ctx = StudyContext(config=config, info=info, dataset=dataset, attack_dataset=attack_dataset, runs_dir=runs_dir,
                       device=device, rank=rank, world_size=world_size, progress=progress, base_info=base_info,
                       log=log)
    run_dirs: list[Path] = []
    from robust_attn.sources.contract import apply_input_contract

    quiet = rank != 0 or _worker

    def contract(name):   # declared, the source's convention, or probed (an error when it looks wrong)
        description = record_preprocessing(loaded[name].description, inputs[name][2])
        return apply_input_contract(loaded[name].model, description, None, inputs[name][0], device, config.batch_size,
                                    log=lambda line: None if quiet else log(f"{name}: {line}"))

    entries = [StudyEntry(m.name, contract(m.name)) for m in chosen]
    models = {e.name: loaded[e.name].model for e in entries}
    for i, entry in enumerate(entries, start=1):
        model_ctx = replace(ctx, dataset=inputs[entry.name][0], attack_dataset=inputs[entry.name][1])
        for step in (s for s in steps if s.per_model):
            out = ctx.run_dir(step.name, entry.name)
            step_ctx = _on_its_images(model_ctx, step)
            with step_memory(step, config):
                spent, computed = _timed(runs_dir, entry.name, step.name, out, device, 1 if _worker else rank,
                                         lambda: step.step(step_ctx, entry, models[entry.name]), workers)
            if clock is not None:
                log(clock.line(step.name, entry.name, spent, computed))
            run_dirs.append(out)
        log(f"[{i}/{len(entries)}] {entry.name}: done")
    for step in (s for s in steps if not s.per_model and (s.chunked or not _worker)):
        start = time.perf_counter()
        held = _chunk_counts(runs_dir.iterdir()) if clock is not None else {}
        with step_memory(step, config):
            made = step.step(_on_its_images(ctx, step), entries, models)
        if clock is not None:
            now = _chunk_counts(made)
            total = sum(now.values())
            computed = (total - sum(held.get(d, 0) for d in now)) / total if total else 1.0
            log(clock.line(step.name, None, time.perf_counter() - start, computed))
        if rank == 0 and not _worker:
            _append_timing(runs_dir, {"model": "all", "protocol": step.name,
                                      "seconds": round(time.perf_counter() - start, 1), "chunks_written": -1,
                                      "chunks_total": -1, "device": str(device), "threads": torch.get_num_threads(),
                                      "processes": process_count(), "workers": workers,
                                      "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})
        run_dirs += list(made)
    for helper in helpers:
        helper.join()
    starved = [h.name for h in helpers if h.exitcode in (WORKER_OUT_OF_MEMORY, -signal.SIGKILL)]
    if starved:
        raise MemoryError(f"study worker(s) {starved} ran out of memory or were killed (signal 9: most often the "
                          f"kernel's out-of-memory killer); the study resumes where they stopped")
    failed = [h.name for h in helpers if h.exitcode != 0]
    if failed:
        raise RuntimeError(f"study worker(s) {failed} failed (see their messages above); run the study again: "
                           f"it resumes where they stopped")
    if rank != 0 or _worker:
        return []
    report_dir = Path(report_dir)
    log(f"study: writing the report into {report_dir} (packing the runs, {config.bootstrap} bootstrap resamples) ...")
    packed = [RunStore(d).pack(report_dir / "runs" / d.name).root for d in run_dirs]
    files = make_report(packed, report_dir, n_boot=config.bootstrap, seed=config.seed, baseline=config.baseline,
                        preamble=_preamble(config, runs_dir, len(dataset), len(attack_dataset), chosen, packed),
                        keep=(TIMINGS_FILE,))
    with atomic_path(report_dir / TIMINGS_FILE) as tmp:
        tmp.write_bytes((runs_dir / TIMINGS_FILE).read_bytes())
    study_file = report_dir / "study.json"
    write_study_file(study_file, config.describe(), [str(p) for p in packed], library_versions())
    log(f"study of {len(entries)} model(s) on {len(dataset)} images: report in {Path(report_dir) / 'report.md'}")
    return files + [report_dir / TIMINGS_FILE, study_file]


def _on_its_images(ctx: StudyContext, step) -> StudyContext:
    """``ctx`` for ``step``, whose runs record the images they are on: a step on the attack subset
    (``attack_subset``), where that is a seeded part of the study's images, records the subset's
    limit (its images are ``model_dataset(..., limit=len(subset))``), not the study's."""
    if not step.attack_subset or ctx.attack_dataset is ctx.dataset:
        return ctx
    dataset = {**ctx.base_info["dataset"], "limit": len(ctx.attack_dataset)}
    return replace(ctx, base_info={**ctx.base_info, "dataset": dataset})


def _described(step, config: StudyConfig) -> str:
    """A protocol's sentence in the preamble: its registered ``describe``, else its summary."""
    return step.describe(config) if step.describe is not None else f"{step.name}: {step.summary}."


def _compute_table(runs: list[Path], logged: pd.DataFrame | None = None) -> list[str]:
    """Seconds per model and step summed from each run's record chunks
    (:meth:`~robust_attn.runs.store.RunStore.compute_time`: every resumed or killed call included).
    Where some of a run's chunks were written before chunks kept their time, a lower bound marked
    ``>=``: the larger of its timed chunks' sum and ``logged`` (``timings.csv``'s rows, which
    count only the calls that finished a step). No lines when neither knows anything."""
    finished = {}
    if logged is not None and len(logged):
        done = logged[logged["chunks_written"] > 0]
        finished = done.groupby(["model", "protocol"])["seconds"].sum().to_dict()
    cells: dict[str, dict[str, str]] = {}
    for run in runs:
        step, model = run.name.split("-", 1)
        spent = RunStore(run).compute_time()
        if spent.get("timed") and spent["timed"] == spent["chunks"]:
            cells.setdefault(model, {})[step] = f"{spent['seconds']:.0f}"
            continue
        lower = max(spent.get("seconds", 0.0), finished.get((model, step), 0.0))
        if lower > 0:
            cells.setdefault(model, {})[step] = f">= {lower:.0f}"
    if not cells:
        return []
    steps = list(dict.fromkeys(step for row in cells.values() for step in row))
    devices = ", ".join(sorted({h for run in runs for h in RunStore(run).computed_on()}))
    return ([f"Compute time per model and step (seconds on {devices}; summed from each run's record chunks, every "
             f"resumed call included; >= a lower bound, where chunks predate the chunks' timing: the larger of the "
             f"timed chunks' sum and the calls that finished the step in `{TIMINGS_FILE}`):", "",
             "| model | " + " | ".join(f"{s} (s)" for s in steps) + " |", "|:--|" + "--:|" * len(steps)]
            + [f"| {m} | " + " | ".join(row.get(s, "-") for s in steps) + " |" for m, row in cells.items()] + [""])


def _preamble(config: StudyConfig, runs_dir: Path, num_images: int, num_attack_images: int,
              models: list[StudyModel], runs: list[Path] = ()) -> list[str]:
    """The report's opening: the models and images, then each protocol that ran, in the words
    of its registration (:mod:`robust_attn.protocols.study_step`), and the compute time spent
    (:func:`_compute_table`: ``runs``' record chunks, and the study's ``timings.csv``)."""
    who = f"every zoo model trained on `{config.dataset}`" if not config.models else \
        f"{len(models)} models on `{config.dataset}` ({', '.join(m.name for m in models)}; where each came from: " \
        f"Models, below)"
    text = f"Study: {who}, evaluated on {num_images} images of its '{config.split}' split."
    ran = [STUDY_PROTOCOLS[p] for p in config.protocols]
    text += "".join(" " + _described(step, config) for step in ran if not step.attack_subset)
    lines = [text, ""]
    attacks = [_described(step, config) for step in ran if step.attack_subset]
    if attacks:
        lines += [f"Attacks on a seeded subset of {num_attack_images} of these images: " + "; ".join(attacks) + ".", ""]
    timings_path = runs_dir / TIMINGS_FILE
    logged = pd.read_csv(timings_path) if timings_path.is_file() else None
    return lines + _compute_table(list(runs), logged)
