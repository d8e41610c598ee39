"""APGD-CE and APGD-T: Auto-PGD of Croce & Hein, ICML 2020, "Reliable evaluation of adversarial
robustness with an ensemble of diverse parameter-free attacks", Algorithm 1.

Own implementation, checked against a per-image loop written from Algorithm 1 in
``tests/test_apgd.py``; torchattacks 3.5.1 (``APGD``, ``APGDT``) and the official fra31/auto-attack
``autopgd_base.py`` were read for comparison and deviate from the paper in the points listed below.

What is implemented (Algorithm 1, section 3):

* step size ``eta`` starts at ``2 * eps`` (per image); momentum ``alpha = 0.75``:
  ``z(k+1) = P(x(k) + eta * d(x(k)))``, ``x(k+1) = P(x(k) + alpha (z(k+1) - x(k)) + (1 - alpha)(x(k) - x(k-1)))``,
  with ``x(1) = P(x(0) + eta * d(x(0)))`` (no momentum on the first step). ``d`` is the steepest
  ascent direction of the norm: ``sign(grad)`` for L-inf, ``grad / ||grad||_2`` for L2 (the paper
  writes ``grad f``; both its code versions use these directions).
* checkpoints ``w_j = ceil(p_j * N_iter)``, ``p_0 = 0``, ``p_1 = 0.22``,
  ``p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)`` (:func:`checkpoints`; computed in exact
  integer hundredths: in floats p_3 is 0.5700000000000001, whose ceil(100 p_3) would give 58).
  For N_iter = 100: 22, 41, 57, 70, 80, 87, 93, 99. Duplicate ``w_j`` (small N_iter) collapse.
* at checkpoint ``w_j``, per image, halve ``eta`` and set ``x(w_j) <- x_max`` (its gradient is
  the one stored with ``x_max``) if Condition 1 or 2 holds. Timing (the paper's indices are one
  apart here): Algorithm 1 tests ``k in W`` after computing ``x(k+1)`` and then overwrites ``x(k+1)``,
  while Conditions 1-2 are written with iterates up to ``x(w_j)`` and ``f_max(w_j)``; we test
  once ``x(w_j)`` exists and overwrite ``x(w_j)``, which keeps the conditions exactly as written
  and is what the authors' code does. The halving applies from the step computing ``x(w_j + 1)``.
  Condition 1: ``#{i in [w_{j-1}, w_j - 1]: f(x(i+1)) > f(x(i))} < rho * (w_j - w_{j-1})``,
  ``rho = 0.75``, or Condition 2: ``eta`` was not halved at ``w_{j-1}`` and ``f_max`` did not
  increase since ``w_{j-1}``. Condition 2 is active from the first checkpoint on (``eta`` is
  unchanged since ``w_0 = 0``, ``f_max(w_0) = f(x(0))``). After a restart ``x(w_j)`` *is*
  ``x_max``, so the next interval's first comparison is against ``f_max``.
* ``x_max``/``f_max``: the highest-loss iterate per image, ``x(0)`` included.
* ``P``: L-inf: clip to the eps-box, then to [0, 1] (the exact projection onto their
  intersection). L2: scale onto the eps-ball, then clip to [0, 1]. The paper is vague here; the
  second is not the exact projection onto ball and box but stays inside both (clipping moves
  every pixel toward the clean image, which is in [0, 1]); both code versions do the same.
* ``x(0)``: a random start on the boundary of the ball (the paper leaves it open; as the official
  code): L-inf ``eps * u / ||u||_inf``, ``u ~ U[-1, 1]``; L2 ``eps * g / ||g||_2``, ``g ~ N(0, I)``;
  then clipped to [0, 1]. Drawn from a local CPU ``torch.Generator`` seeded by ``config.seed``
  on every device (:mod:`robust_attn.attacks.rng`; the global RNG is neither used nor reseeded),
  for the whole batch at every restart, so an image's start depends only on its position, the
  seed and the restart.
* losses: cross-entropy (APGD-CE); DLR, eq. 5, ``-(z_y - max_{i != y} z_i) / (z_pi1 - z_pi3)``
  (:func:`dlr_loss`); targeted DLR, eq. 6, ``-(z_y - z_t) / (z_pi1 - (z_pi3 + z_pi4) / 2)``
  (:func:`dlr_loss_targeted`), ``pi`` sorting the logits in decreasing order. Both add 1e-12 to
  the denominator (a choice: the paper has none; ties of the top logits would divide by 0).
  DLR needs >= 3 classes and targeted DLR >= 4: fewer is a clear error.
* early stop (``options["early_stop"]``, default True): within a run an image is not iterated
  once a successful iterate was found; only the images still resisting cost passes. Each image's
  iterates are the same function either way (its loss and gradient depend on it alone), so the
  same images are fooled; the points kept may differ in float rounding (smaller batches).
  ``early_stop=False`` iterates every image to the end, as Algorithm 1 and the reference loop of
  the tests (which it matches bit for bit). After each run the images it fooled are judged again
  with one forward of the whole batch (the others at their current points), as the records are:
  float rounding depends on the batch, and an image fooled only in a sub-batch (a borderline
  margin) would otherwise count as done here yet be classified correctly in the records; so it
  stays in play for the next restart or target class.
* restarts (``config.restarts``): each restart runs only on images not yet fooled; per image the
  first successful iterate found is returned (an image the model already gets wrong, or already
  puts in the target class, is returned unchanged), else the highest-loss point over all runs.

APGD-T (``apgd-t``):

* ``targeted=False`` (the evaluation use, as in AutoAttack's standard version): one run per
  target class for each of the ``options["n_target_classes"]`` (default ``min(9, C - 1)``) most
  likely wrong classes of the clean image, in decreasing order of logit, each with
  ``config.restarts`` restarts, on the targeted DLR loss; success is any misclassification
  (untargeted success via targeted runs). Images fooled by one target are not attacked further.
  For images never fooled the highest targeted-DLR point over all targets and restarts is returned.
* ``targeted=True`` (our choice; the paper has no given-target mode): one run per restart toward
  the given target per image, on eq. 6 with ``y`` the true label and ``t`` the given target;
  success is ``prediction == target``. ``n_target_classes`` is ignored.

Deviations of torchattacks 3.5.1 (``APGD``/``APGDT``) from the paper:

1. checkpoint schedule: first interval ``int(0.22 N)``, then the interval shrinks by
   ``max(int(0.03 N), 1)`` down to ``max(int(0.06 N), 1)``, all truncated, instead of
   ``ceil(p_j N)``. Equal for N = 100; different otherwise (N = 10: checks after 2, 3, 4, ..., 10
   instead of 3, 5, 6, 7, 8, 9, 10; see the test). The official code does the same.
2. Condition 1's first comparison at the first checkpoint is ``f(x(1)) > loss_steps[-1]``, an
   index wrap-around onto a not yet filled row of zeros, instead of ``f(x(1)) > f(x(0))`` (true
   for CE > 0 almost always, false for a negative DLR). Official code: same.
3. Condition 1 halves when the count is ``<= rho * interval`` instead of ``<`` (differs when
   ``rho * interval`` is an integer, e.g. 12 for the interval 16 at N = 100). Official: same.
4. Condition 2 is disabled at the first checkpoint (``reduced_last_check`` starts True), though
   ``eta`` is unchanged since ``w_0``. Official code: same.
5. After a restart the next interval's first comparison uses the loss of the discarded iterate,
   not of ``x_max`` that replaced it. Official code: same.
6. ``APGDT`` with L2 steps every image with ``step_size[0]``, the first image's step size, not
   its own (the official code uses per-image step sizes).
7. What is returned: the clean image for every image not fooled (not the best-loss point), and
   within a run the *last* successful iterate rather than the first. Official code: same.
8. Seeding: ``torch.random.manual_seed(seed)`` (and CUDA's) reseeds the global RNG as a side
   effect of every call. Official code: same.
9. DLR on fewer than 3 (untargeted) or 4 (targeted) classes: an ``IndexError`` from the sort,
   not a clear error. Default ``steps=10`` (paper: 100); ``APGDT`` targets all
   ``n_classes - 1`` wrong classes by default (AutoAttack's standard version: 9).
Deviations 1-5 are all that separates torchattacks' APGD run from Algorithm 1: the slow test
``test_torchattacks_deviations_are_exactly_the_documented_ones`` reproduces its runs bit for bit
from the same start with them (32/32 images; L-inf and L2, CE and DLR, N = 100 and 10), while
Algorithm 1 as in the paper agrees on 26-30/32 images at N = 100 and 9-17/32 at N = 10.
Not deviations: both reduce the loss by ``sum`` over the batch before the gradient, which gives
each image its own gradient, as here.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from robust_attn.attacks import rng
from robust_attn.attacks.apgd_run import (ALPHA, RHO, APGDRun, per_image, apgd_single_run, checkpoints,
                                           project, random_start)
from robust_attn.attacks.base import Attack, AttackConfig, AttackInputError, AttackOutput, register_attack
from robust_attn.attacks.progress import changed_rows, put_rows

__all__ = ["APGDCE", "APGDT", "checkpoints", "dlr_loss", "dlr_loss_targeted", "random_start", "project",
           "apgd_single_run", "APGDRun", "DEFAULT_STEPS", "RHO", "ALPHA", "N_TARGET_CLASSES"]

DEFAULT_STEPS = 100
N_TARGET_CLASSES = 9
DLR_EPS = 1e-12
PAPER = "Croce & Hein, ICML 2020, Algorithm 1 (APGD)"


def _check_classes(logits: torch.Tensor, need: int, what: str) -> None:
    if logits.dim() != 2 or logits.shape[1] < need:
        got = f"{logits.shape[1]} classes" if logits.dim() == 2 else f"logits of shape {tuple(logits.shape)}"
        uses = "z_pi3" if need == 3 else "z_pi3 and z_pi4"
        raise AttackInputError(f"{what} needs at least {need} classes (its denominator uses {uses}, the "
                               f"{need}{'rd' if need == 3 else 'th'} largest logit), but the model gives {got}: "
                               f"use apgd-ce (cross-entropy, any number of classes) instead")


def dlr_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Eq. 5, per image: ``-(z_y - max_{i != y} z_i) / (z_pi1 - z_pi3 + 1e-12)``."""
    _check_classes(logits, 3, "the DLR loss (eq. 5)")
    top = logits.sort(1, descending=True).values
    z_y = logits.gather(1, labels[:, None])[:, 0]
    other = logits.scatter(1, labels[:, None], float("-inf")).amax(1)
    return -(z_y - other) / (top[:, 0] - top[:, 2] + DLR_EPS)


def dlr_loss_targeted(logits: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Eq. 6, per image: ``-(z_y - z_t) / (z_pi1 - (z_pi3 + z_pi4) / 2 + 1e-12)``."""
    _check_classes(logits, 4, "the targeted DLR loss (eq. 6)")
    top = logits.sort(1, descending=True).values
    z_y = logits.gather(1, labels[:, None])[:, 0]
    z_t = logits.gather(1, targets[:, None])[:, 0]
    return -(z_y - z_t) / (top[:, 0] - (top[:, 2] + top[:, 3]) / 2 + DLR_EPS)


class _APGDBase(Attack):
    paper = PAPER
    portable_progress = True   # its generator is a CPU one on every device (robust_attn.attacks.rng)

    def __init__(self, config: AttackConfig):
        super().__init__(config)
        self.steps = self.own_step_sizes(DEFAULT_STEPS, "sets and adapts its own step size (2*eps, halved at "
                                                        "checkpoints; Algorithm 1)")

    def _attack(self, model: nn.Module, images: torch.Tensor, runs, success_fn_clean: torch.Tensor,
                generator: torch.Generator) -> torch.Tensor:
        """Run ``runs`` (a list of ``(loss_fn(logits, idx), success_fn(logits, idx))``, each repeated
        ``config.restarts`` times) on the images not yet done; keep first successes, else best loss.
        With ``self.progress`` the state before a run, or after an iterate of a run, is saved when
        due, and a saved state resumes there (:mod:`robust_attn.attacks.progress`)."""
        c = self.config
        done = success_fn_clean.clone()
        adv = images.clone()
        best = images.clone()
        best_loss = torch.full((images.shape[0],), float("-inf"), dtype=images.dtype, device=images.device)
        saved = self.progress.state if self.progress is not None else None
        if saved is not None:   # a killed run: continue after the last run it saved
            done, best_loss = saved["done"].to(done), saved["best_loss"].to(best_loss)
            put_rows(adv, saved["adv"])
            put_rows(best, saved["best"])
            generator.set_state(saved["gen"].cpu())
        order = [(loss_fn, success_fn) for loss_fn, success_fn in runs for _ in range(c.restarts)]
        all_idx = torch.arange(images.shape[0], device=images.device)

        def state(position: int, **run) -> dict:   # what the rest depends on, before run `position`'s result
            return {"runs_done": position, "done": done, "best_loss": best_loss, "adv": changed_rows(adv, images),
                    "best": changed_rows(best, images), "gen": generator.get_state(), **run}

        for position, (loss_fn, success_fn) in enumerate(order):
            if saved is not None and position < saved["runs_done"]:
                continue
            run = saved.get("run") if saved is not None and position == saved["runs_done"] else None
            if run is None and position and self.progress is not None and self.progress.due():
                self.progress.save(state(position),
                                   note=f"run {position} of {len(order)} done, {int((~done).sum())} images "
                                        f"not fooled yet", fraction=position / len(order))
            # whole batch: position-wise draws (a run resumed mid-way drew its start before the save)
            start = random_start(images, c.norm, c.eps, generator) if run is None else None
            todo = (~done).nonzero().flatten()
            if todo.numel() == 0:
                continue

            def save(run_state, position=position):
                if self.progress.due():
                    now = run_state()
                    self.progress.save(state(position, run=now),
                                       note=f"run {position + 1} of {len(order)}: iterate {now['k']} of "
                                            f"{self.steps}, {int((~done).sum())} images not fooled yet",
                                       fraction=(position + now["k"] / self.steps) / len(order))
            res = apgd_single_run(model, images[todo], start[todo] if start is not None else None,
                                  lambda z, j, i=todo, f=loss_fn: f(z, i[j]),
                                  lambda z, j, i=todo, f=success_fn: f(z, i[j]),
                                  c.norm, c.eps, self.steps,
                                  stop_on_success=c.options.get("early_stop", True), resume=run,
                                  save=save if self.progress is not None else None)
            better = res.loss_best > best_loss[todo]
            best[todo[better]] = res.x_best[better]
            best_loss[todo[better]] = res.loss_best[better]
            found = res.x_success[res.success]
            hit = todo[res.success]
            if hit.numel():   # judged again in the whole batch, as the records are (module docstring)
                batch = torch.where(per_image(done, images), adv, best)
                batch[hit] = found
                with torch.no_grad():
                    fooled = success_fn(model(batch), all_idx)[hit]
                hit, found = hit[fooled], found[fooled]
            adv[hit] = found
            done[hit] = True
        adv[~done] = best[~done]
        return adv


@register_attack
class APGDCE(_APGDBase):
    """APGD on the cross-entropy loss, untargeted (module docstring); L-inf and L2."""

    name = "apgd-ce"
    targeted_modes = (False,)

    def _run(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
             targets: torch.Tensor | None) -> AttackOutput:
        gen = rng.generator(self.config.seed)   # a CPU generator: progress portable across devices
        with torch.no_grad():
            clean = model(images).argmax(1) != labels
        runs = [(lambda z, i: F.cross_entropy(z, labels[i], reduction="none"),
                 lambda z, i: z.argmax(1) != labels[i])]
        return AttackOutput(self._attack(model, images, runs, clean, gen))


@register_attack
class APGDT(_APGDBase):
    """APGD on the targeted DLR loss (eq. 6); untargeted via the most likely wrong classes as
    targets (AutoAttack's APGD-T), or toward given targets (module docstring); L-inf and L2."""

    name = "apgd-t"

    def __init__(self, config: AttackConfig):
        super().__init__(config)
        self.target_classes(2 ** 31)   # checks the option's type now; its range needs the model

    def _run(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
             targets: torch.Tensor | None) -> AttackOutput:
        gen = rng.generator(self.config.seed)   # a CPU generator: progress portable across devices
        with torch.no_grad():
            logits = model(images)
        _check_classes(logits, 4, "apgd-t (targeted DLR loss, eq. 6)")
        num_classes = logits.shape[1]
        if self.config.targeted:
            clean = logits.argmax(1) == targets
            runs = [(lambda z, i: dlr_loss_targeted(z, labels[i], targets[i]),
                     lambda z, i: z.argmax(1) == targets[i])]
        else:
            n = self.target_classes(num_classes, N_TARGET_CLASSES)
            clean = logits.argmax(1) != labels
            ranked = logits.scatter(1, labels[:, None], float("-inf")).argsort(1, descending=True)
            runs = [(lambda z, i, t=ranked[:, r]: dlr_loss_targeted(z, labels[i], t[i]),
                     lambda z, i: z.argmax(1) != labels[i]) for r in range(n)]
        return AttackOutput(self._attack(model, images, runs, clean, gen))
