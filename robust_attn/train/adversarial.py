"""Adversarial training: the training examples of each step, and the catastrophic-overfitting guard.

Three methods, each with the model in the mode its paper's code uses while making the examples,
all under an L-inf ball of radius ``eps`` around images in [0, 1] (normalization is inside the
model), with the attacks of :mod:`robust_attn.attacks`:

* ``fgsm``: "fast" adversarial training (Wong, Rice & Kolter, ICLR 2020, Algorithm 3): one signed
  gradient step of size ``1.25 eps`` from a uniform random start in the ball, projected back; the
  model in train mode; the loss is the cross-entropy at the example. PGD with one step.
* ``pgd``: PGD-AT (Madry et al. 2018, eq. (2.1)): ``steps`` signed-gradient steps of size ``step``
  (default ``eps / 4``: 2/255 at 8/255, as Madry et al. and Rice et al. 2020) from a uniform
  random start; model in train mode; cross-entropy at the last iterate.
* ``trades``: TRADES (Zhang et al., ICML 2019, eq. (5) and Algorithm 1): the example maximises
  ``KL(f(x) || f(x'))`` from ``x + 0.001 N(0, 1)``, with the model in eval mode; the loss, in train
  mode, is ``CE(f(x), y) + beta * KL(f(x) || f(x'))`` (batch mean).

The attack's random start of step ``t`` is seeded from ``(seed, t)``, so a resumed run draws
what an uninterrupted one does. ``eps_warmup_epochs`` ramps ``eps`` (and the step size with it)
linearly from 0 per step.

The guard (Rice, Wong & Kolter, ICML 2020, "Overfitting in adversarially robust deep learning";
Wong et al. section 5.2 for catastrophic overfitting): after every epoch, PGD-``guard_steps``
accuracy at ``eps`` on ``guard_images`` training images held out from training (eval mode, the
model that is saved). The best epoch's model is kept and becomes the final model; when the guard
accuracy falls below ``guard_collapse`` times its best, training stops there (early stopping).
The test set is never looked at.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from robust_attn.attacks.base import AttackConfig
from robust_attn.attacks.inputs import frozen_parameters
from robust_attn.attacks.pgd_lp import PGD
from robust_attn.train.recipe import AdversarialConfig

__all__ = ["attack_steps", "attack_step_size", "eps_at", "adversarial_examples", "adversarial_loss", "step_seed",
           "guard_counts", "guard_split", "GuardState", "describe"]

_SEED_STRIDE = 1_000_003


def attack_steps(cfg: AdversarialConfig) -> int:
    return cfg.steps if cfg.steps is not None else (1 if cfg.method == "fgsm" else 10)


def attack_step_size(cfg: AdversarialConfig, eps: float) -> float:
    """The step size at radius ``eps`` (``cfg.step`` scaled with the eps warm-up)."""
    if cfg.step is not None:
        return cfg.step * eps / cfg.eps
    return 1.25 * eps if cfg.method == "fgsm" else eps / 4


def eps_at(cfg: AdversarialConfig, step: int, steps_per_epoch: int) -> float:
    """The radius at optimizer step ``step`` (0-based): linear from ``eps / warm-up steps`` to eps."""
    warm = int(round(cfg.eps_warmup_epochs * steps_per_epoch))
    if warm <= 0 or step >= warm:
        return cfg.eps
    return cfg.eps * (step + 1) / warm


class _TrainingPGD(PGD):
    """PGD returning its last iterate (``keep = "last"``) without the evaluation of that iterate
    that an evaluation attack makes, which a training step does not need (and which, in train
    mode, would move the batch-norm statistics once more)."""

    def _one_restart(self, model, x0, labels, targets, start):
        x = start
        for k in range(self.steps):
            _, _, grad = self._evaluate(model, x, labels, targets, need_grad=True)
            with torch.no_grad():
                x = self._step(x.detach(), x0, grad, self.schedule[k])
        return x, torch.zeros(len(x0), dtype=torch.bool, device=x0.device), torch.zeros(len(x0), device=x0.device)


class _TradesPGD(_TrainingPGD):
    """PGD ascending ``KL(p || f(x'))`` for fixed clean probabilities ``p`` (TRADES's inner
    maximization), from TRADES's start ``x + 0.001 N(0, 1)``."""

    reference: torch.Tensor

    def _objective(self, logits, labels, targets):
        return F.kl_div(F.log_softmax(logits.float(), dim=1), self.reference, reduction="none").sum(1)

    def _random_start(self, x0, gen):
        noise = torch.randn(x0.shape, generator=gen, device=x0.device, dtype=x0.dtype)
        return (x0 + 0.001 * noise).clamp(0, 1)


def _attack(cls, net: nn.Module, images: torch.Tensor, labels: torch.Tensor, eps: float, steps: int, size: float,
            seed: int, reference: torch.Tensor | None = None) -> torch.Tensor:
    config = AttackConfig("pgd", norm="linf", eps=eps, steps=steps, step=size, seed=seed,
                          options={"random_start": True, "keep": "last"})
    attack = cls(config)
    if reference is not None:
        attack.reference = reference
    # Attack.run insists on an eval-mode model (right for evaluation); the training attacks of
    # fgsm and pgd run in train mode, so the attack's own loop is called, then its output check.
    with torch.enable_grad(), frozen_parameters(net):
        adv = attack._run(net, images.detach(), labels, None).adv
    attack._check_output(images, adv)  # within the ball and [0, 1], or an error
    return adv.detach()


def adversarial_examples(cfg: AdversarialConfig, net: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                         eps: float, seed: int, autocast) -> torch.Tensor:
    """The training examples of one step (module docstring); ``net`` is left in train mode."""
    steps, size = attack_steps(cfg), attack_step_size(cfg, eps)
    if cfg.method == "trades":
        net.eval()
        with torch.no_grad(), autocast():
            reference = F.softmax(net(images).float(), dim=1)
        with autocast():
            adv = _attack(_TradesPGD, net, images, labels, eps, steps, size, seed, reference)
    else:
        net.train()
        with autocast():
            adv = _attack(_TrainingPGD, net, images, labels, eps, steps, size, seed)
    net.train()
    return adv


def adversarial_loss(cfg: AdversarialConfig, model: nn.Module, net: nn.Module, criterion: nn.Module,
                     images: torch.Tensor, labels: torch.Tensor, eps: float, seed: int, autocast) -> torch.Tensor:
    """The training loss of one step at radius ``eps``; ``model`` is what is trained (``net`` or
    its DDP / compiled wrapper), ``net`` the plain module the examples are made on. TRADES's second
    forward pass (the adversarial one) goes through ``net``: DDP allows one forward pass of its
    wrapper per backward, and the gradients of both passes meet in the same parameters."""
    adv = adversarial_examples(cfg, net, images, labels, eps, seed, autocast)
    with autocast():
        if cfg.method != "trades":
            return criterion(model(adv), labels)
        logits = model(images)
        robust = F.kl_div(F.log_softmax(net(adv).float(), dim=1), F.softmax(logits.float(), dim=1),
                          reduction="batchmean")
        return criterion(logits, labels) + cfg.trades_beta * robust


def step_seed(seed: int, global_step: int) -> int:
    return (int(seed) * _SEED_STRIDE + int(global_step)) % (2**63 - 1)


def guard_split(num_images: int, guard_images: int, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, guard indices): a seeded random ``guard_images`` of ``num_images``."""
    if guard_images >= num_images:
        raise ValueError(f"adversarial.guard_images = {guard_images} leaves no training images of {num_images}; "
                         f"lower it")
    order = torch.randperm(num_images, generator=torch.Generator().manual_seed(int(seed) + 7919)).tolist()
    return sorted(order[guard_images:]), sorted(order[:guard_images])


def guard_counts(model: nn.Module, loader, eps: float, steps: int, seed: int, device: torch.device,
                 autocast) -> torch.Tensor:
    """(images robust to PGD-``steps`` at ``eps``, images) over ``loader``: step eps / 4, random
    start, an image counts as broken once any iterate fools the model; eval mode."""
    was_training = model.training
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        config = AttackConfig("pgd", norm="linf", eps=eps, steps=steps, step=eps / 4, seed=seed)
        with autocast():
            adv = PGD(config).run(model, images, labels).adv
            with torch.no_grad():
                counts[0] += (model(adv).argmax(1) == labels).sum()
        counts[1] += len(labels)
    model.train(was_training)
    return counts


class GuardState:
    """The guard's record: accuracy per epoch, the best epoch and whether training collapsed.
    A collapse is a fall below ``collapse`` times the best, once the best is above ``floor``
    (chance level: a model that never was robust cannot collapse)."""

    def __init__(self, collapse: float, floor: float = 0.0):
        self.collapse = collapse
        self.floor = floor
        self.history: list[float] = []
        self.best_epoch = 0
        self.best = -1.0

    def record(self, accuracy: float) -> tuple[bool, bool]:
        """Add an epoch's guard accuracy; returns (is the new best, has training collapsed)."""
        self.history.append(float(accuracy))
        improved = accuracy > self.best
        if improved:
            self.best, self.best_epoch = float(accuracy), len(self.history)
        collapsed = self.collapse > 0 and self.best > self.floor and accuracy < self.collapse * self.best
        return improved, collapsed

    def state_dict(self) -> dict:
        return {"history": list(self.history), "best_epoch": self.best_epoch, "best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.history = [float(v) for v in state["history"]]
        self.best_epoch, self.best = int(state["best_epoch"]), float(state["best"])


def describe(cfg: AdversarialConfig) -> dict:
    """What a checkpoint records of its adversarial training (resolved defaults included)."""
    return {"method": cfg.method, "norm": "linf", "eps": cfg.eps, "eps_255": round(cfg.eps * 255, 6),
            "steps": attack_steps(cfg), "step": attack_step_size(cfg, cfg.eps),
            "eps_warmup_epochs": cfg.eps_warmup_epochs,
            **({"trades_beta": cfg.trades_beta} if cfg.method == "trades" else {}),
            "guard": {"images": cfg.guard_images, "attack": f"pgd-{cfg.guard_steps}", "collapse": cfg.guard_collapse}}
