"""An attack-time copy of a model with eval-mode batch norm folded into the convolutions.

PGD (SAN section 5.4, Table 10) runs a forward and a backward pass per step through a model in
eval mode. There, ``BatchNorm2d`` is a fixed per-channel affine map,
``bn(y) = (y - mu) * s + beta`` with ``s = gamma / sqrt(var + eps)``, and when ``y = conv(x)``
it can be absorbed into the convolution (the folding of Jacob et al. 2018, section 3.2)::

    bn(conv_W,b(x)) = conv_W',b'(x),   W'[o] = W[o] * s[o],   b' = (b - mu) * s + beta

so the attack skips one elementwise pass over every activation map in the forward pass and
another in the backward pass. The folded model is the same function in real arithmetic; in
floats it rounds differently (``(W * s) * x`` is not ``(W * x) * s``), which is why the fast
mode of :func:`~robust_attn.attacks.targeted_pgd` agrees with the exact backends only up to
floating-point ties (see :func:`robust_attn.attacks.targeted_pgd.native_pgd`).

Finding the pairs: the model is traced with :mod:`torch.fx`; a ``Conv2d`` call whose only user
is an eval-mode ``BatchNorm2d`` call with running statistics is fused. A submodule that cannot
be traced (data-dependent control flow, as some attention layers have) is not an error: it is
kept whole, as one opaque call in the graph, and nothing inside it is folded (its own code may
read its batch norms' attributes, as SAN's fused attention kernel does), so the traceable parts
around it (stems, bottleneck convolutions, shortcuts) are still folded. A module can name pairs
inside it that are safe to fold without a trace, in a class attribute ``foldable_conv_bn``:
``(conv, batch norm)`` attribute names where the batch norm's only input is that convolution's
output and the convolution's output goes nowhere else (the output projection of
:class:`~robust_attn.layers.external_attention.ExternalAttention`); those are folded in the copy
too, the batch norm replaced by an identity. Where nothing folds, or the model's own ``forward``
cannot be traced and declares nothing, the attack uses the model itself.

:func:`attack_copy` is what an attack runs on: the folded copy behind :class:`ChannelsLastInput`,
which hands it its input in channels-last layout (oneDNN's convolutions then run without layout
reorders), the computation :func:`~robust_attn.attacks.targeted_pgd.native_pgd` uses; the model
itself where nothing folds. :data:`ATTACK_COPY_MODES` name the setting the attacks of
:mod:`robust_attn.attacks.base` take (``auto``: the copy on a CPU, where it was measured faster,
``docs/performance.md``; the model as it is elsewhere).

The caller's model is never modified: folding works on a deep copy. Copies are cached per
model (weakly, so the cache does not keep models alive) and rebuilt when any parameter or
buffer has been replaced or modified in place since (identity, version counter and sum of
each tensor).
"""
from __future__ import annotations

import copy
import warnings
import weakref

import torch
import torch.fx as fx
import torch.nn as nn

__all__ = ["fold_batchnorm", "attack_model", "fold_conv_bn", "ChannelsLastInput", "attack_copy",
           "ATTACK_COPY_MODES", "resolve_attack_copy"]


def fold_conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """A new ``Conv2d`` computing ``bn(conv(x))`` for an eval-mode ``bn`` (module docstring)."""
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError("cannot fold a BatchNorm2d without running statistics (track_running_stats=False)")
    if conv.out_channels != bn.num_features:
        raise ValueError(f"conv has {conv.out_channels} output channels but the batch norm {bn.num_features}")
    fused = copy.deepcopy(conv)
    with torch.no_grad():
        scale = torch.rsqrt(bn.running_var + bn.eps)
        if bn.weight is not None:
            scale = scale * bn.weight
        bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
        bias = (bias - bn.running_mean) * scale
        if bn.bias is not None:
            bias = bias + bn.bias
        fused.weight = nn.Parameter(conv.weight * scale.view(-1, *([1] * (conv.weight.dim() - 1))),
                                    requires_grad=conv.weight.requires_grad)
        fused.bias = nn.Parameter(bias.to(conv.weight.dtype), requires_grad=conv.weight.requires_grad)
    return fused


def _foldable(conv: object, bn: object) -> bool:
    return (isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d) and not bn.training
            and bn.running_mean is not None and bn.running_var is not None
            and conv.out_channels == bn.num_features)


class _Tracer(fx.Tracer):
    """An fx tracer that keeps the modules in ``opaque`` (by id) as single calls, untraced."""

    def __init__(self, opaque: set[int]):
        super().__init__()
        self.opaque = opaque

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self.opaque or super().is_leaf_module(m, module_qualified_name)


def _opaque_modules(root: nn.Module) -> set[int]:
    """Ids of the modules fx cannot trace through even with their untraceable children kept
    opaque (post-order, so a block with one untraceable attention layer stays traceable)."""
    opaque: set[int] = set()
    tracer_leaf = fx.Tracer().is_leaf_module
    seen: set[int] = set()

    def visit(module: nn.Module, name: str) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)
        if tracer_leaf(module, name):
            return
        try:
            _Tracer(opaque).trace(module)
        except Exception:  # any tracing failure: data-dependent control flow, non-tensor inputs ...
            opaque.add(id(module))

    visit(root, "")
    return opaque


def _fold_graph(module: nn.Module, opaque: set[int]) -> tuple[nn.Module, int]:
    """Trace ``module`` (keeping ``opaque`` modules whole) and fuse its conv -> batch-norm pairs."""
    graph_module = fx.GraphModule(module, _Tracer(opaque).trace(module))
    modules = dict(graph_module.named_modules())
    folded = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_module" or not isinstance(modules.get(node.target), nn.BatchNorm2d):
            continue
        if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
            continue
        producer = node.args[0]
        if producer.op != "call_module" or len(producer.users) != 1:
            continue
        conv, bn = modules.get(producer.target), modules[node.target]
        if not _foldable(conv, bn):
            continue
        # The fused conv gets a new name: the original conv module may be called elsewhere too.
        name = f"_folded_conv_bn_{folded}"
        graph_module.add_submodule(name, fold_conv_bn(conv, bn))
        producer.target = name
        node.replace_all_uses_with(producer)
        graph_module.graph.erase_node(node)
        folded += 1
    if not folded:
        return module, 0
    graph_module.graph.eliminate_dead_code()
    graph_module.delete_all_unused_submodules()
    graph_module.recompile()
    return graph_module, folded


def fold_batchnorm(model: nn.Module) -> tuple[nn.Module, int]:
    """A copy of ``model`` (eval mode) with conv -> batch-norm pairs folded, and how many were.

    The copy computes the same function up to float rounding; ``model`` itself is unchanged.
    Returns ``(model, 0)`` (the model itself, not a copy) when there is nothing to fold.
    """
    if model.training:
        raise ValueError("batch norm can only be folded in eval mode: call model.eval() first")
    copied = copy.deepcopy(model)
    declared = _fold_declared(copied)
    try:  # the common case: the whole model traces
        folded, count = _fold_graph(copied, set())
    except Exception:  # find the parts that do not, and keep them whole
        opaque = _opaque_modules(copied)
        try:
            folded, count = (copied, 0) if id(copied) in opaque else _fold_graph(copied, opaque)
        except Exception:  # a model fx cannot trace at all (e.g. a forward set on the instance)
            folded, count = copied, 0
    if not count + declared:
        return model, 0
    return folded.eval(), count + declared


def _fold_declared(root: nn.Module) -> int:
    """Fold the ``foldable_conv_bn`` pairs that modules of ``root`` declare (module docstring), in
    place; returns how many."""
    count = 0
    for module in list(root.modules()):
        for conv_name, bn_name in getattr(module, "foldable_conv_bn", ()):
            conv, bn = getattr(module, conv_name), getattr(module, bn_name)
            if _foldable(conv, bn):
                setattr(module, conv_name, fold_conv_bn(conv, bn))
                setattr(module, bn_name, nn.Identity())
                count += 1
    return count


def _fingerprint(model: nn.Module) -> tuple:
    """Identity, version counter and sum of every parameter and buffer: changes when one is
    replaced, moved, or modified in place (also through ``.data``, which the counter misses)."""
    tensors = list(model.parameters()) + list(model.buffers())
    with torch.no_grad():
        sums = torch.stack([t.detach().sum().double() for t in tensors]).tolist() if tensors else []
    return tuple((t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape)) for t in tensors), tuple(sums)


_CACHE: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, nn.Module | None]]" = weakref.WeakKeyDictionary()

# The folded model must reproduce the logits up to float rounding; anything larger means the
# trace did not capture the model (e.g. a branch on a Python value fx cannot see).
_CHECK_RTOL = 1e-3


def attack_model(model: nn.Module, example: torch.Tensor) -> nn.Module:
    """The folded copy of ``model`` (see :func:`fold_batchnorm`), cached until ``model`` changes.

    On a cache miss the copy is checked on ``example`` (a few input images): its logits must
    match the model's to ``1e-3`` relative to their largest magnitude; if not (or if nothing
    folds) the model itself is returned, with a ``RuntimeWarning`` in the first case. The copy's
    parameters do not require gradients (the attack needs input gradients only).
    """
    key = _fingerprint(model)
    hit = _CACHE.get(model)
    if hit is not None and hit[0] == key:
        return model if hit[1] is None else hit[1]
    folded, count = fold_batchnorm(model)
    if count:
        with torch.no_grad():
            want, got = model(example), folded(example)
        scale = want.abs().max().item() if want.numel() else 0.0
        if want.shape != got.shape or not (got - want).abs().max().item() <= _CHECK_RTOL * max(scale, 1.0):
            warnings.warn(f"folding batch norm into the convolutions of {type(model).__name__} changed its "
                          f"output; the attack uses the model as it is (exact=True or attack_copy='off' silences this)",
                          RuntimeWarning, stacklevel=3)
            count = 0
    if not count:
        _CACHE[model] = (key, None)  # not the model itself: a value must not keep its key alive
        return model
    for p in folded.parameters():
        p.requires_grad_(False)
    _CACHE[model] = (key, folded)
    return folded


#: ``auto``: the attack copy on a CPU, the model as it is on other devices; ``on``; ``off``
ATTACK_COPY_MODES = ("auto", "on", "off")


def resolve_attack_copy(mode: str, device: torch.device | str) -> bool:
    """Whether an attack on ``device`` runs on :func:`attack_copy` under ``mode``
    (:data:`ATTACK_COPY_MODES`); a ValueError naming the modes for another value. ``auto`` leaves
    the copy out under autocast: in reduced precision the folded copy cannot pass its check."""
    if mode not in ATTACK_COPY_MODES:
        raise ValueError(f"attack copy must be one of {', '.join(ATTACK_COPY_MODES)}, got {mode!r}")
    device = torch.device(device)
    return mode == "on" or (mode == "auto" and device.type == "cpu" and not torch.is_autocast_enabled(device.type))


class ChannelsLastInput(nn.Module):
    """``module`` called on its (4-d) input in channels-last layout: the same function; the input
    gradient comes back in the caller's layout."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.module(x)


def attack_copy(model: nn.Module, example: torch.Tensor) -> nn.Module:
    """What an attack runs on (module docstring): the folded copy of :func:`attack_model` with
    channels-last input, or ``model`` itself where the copy is the model (nothing folds, or the
    folded copy failed its check)."""
    folded = attack_model(model, example)
    return model if folded is model else ChannelsLastInput(folded)
