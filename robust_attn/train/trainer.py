"""The training loop: single process or one process per GPU under ``torchrun`` (DDP).

What it trains is ``NormalizedModel(create_model(recipe.model, ...), info.mean, info.std)`` on
images in [0, 1], so every checkpoint is attackable as it is. The recipe fields are documented in
:mod:`robust_attn.train.recipe`; the schedule in :mod:`robust_attn.train.optim`.

Output directory::

    OUT/recipe.json                       resolved recipe (after inheritance and overrides)
    OUT/metrics.csv                       one row per epoch (rank 0)
    OUT/checkpoints/epoch_NNNN/           model.safetensors + model.json + state.pt
    OUT/checkpoints/LAST                  name of the newest complete epoch folder
    OUT/checkpoints/best/                 adversarial training with a guard: the best epoch's model
    OUT/model.safetensors, OUT/model.json the final model (robust_attn.models.checkpoint format)
    OUT/tensorboard/                      if the tensorboard package is installed

A checkpoint folder is complete before ``LAST`` is switched to it (an atomic rename), so a kill
at any moment leaves a usable checkpoint. ``state.pt`` holds only tensors, numbers, strings,
lists and dicts (optimizer, scheduler, scaler, RNG states, metric history) and is read with
``torch.load(weights_only=True)``.

Reproducibility: the model is initialized from ``recipe.seed``; the sampler shuffles with
``(seed, epoch)`` and each image's augmentation is drawn from ``(seed, epoch, index)``
(:class:`robust_attn.data.SeededAugment`), so on CPU a resumed run ends bitwise equal to an
uninterrupted one.
"""
from __future__ import annotations

import contextlib
import csv
import io
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import load_file
from torch.utils.data import DataLoader, DistributedSampler, Subset

from robust_attn.data import SeededAugment, build_dataset, dataset_info
from robust_attn.data.transforms import RandomCropFlip
from robust_attn.distributed import barrier, init_distributed, is_distributed, shard_indices
from robust_attn.models.checkpoint import read_sidecar, save_checkpoint
from robust_attn.models.registry import create_model
from robust_attn.models.wrapper import NormalizedModel
from robust_attn.train import adversarial as adv
from robust_attn.train.checkpoints import ResumeError, latest_checkpoint, restore, save_best, save_epoch
from robust_attn.train.ema import WeightAverage
from robust_attn.train.optim import build_optimizer, build_scheduler
from robust_attn.train.precision import amp_context, amp_epochs_on_resume, resolve_amp
from robust_attn.train.provenance import data_variant, git_commit, versions
from robust_attn.train.recipe import Recipe, RecipeError
from robust_attn.utils.io import atomic_write_json, atomic_write_text

__all__ = ["train", "evaluate", "build_model", "CSV_COLUMNS", "ResumeError"]

CSV_COLUMNS = ["epoch", "train_loss", "lr", "images_per_s", "eval_top1", "eval_top5", "epoch_seconds", "epoch_cpu_s"]
GUARD_COLUMNS = ["eps", "guard_pgd_top1"]  # adversarial training: the radius at the epoch's end, the guard


def build_model(recipe: Recipe) -> NormalizedModel:
    info = dataset_info(recipe.dataset)
    model = create_model(recipe.model, info.num_classes, info.resolution, **recipe.model_args)
    return NormalizedModel(model, info.mean, info.std)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device, autocast=contextlib.nullcontext,
             channels_last: bool = False) -> tuple[float, float, int]:
    """Top-1 and top-5 accuracy (%) over ``loader``, summed over all processes when distributed."""
    was_training = model.training
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with autocast():
            logits = model(images)
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hits = top == labels[:, None]
        counts += torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum(), torch.tensor(len(labels), device=device)])
    if is_distributed():
        dist.all_reduce(counts)
    model.train(was_training)
    n = int(counts[2])
    return (100.0 * counts[0].item() / max(n, 1), 100.0 * counts[1].item() / max(n, 1), n)


def _write_csv(path: Path, history: list[dict]) -> None:
    columns = CSV_COLUMNS + [k for k in GUARD_COLUMNS if history and k in history[0]]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns)
    writer.writeheader()
    for row in history:
        writer.writerow({k: row.get(k, "") for k in columns})  # a resumed run's older rows may lack a column
    atomic_write_text(path, buf.getvalue())


def _set_translate_flip(dataset, translate: int | None, flip: str) -> None:
    """Replace the crop-and-flip augmentation of ``dataset`` (or of the dataset it wraps) by one with
    ``translate`` pixels of padding (None: keep the dataset's) and a random flip only when
    ``flip == "random"`` (the alternating flip is :class:`SeededAugment`'s)."""
    if translate is None and flip == "random":
        return
    inner = dataset
    while inner is not None and not isinstance(getattr(inner, "transform", None), RandomCropFlip):
        inner = getattr(inner, "dataset", None)
    if inner is None:
        raise RecipeError("data.translate and data.flip apply to the CIFAR-resolution datasets' crop-and-flip "
                          "augmentation; this dataset has another one: remove them from the recipe")
    padding = inner.transform.padding if translate is None else translate
    inner.transform = RandomCropFlip(padding, flip=flip == "random")


def _tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # optional
        return None
    return SummaryWriter(str(out / "tensorboard"))


def train(recipe: Recipe, out_dir: str | Path, resume: bool = False, progress: bool = True,
          log: Callable[[str], None] = print, stop_after: int | None = None) -> dict:
    """Train ``recipe`` into ``out_dir``; returns ``{"history": [...], "weights": path or None,
    "sha256": ...}`` (on every rank). Under torchrun the process group is joined here (see
    :func:`robust_attn.distributed.init_distributed`).

    ``stop_after``: leave after that many epochs of this invocation (with the checkpoint
    written), for time-limited jobs; ``resume=True`` continues later. The final model is only
    written when the recipe's last epoch is done."""
    rt, dcfg, ocfg = recipe.runtime, recipe.data, recipe.optim
    rank, world, device = init_distributed(None if rt.device == "auto" else rt.device)
    main = rank == 0
    out = Path(out_dir)
    say = log if main else (lambda _msg: None)
    if dcfg.batch_size % world:
        raise RecipeError(f"data.batch_size {dcfg.batch_size} is the global batch and must be divisible by the "
                          f"number of processes ({world})")
    amp = resolve_amp(device, rt.amp, say)
    autocast = amp_context(device, amp)
    if rt.deterministic:
        torch.use_deterministic_algorithms(True)
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True

    # model: the same initialization on every rank (DDP also broadcasts rank 0's)
    torch.manual_seed(recipe.seed)
    net = build_model(recipe).to(device)
    if rt.channels_last:
        net = net.to(memory_format=torch.channels_last)

    # data
    base_train = build_dataset(recipe.dataset, dcfg.root, "train", augment=dcfg.augment, holdout=dcfg.holdout,
                               limit=dcfg.limit_train)
    if dcfg.augment:
        _set_translate_flip(base_train, dcfg.translate, dcfg.flip)
    acfg = recipe.adversarial
    adversarial = acfg.method != "none"
    guard_set = None
    if adversarial and acfg.guard_images > 0:  # a held-out slice of the training images, not augmented
        kept, held = adv.guard_split(len(base_train), acfg.guard_images, recipe.seed)
        guard_set = Subset(build_dataset(recipe.dataset, dcfg.root, "train", augment=False, holdout=dcfg.holdout,
                                         limit=dcfg.limit_train), held)
        base_train = Subset(base_train, kept)
    train_set = SeededAugment(base_train, seed=recipe.seed, alternate_flip=dcfg.augment and dcfg.flip == "alternating")
    eval_set = build_dataset(recipe.dataset, dcfg.root, dcfg.eval_split, limit=dcfg.limit_eval,
                             holdout=dcfg.holdout)
    per_rank = dcfg.batch_size // world
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=recipe.seed,
                                 drop_last=True)
    loader_args = dict(num_workers=dcfg.workers, pin_memory=device.type == "cuda",
                       persistent_workers=dcfg.workers > 0)
    train_loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler, drop_last=True, **loader_args)
    eval_loader = DataLoader(Subset(eval_set, shard_indices(len(eval_set), rank, world)),
                             batch_size=dcfg.eval_batch_size, shuffle=False, **loader_args)
    guard_loader = None if guard_set is None else DataLoader(
        Subset(guard_set, shard_indices(len(guard_set), rank, world)), batch_size=dcfg.eval_batch_size,
        shuffle=False, **loader_args)
    guard = adv.GuardState(acfg.guard_collapse, floor=100.0 / dataset_info(recipe.dataset).num_classes)
    stopped = False
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise RecipeError(f"data.batch_size {dcfg.batch_size} exceeds the {len(train_set)} training images; "
                          f"lower it")

    # optimization
    peak_lr = recipe.lr_at(dcfg.batch_size)
    optimizer = build_optimizer(net, peak_lr, ocfg.momentum, ocfg.nesterov, ocfg.weight_decay,
                                ocfg.no_decay_norm_bias, ocfg.bias_lr_scale)
    average = WeightAverage(net, ocfg.ema_decay, ocfg.ema_every) if ocfg.ema_decay > 0 else None
    shown = net if average is None else average.module  # what is evaluated and saved
    scheduler = build_scheduler(optimizer, steps_per_epoch, recipe.epochs, ocfg.warmup_epochs, ocfg.schedule,
                                ocfg.min_lr, ocfg.milestones, ocfg.gamma)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
    criterion = nn.CrossEntropyLoss(label_smoothing=ocfg.label_smoothing)
    model: nn.Module = net
    if world > 1:
        model = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    if rt.compile:
        model = torch.compile(model)

    # resume
    history: list[dict] = []
    start_epoch = 0
    amp_epochs = {"1": amp}   # the precision of each stretch of epochs, by its first epoch
    if resume:
        folder, state = restore(out, recipe, net, average, optimizer, scheduler, scaler, device)
        history = list(state["history"])
        start_epoch = int(state["epoch"])
        if "guard" in state:
            guard.load_state_dict(state["guard"])
            stopped = bool(state["stopped"])
        if state.get("world_size", world) != world:
            say(f"warning: resuming a run of {state['world_size']} processes with {world}; "
                f"the data order differs from an uninterrupted run")
        amp_epochs = amp_epochs_on_resume(read_sidecar(folder / "model.safetensors"), start_epoch, amp, say)
        say(f"resumed from {folder} (epoch {start_epoch}/{recipe.epochs})")
    elif latest_checkpoint(out) is not None:
        raise ResumeError(f"{out} already holds a run; pass --resume to continue it or choose another --out")

    meta_base = {"recipe": recipe.to_dict(), "recipe_sha256": recipe.sha256(), "recipe_source": recipe.source,
                 "dataset": recipe.dataset, "data_variant": data_variant(train_set.dataset),
                 "versions": versions(), "git_commit": git_commit(),
                 "world_size": world, "amp": amp, "amp_epochs": amp_epochs}
    if adversarial:  # recorded in every checkpoint: never to be taken for a standard one
        meta_base["adversarial"] = adv.describe(acfg)
    writer = None
    if main:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "recipe.json", {"recipe": recipe.to_dict(), "sha256": recipe.sha256(),
                                                "source": recipe.source})
        writer = _tensorboard(out)
        say(f"training {recipe.model} on {recipe.dataset}: {len(train_set)} images, {world} process(es), "
            f"global batch {dcfg.batch_size}, peak lr {peak_lr:g}, {recipe.epochs} epochs of {steps_per_epoch} "
            f"steps, device {device}")

    step_images = per_rank * world
    end_epoch = recipe.epochs if stop_after is None else min(recipe.epochs, start_epoch + stop_after)
    if stopped:
        end_epoch = start_epoch
    for epoch in range(start_epoch, end_epoch):
        sampler.set_epoch(epoch)
        train_set.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        start, cpu_start = time.perf_counter(), time.process_time()
        bar = None
        if main and progress:
            from tqdm import tqdm

            bar = tqdm(total=steps_per_epoch, desc=f"epoch {epoch + 1}/{recipe.epochs}", leave=False,
                       dynamic_ncols=True, file=sys.stderr)
        for step, (images, labels) in enumerate(train_loader):
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            if rt.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            global_step = epoch * steps_per_epoch + step
            if adversarial:
                eps = adv.eps_at(acfg, global_step, steps_per_epoch)
                loss = adv.adversarial_loss(acfg, model, net, criterion, images, labels, eps,
                                            adv.step_seed(recipe.seed, global_step), autocast)
            else:
                with autocast():
                    loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if ocfg.clip_grad_norm > 0:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(net.parameters(), ocfg.clip_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if average is not None:
                average.maybe_update(net, global_step)
            loss_sum += loss.detach().double()
            if bar is not None:
                bar.update(1)
                if step % 10 == 0:
                    bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{optimizer.param_groups[0]['lr']:.4g}")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        if bar is not None:
            bar.close()
        if is_distributed():
            dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / (steps_per_epoch * world)
        if not torch.isfinite(torch.tensor(train_loss)):
            raise FloatingPointError(f"epoch {epoch + 1}: training loss is {train_loss}; lower optim.lr or set "
                                     f"optim.clip_grad_norm")
        top1, top5, _ = evaluate(shown, eval_loader, device, autocast, rt.channels_last)
        row = {"epoch": epoch + 1, "train_loss": train_loss, "lr": optimizer.param_groups[0]["lr"],
               "images_per_s": steps_per_epoch * step_images / seconds, "eval_top1": top1, "eval_top5": top5,
               "epoch_seconds": seconds}
        improved = False
        if adversarial:
            row["eps"] = adv.eps_at(acfg, (epoch + 1) * steps_per_epoch - 1, steps_per_epoch)
            row["guard_pgd_top1"] = float("nan")
            if guard_loader is not None:
                counts = adv.guard_counts(shown, guard_loader, acfg.eps, acfg.guard_steps, recipe.seed, device,
                                          autocast)
                if is_distributed():
                    dist.all_reduce(counts)
                row["guard_pgd_top1"] = 100.0 * counts[0].item() / max(counts[1].item(), 1)
                improved, stopped = guard.record(row["guard_pgd_top1"])
        row["epoch_cpu_s"] = time.process_time() - cpu_start  # this process's CPU time: training, test, guard
        history.append(row)
        if main:
            if improved:  # before the epoch's state, which names the best epoch
                save_best(out, shown, dict(meta_base, epoch=epoch + 1, metrics=row))
            save_epoch(out, net, optimizer, scheduler, scaler, device, history, recipe, world, meta_base, average,
                        extra={"guard": guard.state_dict(), "stopped": stopped} if adversarial else None)
            _write_csv(out / "metrics.csv", history)
            if writer is not None:
                for key in CSV_COLUMNS[1:]:
                    writer.add_scalar(key, row[key], epoch + 1)
                writer.flush()
            say(f"epoch {epoch + 1}/{recipe.epochs}: loss {train_loss:.4f}, lr {row['lr']:.5g}, "
                f"{row['images_per_s']:.1f} img/s, {dcfg.eval_split} top-1 {top1:.2f}% top-5 {top5:.2f}%"
                + (f", guard PGD-{acfg.guard_steps} top-1 {row['guard_pgd_top1']:.2f}% (best epoch "
                   f"{guard.best_epoch})" if guard_loader is not None else ""))
        barrier()
        if stopped:
            say(f"guard: PGD-{acfg.guard_steps} accuracy {guard.history[-1]:.2f}% fell below {acfg.guard_collapse:g} "
                f"of its best ({guard.best:.2f}%, epoch {guard.best_epoch}): catastrophic overfitting; stopping "
                f"and keeping epoch {guard.best_epoch}")
            break

    if end_epoch < recipe.epochs and not stopped:
        say(f"stopped after epoch {end_epoch}/{recipe.epochs}; continue with --resume")
        return {"history": history, "weights": None, "sha256": None}
    weights = out / "model.safetensors"
    sha = None
    if main:
        meta = dict(meta_base, epoch=len(history), metrics=history[-1] if history else {}, history=history)
        if guard_loader is not None and guard.best_epoch:  # model selection by the guard, never the test set
            shown.load_state_dict(load_file(str(out / "checkpoints" / "best" / "model.safetensors"),
                                            device=str(device)))
            meta.update(epoch=guard.best_epoch, metrics=history[guard.best_epoch - 1],
                        selected_by=f"guard: best PGD-{acfg.guard_steps} accuracy on {acfg.guard_images} held-out "
                                    f"training images", stopped_early=stopped)
        sha = save_checkpoint(weights, shown, meta)
        say(f"wrote {weights} (sha256 {sha})")
        if writer is not None:
            writer.close()
    barrier()
    return {"history": history, "weights": str(weights), "sha256": sha}


