"""The precision a training runs in: the recipe's ``runtime.amp`` resolved for the device, the
autocast context it gives, and the record of it that a resumed run carries on (the sidecar's
``amp_epochs``)."""
from __future__ import annotations

import contextlib

import torch

from robust_attn.train.recipe import RecipeError
from robust_attn.utils.hardware import native_bf16

__all__ = ["resolve_amp", "amp_context", "amp_epochs_on_resume"]


def resolve_amp(device: torch.device, amp: str, say=lambda _msg: None) -> str:
    """The autocast precision a run uses: the recipe's ``runtime.amp``, with "auto" resolved to
    "bf16" where the device computes bf16 in hardware (:func:`robust_attn.utils.hardware.native_bf16`)
    and "none" elsewhere. An explicit "bf16" on a CPU without it is kept, with a warning that
    names the override: emulated bf16 is many times slower than float32 there."""
    if amp == "auto":
        resolved = "bf16" if native_bf16(device) else "none"
        say(f"runtime.amp = auto: {resolved} on this {device.type} "
            f"({'native bf16' if resolved == 'bf16' else 'no native bf16: float32'})")
        return resolved
    if amp == "bf16" and device.type == "cpu" and not native_bf16(device):
        say(f'warning: runtime.amp = "bf16" on a CPU without native bf16 ({torch.backends.cpu.get_cpu_capability()}, '
            "no AVX512-BF16 or AMX): autocast is emulated there, resnet26's training step 8.5x slower than "
            "in float32; override runtime.amp=auto (or none) to train in float32")
    return amp


def amp_epochs_on_resume(previous: dict, start_epoch: int, amp: str, say) -> dict:
    """The sidecar's ``amp_epochs`` carried on by a resumed run: where the precision it resolves to
    now differs from the one the earlier epochs trained under (``runtime.amp = "auto"`` resumed on
    another machine), a new stretch starts at the next epoch, with a warning. A checkpoint written
    before the sidecar recorded it starts the record at the next epoch."""
    before = dict(previous.get("amp_epochs") or {})
    last = before[max(before, key=int)] if before else previous.get("amp")
    if last is not None and last != amp:
        say(f"warning: epochs 1-{start_epoch} trained under runtime.amp {last!r}, this machine resolves it to "
            f"{amp!r}; the checkpoint records both (amp_epochs)")
    if not before or last != amp:
        before[str(start_epoch + 1)] = amp
    return before


def amp_context(device: torch.device, amp: str):
    if amp == "none":
        return contextlib.nullcontext
    if amp == "fp16" and device.type != "cuda":
        raise RecipeError('runtime.amp = "fp16" needs a GPU; use "bf16" or "none" on the CPU')
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return lambda: torch.autocast(device.type, dtype=dtype)
