"""Targeted L-infinity PGD, the attack of SAN (Zhao et al. 2020) section 5.4, Table 10.

The paper subjects trained models to "white-box targeted PGD attacks [Madry et al. 2018]"
with hyperparameters {eps, rho, n} (max per-pixel perturbation in 1/255 units, step size,
iterations) set to {8, 4, 2} and {8, 2, 4}. It does not write the update down; we use the
one that torchattacks' ``PGD`` (targeted mode) and foolbox's ``LinfPGD``
(``TargetedMisclassification``) both implement, in the same order of operations, so that the
three backends of :func:`targeted_pgd` agree image by image::

    x_0 = x                                         (random_start=False, the paper's setting)
    g   = grad_x CE(model(x_k), target)             (cross-entropy toward the target)
    x'  = x_k - step * sign(g)                      (descend the loss)
    x_{k+1} = clip_[0,1](x + clip_[-eps,eps](x' - x))   (project on the eps-ball, then on [0,1])

Both clips act coordinate-wise on intervals that intersect (x is in [0, 1]), so their order
does not change the exact result; we still follow the libraries' floating-point order
(eps-ball first, in the form ``x + clamp(x' - x)``) so results are bit-identical, not merely
close, in the native backend's exact mode (``exact=True``). Its default mode computes the same
update faster in another float order (batch norm folded into the convolutions, channels-last
layout; see :func:`native_pgd`) and agrees with the libraries up to floating-point ties. The
image returned is the last iterate (no early stop, no "best iterate" bookkeeping), as in both
libraries: an image that reached its target may leave it again in a later step.

The paper is vague on: the loss (we use cross-entropy, as both libraries), the random start
(the paper's numbers are reproduced without, ``random_start=False``), and what "success" means
(see the protocol runner: the prediction equals the target).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from robust_attn.attacks.inputs import frozen_parameters, training_modules, validate_attack_inputs

__all__ = ["PGDConfig", "BACKENDS", "targeted_pgd", "power_of_two_blocks"]

BACKENDS = ("native", "torchattacks", "foolbox")



@dataclass(frozen=True)
class PGDConfig:
    """Hyperparameters {eps, rho, n} of SAN Table 10, ``eps`` and ``step`` in 1/255 units.

    ``PGDConfig(8, 2, 4)`` is eps = 8/255, step = 2/255, 4 iterations. ``eps_abs`` and
    ``step_abs`` are the same numbers in [0, 1] image units.
    """

    eps: float
    step: float
    steps: int
    random_start: bool = False

    def __post_init__(self) -> None:
        for name in ("eps", "step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"PGDConfig.{name} must be a number in 1/255 units (e.g. 8 for 8/255), "
                                f"got {value!r}")
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"PGDConfig.{name} must be finite, got {value!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, numbers.Integral):
            raise TypeError(f"PGDConfig.steps must be an int (number of iterations), got {self.steps!r}")
        if not isinstance(self.random_start, bool):
            raise TypeError(f"PGDConfig.random_start must be a bool, got {self.random_start!r}")
        if self.eps < 0:
            raise ValueError(f"PGDConfig.eps must be >= 0 (1/255 units), got {self.eps}")
        if self.steps < 0:
            raise ValueError(f"PGDConfig.steps must be >= 0, got {self.steps}")
        if self.steps > 0 and self.step <= 0:
            raise ValueError(f"PGDConfig.step must be > 0 when steps > 0 (1/255 units), got {self.step}")
        if self.step < 0:
            raise ValueError(f"PGDConfig.step must be >= 0, got {self.step}")

    @property
    def eps_abs(self) -> float:
        """eps in [0, 1] image units."""
        return float(self.eps) / 255.0

    @property
    def step_abs(self) -> float:
        """Step size in [0, 1] image units."""
        return float(self.step) / 255.0

    def __str__(self) -> str:
        rs = ", random start" if self.random_start else ""
        return f"eps={self.eps}/255, step={self.step}/255, steps={self.steps}{rs}"


def native_pgd(model: nn.Module, images: torch.Tensor, targets: torch.Tensor, config: PGDConfig, *,
               fold_bn: bool = True, channels_last: bool = True) -> torch.Tensor:
    """Batched targeted PGD (module docstring): one forward and one backward per step for the batch.

    Parameters are frozen for the attack (autograd records nothing for weight gradients) and
    the update and projection run in place under ``no_grad``. The cross-entropy is summed, so
    each image's gradient does not depend on the batch size.

    Two speed-ups, both on by default, change only how the same function is computed:

    * ``fold_bn``: attack a cached copy of the model with eval-mode batch norm folded into the
      preceding convolutions (:func:`~robust_attn.attacks.fast_model.attack_model`), which skips
      an elementwise pass per batch norm in the forward and in the backward pass;
    * ``channels_last``: keep the iterate in channels-last layout, so that oneDNN's convolutions
      run without layout reorders.

    Their speed against torchattacks: ``benchmarks/bench_pgd.py`` (results in
    ``benchmarks/results/pgd.json``). Both change the rounding of the gradient
    (``(W * s) * x`` is not ``(W * x) * s``; other convolution kernels sum in another order):
    a gradient component within rounding error of zero can flip sign, which moves that pixel
    by 2 * step; over several steps the difference can grow, and an image that sits near a
    decision boundary can end in another class. So the fast mode agrees with the library
    backends "up to floating-point ties" (tests/test_attacks.py says how closely), while
    ``fold_bn=False, channels_last=False`` (``targeted_pgd(..., exact=True)``) runs the
    libraries' float32 operations in their order and gives bit-identical images (on
    power-of-two batches; :func:`targeted_pgd` says why and splits other sizes).
    """
    eps, step = config.eps_abs, config.step_abs
    targets = targets.to(images.device, torch.long)
    if fold_bn:
        from robust_attn.attacks.fast_model import attack_model

        model = attack_model(model, images[:4].detach())
    # The exact mode keeps the caller's memory layout, as the libraries do (their ``clone()``
    # preserves it): convolving a channels-last batch rounds differently from a contiguous one.
    fmt = torch.channels_last if channels_last else torch.preserve_format
    x0 = images.detach().clone(memory_format=fmt)
    with torch.no_grad():
        if config.random_start:
            x = (x0 + torch.empty_like(x0).uniform_(-eps, eps)).clamp_(0, 1)
        else:
            x = x0.clone()
    with frozen_parameters(model):
        for _ in range(config.steps):
            x.requires_grad_(True)
            with torch.enable_grad():
                # Sum, not mean: the per-image gradient is then independent of the batch size.
                loss = F.cross_entropy(model(x), targets, reduction="sum")
                (grad,) = torch.autograd.grad(loss, x)
            with torch.no_grad():
                x = x.detach()
                x.sub_(grad.sign_().mul_(step))            # x' = x - step * sign(g)
                x.sub_(x0).clamp_(-eps, eps)               # x' - x0, projected on the eps-ball
                x.add_(x0).clamp_(0, 1)                    # back to an image in [0, 1]
    return x.contiguous()


def power_of_two_blocks(n: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges cutting ``n`` items into blocks whose sizes are the powers of two
    of ``n``'s binary expansion, largest first: 60 -> [(0, 32), (32, 48), (48, 56), (56, 60)]."""
    blocks, start = [], 0
    for bit in reversed(range(max(int(n), 0).bit_length())):
        if n >> bit & 1:
            blocks.append((start, start + (1 << bit)))
            start += 1 << bit
    return blocks


def targeted_pgd(model: nn.Module, images: torch.Tensor, targets: torch.Tensor, config: PGDConfig,
                 backend: str = "native", *, labels: torch.Tensor | None = None,
                 exact: bool = False) -> torch.Tensor:
    """Adversarial images from targeted L-inf PGD (SAN Table 10) with one of :data:`BACKENDS`.

    ``model`` takes [0, 1] images (a :class:`~robust_attn.models.wrapper.NormalizedModel`) and must be in
    eval mode; it is left as it was (mode, dtype, device, ``requires_grad`` of parameters).
    ``images`` (N, C, H, W) in [0, 1]; ``targets`` (N,) class indices, e.g. from
    :func:`~robust_attn.attacks.draw_targets`; ``labels`` (optional) are checked to differ from
    the targets. All backends run the same update (module docstring) and agree image by image
    (bit for bit with ``exact=True``, see below) when ``random_start`` is False; random starts come from each library's own use of the
    global torch RNG and are not comparable across backends.

    ``exact``: by default the native attack runs a faster, mathematically equivalent computation
    (batch norm folded into the convolutions, channels-last layout) that agrees with the library
    backends up to floating-point ties, and every backend takes the whole batch at once.
    ``exact=True`` runs the native attack in the libraries' float32 operations and order, in the
    caller's memory layout (see :func:`native_pgd`), and runs *every* backend on the batch split
    into power-of-two blocks (:func:`power_of_two_blocks`: 60 images as 32 + 16 + 8 + 4); the three
    backends then give bit-identical images at any batch size, a ragged last chunk included.

    Why the split: torchattacks differentiates the *mean* cross-entropy, foolbox and the native
    attack the *sum*. The mean's gradient is the sum's times 1/N, which is exact in float32 only
    when N is a power of two; otherwise every gradient entry is rounded differently, and an entry
    within rounding error of zero (e.g. along a direction that shifts all logits alike, whose
    gradient is exactly zero in real arithmetic) can take the other sign, moving that pixel by
    2 * step. So on one batch of a non-power-of-two size, torchattacks and foolbox themselves can
    disagree, and no single computation can be bit-identical to both. On each power-of-two block
    the mean is the sum scaled exactly by 2**-k (barring float32 underflow to subnormals, at
    gradients below ~1e-38), so all three take the same signs. Per image, the split changes only
    which batch size the convolutions run at (oneDNN picks kernels per shape, so the rounding, not
    the function, may change); ``exact=False`` runs the libraries on the whole batch unsplit.

    Where exact mode is still not bit-identical: with ``random_start=True`` (each library draws
    its own noise); with gradients that underflow to float32 subnormals (scaling by 2**-k is then
    not exact); and on GPU unless cuDNN runs deterministic kernels
    (``torch.backends.cudnn.deterministic = True``, ``torch.use_deterministic_algorithms(True)``),
    since its backward convolutions may sum with atomics in a run-dependent order.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attack backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if not isinstance(config, PGDConfig):
        raise TypeError(f"config must be a PGDConfig(eps, step, steps), got {type(config).__name__}")
    if not isinstance(exact, bool):
        raise TypeError(f"exact must be a bool (True: bit-identical to the library backends), got {exact!r}")
    validate_attack_inputs(model, images, targets, labels)
    targets = targets.to(images.device, torch.long)
    before = [(p.dtype, p.device) for p in model.parameters()]
    with torch.enable_grad():  # callers may evaluate under no_grad; the attack needs gradients
        parts = []
        for start, stop in (power_of_two_blocks(len(images)) if exact else [(0, len(images))]):
            x, t = images[start:stop], targets[start:stop]
            if backend == "native":
                parts.append(native_pgd(model, x, t, config, fold_bn=not exact, channels_last=not exact))
            else:
                from robust_attn.attacks import backends

                parts.append(backends.run_backend(backend, model, x, t, config))
        adv = parts[0] if len(parts) == 1 else torch.cat(parts)
    after = [(p.dtype, p.device) for p in model.parameters()]
    if training_modules(model) or before != after:
        raise RuntimeError(f"the {backend} backend changed the model's mode, dtype or device")
    return adv.detach()
