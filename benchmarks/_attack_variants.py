"""Ways of computing one attack step, for the efficiency benchmarks: which module is attacked, in
which input layout, on which attention path, compiled, under autocast, or replayed from a CUDA graph.

The attack step is what PGD, APGD and FAB repeat: a forward pass and the input gradient of a summed
cross-entropy (:func:`attack_step`). Each variant of :data:`VARIANTS` builds an :class:`Attacked`
from the eval model and an example batch on the benchmark's device. ``default`` is what the attacks
query on that device (:func:`robust_attn.attacks.fast_model.resolve_attack_copy` with ``auto``: the
folded attack copy with channels-last input on a CPU, the model as given elsewhere), with the
attention layers on their default path; the other variants change one thing about it, and
:func:`describe` records what ran (attack copy or not, the attention layers' paths), so a results
file says which path each figure belongs to.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from robust_attn.attacks.fast_model import attack_model, resolve_attack_copy
from robust_attn.layers.gsa import GlobalSelfAttention2d
from robust_attn.layers.paths import set_attention_path
from robust_attn.layers.san import SelfAttention2d
from robust_attn.layers.sasa import SASAttention2d

__all__ = ["Attacked", "Variant", "VARIANTS", "Autocast", "attack_step", "attention_paths", "make_step",
           "describe", "variants_for", "cuda_graph_step"]


@dataclass(frozen=True)
class Attacked:
    """The module an attack step runs through and how it is called."""
    module: nn.Module
    channels_last: bool          # the step's input is handed over channels-last
    attack_copy: bool            # the module is (built on) the folded copy of fast_model.attack_model
    cuda_graph: bool = False     # the whole step is captured once in a CUDA graph and replayed


@dataclass(frozen=True)
class Variant:
    build: Callable[[nn.Module, torch.Tensor], Attacked]   # (eval model, example batch on the device)
    description: str
    devices: tuple[str, ...] = ("cpu", "cuda")


class Autocast(nn.Module):
    """``module`` under ``torch.autocast(device_type, dtype)``, logits back in float32 (not the same
    function: bf16 keeps an 8-bit mantissa)."""

    def __init__(self, module: nn.Module, device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(x).float()


def attack_step(model: nn.Module, x: torch.Tensor, labels: torch.Tensor,
                keep: dict | None = None) -> Callable[[], torch.Tensor]:
    """Forward and input gradient of the summed cross-entropy, as one PGD step computes them; the
    step's logits go to ``keep["logits"]`` where ``keep`` is given."""
    def step() -> torch.Tensor:
        xg = x.detach().requires_grad_(True)
        logits = model(xg)
        if keep is not None:
            keep["logits"] = logits.detach()
        loss = F.cross_entropy(logits, labels, reduction="sum")
        return torch.autograd.grad(loss, xg)[0]
    return step


def cuda_graph_step(step: Callable[[], torch.Tensor], device: torch.device) -> Callable[[], torch.Tensor]:
    """``step`` captured once in a CUDA graph (after warm-up calls on a side stream, as
    :class:`torch.cuda.CUDAGraph` asks) and replayed: the same kernels on the same (static) input,
    without launching each operator from Python. Returns the captured step's output tensor."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return out
    return replay


def make_step(attacked: Attacked, x: torch.Tensor, labels: torch.Tensor,
              keep: dict | None = None) -> Callable[[], torch.Tensor]:
    """The attack step of ``attacked`` on ``x`` (channels-last where it asks), captured in a CUDA
    graph where it asks; ``keep`` as for :func:`attack_step`."""
    xin = x.contiguous(memory_format=torch.channels_last) if attacked.channels_last else x
    step = attack_step(attacked.module, xin, labels, keep)
    return cuda_graph_step(step, x.device) if attacked.cuda_graph else step


def attention_paths(module: nn.Module) -> list[str]:
    """The paths (:data:`robust_attn.layers.paths.ATTENTION_PATHS`) the SAN, SASA and GSA layers of
    ``module`` are on; empty for a model without such layers."""
    paths = set()
    for m in module.modules():
        if isinstance(m, SelfAttention2d):
            paths.add("reference" if m.implementation == "unfold" else m.implementation)
        elif isinstance(m, (SASAttention2d, GlobalSelfAttention2d)):
            paths.add(m.impl)
    return sorted(paths)


def describe(attacked: Attacked) -> dict:
    """What ran, for the results file."""
    return {"attack_copy": attacked.attack_copy, "attention_path": attention_paths(attacked.module),
            "channels_last_input": attacked.channels_last, "cuda_graph": attacked.cuda_graph}


def _default(model: nn.Module, x: torch.Tensor) -> Attacked:
    if resolve_attack_copy("auto", x.device):
        return _copy(model, x)
    return Attacked(model, channels_last=False, attack_copy=False)


def _as_is(model: nn.Module, x: torch.Tensor) -> Attacked:
    return Attacked(model, channels_last=False, attack_copy=False)


def _copy(model: nn.Module, x: torch.Tensor) -> Attacked:
    """The folded copy (the model itself where nothing folds), channels-last input."""
    folded = attack_model(model, x[:4])
    return Attacked(folded, channels_last=True, attack_copy=folded is not model)


def _on_path(path: str) -> Callable[[nn.Module, torch.Tensor], Attacked]:
    """The default, on a copy whose attention layers are on ``path`` (the other variants keep theirs)."""
    def build(model: nn.Module, x: torch.Tensor) -> Attacked:
        base = _default(model, x)
        module = copy.deepcopy(base.module)
        set_attention_path(module, path)
        return dataclasses.replace(base, module=module)
    return build


def _compiled(build: Callable[[nn.Module, torch.Tensor], Attacked]) -> Callable[[nn.Module, torch.Tensor], Attacked]:
    def compiled(model: nn.Module, x: torch.Tensor) -> Attacked:
        base = build(model, x)
        return dataclasses.replace(base, module=torch.compile(base.module, dynamic=False))
    return compiled


def _bf16(model: nn.Module, x: torch.Tensor) -> Attacked:
    base = _default(model, x)
    return dataclasses.replace(base, module=Autocast(base.module, x.device.type))


def _graphed(build: Callable[[nn.Module, torch.Tensor], Attacked]) -> Callable[[nn.Module, torch.Tensor], Attacked]:
    def graphed(model: nn.Module, x: torch.Tensor) -> Attacked:
        return dataclasses.replace(build(model, x), cuda_graph=True)
    return graphed


#: name -> variant; ``default`` first, each other one changes one thing about it
VARIANTS: dict[str, Variant] = {
    "default": Variant(_default, "what the attacks query on this device (resolve_attack_copy('auto')): on a CPU "
                                 "the attack_model copy (batch norm folded) with channels-last input, elsewhere the "
                                 "eval model as given; attention layers on their default (lean) path; fp32"),
    "as_is": Variant(_as_is, "the eval model itself (batch norm unfolded), default attention path, contiguous "
                             "input: what the attacks query with attack_copy='off'; fp32"),
    "copy": Variant(_copy, "the attack_model copy (batch norm folded) with channels-last input on any device; fp32"),
    "lean": Variant(_on_path("lean"), "default, its SAN, SASA and GSA layers on the lean path "
                                      "(robust_attn.layers.paths); fp32"),
    "reference": Variant(_on_path("reference"), "default, its SAN, SASA and GSA layers on the reference path "
                                                "(SAN's unfold, SASA's reference); fp32"),
    "compiled": Variant(_compiled(_default), "torch.compile(default, dynamic=False): Inductor, C++ on a CPU, "
                                             "Triton on CUDA; fp32"),
    "compiled_reference": Variant(_compiled(_on_path("reference")), "torch.compile(reference, dynamic=False); fp32"),
    "bf16": Variant(_bf16, "default under torch.autocast(device, bfloat16); not the same function"),
    "cuda_graph": Variant(_graphed(_default), "default's whole step (forward and input gradient) captured in one "
                                              "CUDA graph and replayed on its fixed input; fp32", ("cuda",)),
    "cuda_graph_reference": Variant(_graphed(_on_path("reference")), "reference's whole step captured in one CUDA "
                                                                     "graph and replayed; fp32", ("cuda",)),
}


def variants_for(device: torch.device | str) -> list[str]:
    """The variants that run on ``device``'s type."""
    kind = torch.device(device).type
    return [name for name, v in VARIANTS.items() if kind in v.devices]
