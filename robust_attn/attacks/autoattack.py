"""AutoAttack's standard ensemble (Croce & Hein, ICML 2020, section 5 and its public ``standard`` version).

The ensemble runs four attacks one after another, each only on the images that are still
classified correctly, and keeps per image the first adversarial image found, so the robust
accuracy it reports is the worst case over the four:

1. APGD-CE: untargeted APGD on the cross-entropy, 100 iterations (:mod:`robust_attn.attacks.apgd`);
2. APGD-T: APGD on the targeted DLR loss toward each of the 9 most likely wrong classes, 100
   iterations each;
3. FAB-T: the targeted fast adaptive boundary attack toward the same 9 classes, 100 iterations
   each (:mod:`robust_attn.attacks.fab`);
4. Square: the score-based (gradient-free) attack, 5000 queries (:mod:`robust_attn.attacks.square`).

Images the model already misclassifies are not attacked (their ``by`` is ``"clean"``); the
``by`` of an image fooled by the ensemble names the attack that fooled it first, and is ``""``
for an image that resisted all four. ``options={"attacks": [...]}`` runs another list of
registered untargeted attacks in the same way (e.g. ``["apgd-ce", "square"]`` for a cheaper
check). With fewer than 10 classes the targeted attacks take every wrong class as a target
(``num_classes - 1``).

On a CPU one chunk of AutoAttack can take hours, so the ensemble can save its state after each
member (``state_path``, set by the attack protocol per chunk): the adversarial images found so
far (only those: the rest of the chunk is its inputs), who fooled each image and the queries,
keyed by the images, labels and config. A run killed
mid-chunk then resumes at the next member with the same result, since each member is seeded on
its own and sees only the images still robust. On resuming, the images the state marks fooled are
judged again in the chunk's batch (a state written on another device, or before members were
judged in the whole batch, may mark one that this forward classifies correctly); such an image is
back in play and first faces the members already finished (on those images alone), then the
rest; the member under way keeps its saved progress when they fool every such image again (it
then faces the images its progress was made on), else it starts again. The members also save
their progress within their run in the same file (every ``progress_every_s`` seconds;
:mod:`robust_attn.attacks.progress`), so a killed member resumes where it was rather than from
its beginning; a stop signal (SIGTERM, SIGINT) during a run with a state saves at the next chance
and then stops (:mod:`robust_attn.attacks.stopping`); ``log`` is told of each finished member
and each save, and :meth:`AutoAttack.describe_state` reads a saved state back (``robust-attn
status``).

Each member is seeded from the ensemble's ``seed``; its other settings are the member's own
defaults (the standard version's), except ``steps``, ``restarts`` and ``queries`` when the
ensemble's config sets them (a cheaper run, named so in the condition's name).
"""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from robust_attn.attacks import rng
from robust_attn.attacks.base import Attack, AttackConfig, AttackInputError, AttackOutput, make_attack, register_attack
from robust_attn.attacks.progress import EVERY_S, Progress
from robust_attn.attacks.stopping import raise_if_stop_requested, stop_deferred

#: what a saved state holds (``_save_state``)
STATE_KEYS = frozenset({"key", "done", "fooled", "fooled_adv", "robust", "by", "queries"})

__all__ = ["AutoAttack", "STANDARD"]

STANDARD = ("apgd-ce", "apgd-t", "fab-t", "square")
N_TARGET_CLASSES = 9


@register_attack
class AutoAttack(Attack):
    """The standard AutoAttack ensemble: worst case per image over APGD-CE, APGD-T, FAB-T and Square."""

    name = "autoattack"
    targeted_modes = (False,)
    paper = "Croce & Hein, ICML 2020, section 5 (standard version)"

    def __init__(self, config: AttackConfig):
        super().__init__(config)
        members = config.options.get("attacks", STANDARD)
        if isinstance(members, str) or not members:
            raise AttackInputError(f"options['attacks'] must be a non-empty list of attack names, got {members!r}")
        if self.name in members:
            raise AttackInputError("autoattack cannot contain itself")
        self.member_names = list(members)
        for i, m in enumerate(self.member_names):   # unknown names and unsupported settings fail here
            make_attack(self.member_config(m, i, num_classes=10))

    def member_config(self, member: str, position: int, num_classes: int) -> AttackConfig:
        """The config the ensemble runs ``member`` (at ``position`` in the list) with: its own seed
        and, for a targeted member, the number of target classes; public so that a benchmark
        times exactly what the ensemble runs."""
        c = self.config
        options = {k: v for k, v in c.options.items() if k != "attacks"}
        if member.endswith("-t"):   # the targeted members: the most likely wrong classes
            options.setdefault("n_target_classes", min(N_TARGET_CLASSES, num_classes - 1))
        return AttackConfig(member, norm=c.norm, eps=c.eps, targeted=False, steps=c.steps, restarts=c.restarts,
                            queries=c.queries, seed=c.seed * 16 + position, options=options)

    #: a file to save the state in after each member and to resume from (module docstring); None: none
    state_path: Path | None = None
    #: seconds between two saves of a member's progress within its run (with ``state_path``)
    progress_every_s: float = EVERY_S
    #: told where the ensemble stands after each member and at each save of a member's progress
    #: (lines for the user: the attack protocol prints them with its progress bar); None: silent
    log: Callable[[str], None] | None = None

    def attacked_model(self, model: nn.Module, images: torch.Tensor) -> nn.Module:
        """The model as given: the ensemble judges its members' images on it, as the records do;
        each member queries the model its own :attr:`attack_copy` (the ensemble's) says."""
        return model

    def _state_key(self, images: torch.Tensor, labels: torch.Tensor) -> str:
        digest = hashlib.sha256(images.detach().cpu().contiguous().numpy().tobytes())
        digest.update(labels.cpu().numpy().tobytes())
        digest.update(json.dumps([self.config.as_dict(), self.member_names], sort_keys=True, default=str).encode())
        return digest.hexdigest()

    def _load_state(self, key: str, device) -> dict | None:
        """The saved state of these images and this config, or None (no file, or another chunk's)."""
        if self.state_path is None or not Path(self.state_path).is_file():
            return None
        state = torch.load(self.state_path, map_location=device, weights_only=True)
        if state.get("key") != key:
            return None
        if not STATE_KEYS <= state.keys():   # written by another version: start the chunk afresh
            warnings.warn(f"{self.state_path}: AutoAttack state of another format, ignored (the chunk restarts)",
                          stacklevel=2)
            return None
        return state

    @staticmethod
    def _restore_adv(images: torch.Tensor, saved: dict) -> torch.Tensor:
        """The ensemble's adversarial images from a saved state: the inputs, with the images a
        member fooled replaced by what it found (only those are saved: a fraction of the chunk)."""
        adv = images.clone()
        adv[saved["fooled"]] = saved["fooled_adv"].to(adv.dtype)
        return adv

    def _save_state(self, key: str, done: int, adv, robust, by, queries, member: dict | None = None) -> None:
        """Save the state after ``done`` members; ``member``: the progress of member ``done`` within
        its run (:mod:`robust_attn.attacks.progress`)."""
        if self.state_path is None:
            return
        from robust_attn.utils.io import atomic_path

        Path(self.state_path).parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.state_path) as tmp:
            fooled = torch.tensor([i for i, b in enumerate(by) if b not in ("", "clean")], dtype=torch.long)
            state = {"key": key, "done": done, "fooled": fooled, "fooled_adv": adv[fooled.to(adv.device)].cpu(),
                     "robust": robust.cpu(), "by": list(by), "queries": queries.cpu()}
            torch.save(state if member is None else {**state, "member": member}, tmp)

    def _run(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
             targets: torch.Tensor | None) -> AttackOutput:
        if self.state_path is None:
            return self._ensemble(model, images, labels)
        with stop_deferred():   # SIGTERM / SIGINT: the progress is saved, then the run stops
            return self._ensemble(model, images, labels)

    def _ensemble(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> AttackOutput:
        with torch.no_grad():
            logits = model(images)
        key = self._state_key(images, labels) if self.state_path is not None else ""
        saved = self._load_state(key, images.device)
        if saved is not None:   # a killed run of this chunk: resume after its last finished member
            adv, robust, by, queries, first = (self._restore_adv(images, saved), saved["robust"], saved["by"],
                                               saved["queries"], saved["done"])
            with torch.no_grad():   # states saved before members were judged in the whole batch: judge again
                kept = (model(adv).argmax(1) != labels).tolist()
            back = [i for i, b in enumerate(by) if b not in ("", "clean") and not kept[i]]
            member_saw = robust.clone()   # the images the member under way was attacking
            for i in back:   # not fooled in the chunk's batch: back in play
                by[i], robust[i], adv[i] = "", True, images[i]
        else:
            back = []
            adv = images.clone()
            by = [""] * len(images)
            queries = torch.zeros(len(images), dtype=torch.long, device=images.device)
            robust = logits.argmax(1) == labels
            for i in (~robust).nonzero().flatten().tolist():
                by[i] = "clean"
            first = 0
        back = torch.tensor(back, dtype=torch.long, device=images.device)
        for position, member in enumerate(self.member_names):
            catch_up = position < first   # a resumed run: only the images put back in play, which face
            todo = back[robust[back]] if catch_up else robust.nonzero().flatten()   # every member again
            if todo.numel() == 0:
                if catch_up:
                    continue
                break
            attack = make_attack(self.member_config(member, position, logits.shape[1]))
            attack.attack_copy = self.attack_copy
            resumed = saved.get("member") if saved is not None and position == first else None
            if resumed is not None and not torch.equal(robust, member_saw):
                # images put back in play and not fooled again: the member's progress was made on
                # other images and does not fit; it starts again (when all were, it goes on)
                self._log(f"{member}: {int((robust & ~member_saw).sum())} images put back in play are still "
                          f"robust; its saved progress was on other images, so it starts again")
                resumed = None
            if self.state_path is not None and not catch_up:   # the member may save its progress in the state
                attack.progress = Progress(
                    resumed,
                    lambda m, p=position: self._save_state(key, p, adv, robust, by, queries, member=m),
                    attack=member, device=rng.GENERATOR_DEVICE if attack.portable_progress else images.device,
                    every_s=self.progress_every_s, log=self._log)
            out = attack.run(model, images[todo], labels[todo])
            found = adv.clone()
            found[todo] = out.adv
            with torch.no_grad():   # checked in the whole chunk's batch, as its records are: float rounding
                fooled = (model(found).argmax(1) != labels)[todo]   # depends on the batch (borderline images)
            if out.queries is not None:
                queries[todo] += out.queries.to(queries.device, torch.long)
            hit = todo[fooled]
            adv[hit] = out.adv[fooled]
            robust[hit] = False
            for i in hit.tolist():
                by[i] = member
            if catch_up:   # the state stays at `first` (killed here, the few images are judged and caught up again)
                self._log(f"{member} again on the {todo.numel()} images put back in play: fooled {hit.numel()}")
                continue
            self._save_state(key, position + 1, adv, robust, by, queries)
            self._log(f"{member} done, {int(robust.sum())} of {len(images)} images still robust")
            raise_if_stop_requested()
        self._log(f"finished, {int(robust.sum())} of {len(images)} images robust")
        return AttackOutput(adv, queries=queries, by=by)

    def describe_state(self, state: dict) -> str:
        """One line on a state saved within a chunk (``robust-attn status``): the members finished,
        the images still robust, where the member under way stands and the members still to come."""
        done, robust = int(state["done"]), state["robust"]
        line = (f"{done} of {len(self.member_names)} members done, {int(robust.sum())} of {len(robust)} "
                f"images robust")
        if done < len(self.member_names):
            member = state.get("member")
            where = "not started" if member is None else member.get("note") or "under way, progress saved"
            line += f"; {self.member_names[done]}: {where}{_pace(member)}"
            if done + 1 < len(self.member_names):
                line += f"; then {', '.join(self.member_names[done + 1:])}"
        return line

    def _log(self, line: str) -> None:
        if self.log is not None:
            c = self.config
            self.log(f"autoattack {c.norm} eps={c.eps * 255:.4g}/255: {line}")


def _pace(member: dict | None) -> str:
    """How long the member under way has run (over every process that resumed it, when counted from
    its start) and, from the fraction of its iterations done in the time counted, roughly how long
    it has left at that pace (its later iterations cost less when images get fooled on the way: an
    upper estimate); "" when its progress does not say (saved before it was counted)."""
    if not member or member.get("elapsed") is None or member.get("counted_from") is None:
        return ""
    spent, start, fraction = float(member["elapsed"]), float(member["counted_from"]), member.get("fraction")
    parts = [f"{_duration(spent)} in it"] if start == 0 else []
    if fraction is not None and start < float(fraction) < 1 and spent > 0:
        left = spent * (1 - float(fraction)) / (float(fraction) - start)
        parts.append(f"about {_duration(left)} left at {'that' if start == 0 else 'its recent'} pace")
    return "; " + ", ".join(parts) if parts else ""


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"

