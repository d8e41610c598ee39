"""Compiled CPU kernels for local attention (``csrc/``), each with a PyTorch counterpart: footprint
window operations (one pass of a kernel, or a PyTorch loop) and SAN's fused operators.

Local attention (SAN eq. 2-5, SASA eq. 3) runs three loops over the ``k^2`` footprint offsets. In
PyTorch each offset is a full-tensor op over the feature map (49 passes through memory for a 7x7
footprint, and as many dispatches); ``csrc/window_ops.cpp`` does each loop as one pass that keeps a
(batch, group) slice in cache across the offsets. Layouts (any strides, last dim contiguous):
features ``a (B, G, D, H, W)``, padded features ``bpad (B, G, D, Hp, Wp)`` (offset ``o = (dy, dx)``
reads ``bpad[..., i + dy, j + dx]``), weights ``w (K, B, G, H, W)``:

* :func:`window_dot`: ``out[o, b, g, i, j] = sum_d a[b, g, d, i, j] bpad[b, g, d, i + dy_o, j + dx_o]``
* :func:`window_dot_rel`: the same with a per-offset term added to ``bpad``,
  ``sum_d a[b, g, d, i, j] (bpad[b, g, d, i + dy_o, j + dx_o] + rel[g, d, o])`` (SASA's logits with their
  relative term, ``csrc/window_rel_ops.cpp``)
* :func:`window_sum`: ``out[b, g, d, i, j] (+)= sum_o w[o, b, g, i, j] bpad[b, g, d, i + dy_o, j + dx_o]``
* :func:`window_scatter`: ``outpad[b, g, d, i + dy_o, j + dx_o] += sum_o w[o, b, g, i, j] a[b, g, d, i, j]``
* :func:`window_fold`: ``outpad[b, c, i + dy_o, j + dx_o] += x[b, c, o, i, j]`` (the adjoint of stacking
  the shifted windows, :func:`.local_aggregation.shifted`)

``csrc/pairwise_ops.cpp`` holds SAN's whole pairwise operator for the linear relations, fused per
(image, footprint offset) tile (:func:`pairwise_moments`, :func:`pairwise_forward`,
:func:`pairwise_backward`, :func:`pairwise_backward_input`; wrapped by
:mod:`robust_attn.layers.san_fused`, with the chunked PyTorch path of :mod:`.san_pairwise` as its
reference); ``csrc/patchwise_ops.cpp`` the psi part of patchwise concatenation's first gamma layer,
likewise fused (:func:`patchwise_moments`, :func:`patchwise_hidden`,
:func:`patchwise_backward_sums`, :func:`patchwise_backward_input`).

The module is built on first use with ``torch.utils.cpp_extension`` (needs a C++ compiler and
ninja; about a minute, then cached) for float32 and float64 CPU tensors. Without a compiler, on
other devices and dtypes, or with ``ROBUST_ATTN_CPU_KERNELS=0``, the same functions run as PyTorch
code (:func:`window_dot_torch` and friends; SAN's chunked path), which the tests check the kernels
against.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import warnings
from pathlib import Path

import torch

from robust_attn.utils.hardware import cpu_fingerprint

__all__ = ["kernel_available", "uses_kernel", "window_dot", "window_dot_rel", "window_sum", "window_scatter",
           "window_fold", "window_dot_torch", "window_dot_rel_torch", "window_sum_torch", "window_scatter_torch",
           "window_fold_torch", "pairwise_moments",
           "pairwise_forward", "pairwise_backward", "pairwise_backward_input", "patchwise_moments",
           "patchwise_hidden", "patchwise_backward_sums", "patchwise_backward_input"]

_SOURCES = [Path(__file__).resolve().parent / "csrc" / name
            for name in ("module.cpp", "window_ops.cpp", "window_rel_ops.cpp", "pairwise_ops.cpp", "patchwise_ops.cpp")]
_KERNEL_DTYPES = (torch.float32, torch.float64)
_module = None
_load_failed = False


def _announce_build(name: str) -> None:
    """One line on stderr before a build that is not cached yet (the first use takes about a
    minute with no other output, which looks hung)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
        folder = Path(_get_build_directory(name, verbose=False))
    except Exception:   # a private helper of torch: if it moves, say nothing rather than fail
        return
    built = folder / f"{name}.so"
    newest = max(p.stat().st_mtime for p in _SOURCES)
    if not built.is_file() or built.stat().st_mtime < newest:
        print(f"robust-attn: compiling the CPU kernels (first use, about a minute; cached in {folder})...",
              file=sys.stderr, flush=True)


def _load():
    """The compiled module, or None (no compiler, disabled, or a failed build: warns once)."""
    global _module, _load_failed
    if _module is not None or _load_failed:
        return _module
    if os.environ.get("ROBUST_ATTN_CPU_KERNELS", "1") == "0":
        _load_failed = True
        return None
    quiet = logging.getLogger("torch.utils.cpp_extension")  # its "No CUDA runtime is found" is noise here
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torch.utils.cpp_extension import load
        # -march=native: one build per CPU; and one per version of the sources and headers, so that
        # checkouts with different sources sharing the build cache do not rebuild over each other
        files = sorted(_SOURCES[0].parent.glob("*.[ch]*"))
        digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()[:8]
        name = f"robust_attn_cpu_kernels_{cpu_fingerprint()}_{digest}"
        _announce_build(name)
        _module = load(name=name, sources=[str(p) for p in _SOURCES],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # no compiler / ninja / headers: fall back to the PyTorch loops
        _load_failed = True
        warnings.warn(f"robust-attn: compiled CPU window kernels unavailable ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}); using the slower PyTorch loops. "
                      "Install a C++ compiler and ninja to build them, or set ROBUST_ATTN_CPU_KERNELS=0 "
                      "to silence this.", RuntimeWarning, stacklevel=3)
    finally:
        quiet.setLevel(level)
    return _module


def kernel_available() -> bool:
    """Whether the compiled kernel is (or can be) loaded; builds it on the first call."""
    return _load() is not None


def uses_kernel(*tensors: torch.Tensor) -> bool:
    """Whether the window ops on these tensors run the compiled kernel (CPU, one dtype of float32 and
    float64, built)."""
    dtype = tensors[0].dtype
    if dtype not in _KERNEL_DTYPES or not all(t.device.type == "cpu" and t.dtype == dtype for t in tensors):
        return False
    return _load() is not None


def _split(offsets) -> tuple[list[int], list[int]]:
    return [int(dy) for dy, _ in offsets], [int(dx) for _, dx in offsets]


def _window(bpad: torch.Tensor, dy: int, dx: int, height: int, width: int) -> torch.Tensor:
    return bpad[..., dy:dy + height, dx:dx + width]


def window_dot_torch(a: torch.Tensor, bpad: torch.Tensor, offsets, out: torch.Tensor) -> torch.Tensor:
    """PyTorch loop of :func:`window_dot`. With up to 4 channels per group a chain of fused
    multiply-adds beats ``(a * b).sum(2)`` on CPU (no product tensor); with more the
    product-and-sum is faster (docs/performance.md, "Why each path exists")."""
    h, w = a.shape[-2:]
    for o, (dy, dx) in enumerate(offsets):
        window = _window(bpad, dy, dx, h, w)
        if a.shape[2] > 4:
            torch.sum(a * window, 2, out=out[o])
            continue
        torch.mul(a[:, :, 0], window[:, :, 0], out=out[o])
        for c in range(1, a.shape[2]):
            out[o].addcmul_(a[:, :, c], window[:, :, c])
    return out


def window_sum_torch(w: torch.Tensor, bpad: torch.Tensor, offsets, out: torch.Tensor,
                     accumulate: bool = False) -> torch.Tensor:
    """PyTorch loop of :func:`window_sum`."""
    h, wd = out.shape[-2:]
    if not accumulate:
        out.zero_()
    for o, (dy, dx) in enumerate(offsets):
        out.addcmul_(w[o].unsqueeze(2), _window(bpad, dy, dx, h, wd))
    return out


def window_scatter_torch(w: torch.Tensor, a: torch.Tensor, offsets, outpad: torch.Tensor) -> torch.Tensor:
    """PyTorch loop of :func:`window_scatter`."""
    h, wd = a.shape[-2:]
    for o, (dy, dx) in enumerate(offsets):
        _window(outpad, dy, dx, h, wd).addcmul_(w[o].unsqueeze(2), a)
    return outpad


def window_fold_torch(x: torch.Tensor, offsets, outpad: torch.Tensor) -> torch.Tensor:
    """PyTorch loop of :func:`window_fold`."""
    h, w = x.shape[-2:]
    for o, (dy, dx) in enumerate(offsets):
        _window(outpad, dy, dx, h, w).add_(x[:, :, o])
    return outpad


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def window_dot(a: torch.Tensor, bpad: torch.Tensor, offsets, out: torch.Tensor) -> torch.Tensor:
    """``out[o] = sum_d a * bpad shifted by offset o`` into ``out (K, B, G, H, W)`` (see module doc)."""
    if not uses_kernel(a, bpad, out) or out.stride(-1) != 1:
        return window_dot_torch(a, bpad, offsets, out)
    _module.window_dot(_last_contiguous(a), _last_contiguous(bpad), *_split(offsets), out)
    return out


def window_dot_rel_torch(a: torch.Tensor, bpad: torch.Tensor, rel: torch.Tensor, offsets,
                         out: torch.Tensor) -> torch.Tensor:
    """PyTorch form of :func:`window_dot_rel`: :func:`window_dot_torch` plus ``sum_d a_d rel[g, d, o]``."""
    window_dot_torch(a, bpad, offsets, out)
    return out.add_(torch.einsum("bgdij,gdo->obgij", a, rel.to(a.dtype)))


def window_dot_rel(a: torch.Tensor, bpad: torch.Tensor, rel: torch.Tensor, offsets, out: torch.Tensor) -> torch.Tensor:
    """``out[o] = sum_d a * (bpad shifted by offset o + rel[:, :, o])`` into ``out (K, B, G, H, W)``;
    ``rel (G, D, K)`` (see module doc)."""
    if not uses_kernel(a, bpad, rel, out) or out.stride(-1) != 1:
        return window_dot_rel_torch(a, bpad, rel, offsets, out)
    _module.window_dot_rel(_last_contiguous(a), _last_contiguous(bpad), rel.contiguous(), *_split(offsets), out)
    return out


def window_sum(w: torch.Tensor, bpad: torch.Tensor, offsets, out: torch.Tensor,
               accumulate: bool = False) -> torch.Tensor:
    """``out (B, G, D, H, W) (+)= sum_o w[o] * bpad shifted by offset o`` (see module doc)."""
    if not uses_kernel(w, bpad, out) or out.stride(-1) != 1:
        return window_sum_torch(w, bpad, offsets, out, accumulate)
    _module.window_sum(_last_contiguous(w), _last_contiguous(bpad), *_split(offsets), out, accumulate)
    return out


def window_scatter(w: torch.Tensor, a: torch.Tensor, offsets, outpad: torch.Tensor) -> torch.Tensor:
    """``outpad`` shifted by offset o ``+= w[o] * a`` for every o (see module doc)."""
    if not uses_kernel(w, a, outpad) or outpad.stride(-1) != 1:
        return window_scatter_torch(w, a, offsets, outpad)
    _module.window_scatter(_last_contiguous(w), _last_contiguous(a), *_split(offsets), outpad)
    return outpad


def window_fold(x: torch.Tensor, offsets, outpad: torch.Tensor) -> torch.Tensor:
    """``outpad (B, C, Hp, Wp)`` shifted by offset o ``+= x[:, :, o]`` for every o; ``x (B, C, K, H, W)``."""
    if not uses_kernel(x, outpad) or outpad.stride(-1) != 1:
        return window_fold_torch(x, offsets, outpad)
    _module.window_fold(_last_contiguous(x.permute(2, 0, 1, 3, 4)), *_split(offsets), outpad.unsqueeze(2))
    return outpad



# SAN's fused pairwise operator (csrc/pairwise_ops.cpp): callers check uses_kernel first. Tensors
# contiguous; the position channels ``w1p (Hd, P)`` and ``pos (P, K, H*W)`` may be None.

def _maybe(t: torch.Tensor | None) -> torch.Tensor:
    return torch.Tensor() if t is None else t


def pairwise_moments(center, nbpad, offsets, w1, w1p, pos) -> torch.Tensor:
    """Sum and sum of squares of gamma's hidden layer per channel, ``(2, Hd)`` float64 (BN2's batch moments)."""
    return _module.pairwise_moments(center, nbpad, *_split(offsets), w1, _maybe(w1p), _maybe(pos))


def pairwise_forward(center, nbpad, offsets, w1, w1p, pos, scale, shift, w2, b2, vpad):
    """``(out (N, C'/G, G, H, W), lse (N, G, H, W))`` of pairwise attention with BN2 as ``scale, shift``."""
    return _module.pairwise_forward(center, nbpad, *_split(offsets), w1, _maybe(w1p), _maybe(pos), scale, shift, w2,
                                    b2, vpad)


def pairwise_backward(center, nbpad, offsets, w1, w1p, pos, scale, shift, w2, b2, vpad, out, lse, grad_out,
                      weight_grads: bool, one_pass: bool):
    """First backward pass ``(keep, grad_w2, grad_b2, sums, grad_vpad)``, or with ``one_pass`` (BN2 on
    running statistics) the only one, followed by ``grad_w1, grad_w1p, grad_pos, grad_center, grad_nbpad``;
    the weights' gradients are None without ``weight_grads`` (see csrc/pairwise_ops.cpp)."""
    return _module.pairwise_backward(center, nbpad, *_split(offsets), w1, _maybe(w1p), _maybe(pos), scale, shift,
                                     w2, b2, vpad, out, lse, grad_out, weight_grads, one_pass)


def pairwise_backward_input(center, nbpad, offsets, w1, w1p, pos, scale, shift, w2, keep, coef_a, coef_h, coef_0,
                            weight_grads: bool):
    """Second backward pass: ``(grad_w1, grad_w1p, grad_pos, grad_center, grad_nbpad)`` (csrc/pairwise_ops.cpp)."""
    return _module.pairwise_backward_input(center, nbpad, *_split(offsets), w1, _maybe(w1p), _maybe(pos), scale,
                                           shift, w2, keep, coef_a, coef_h, coef_0, weight_grads)


# SAN patchwise concatenation's psi part of gamma's first layer (csrc/patchwise_ops.cpp): callers check
# uses_kernel first. ``xpad (N, R, Hp, Wp)``, per-channel tensors ``(R, K)``, ``w1 (K, G, R)``, contiguous.

def patchwise_moments(xpad, offsets, height: int, width: int) -> torch.Tensor:
    """Sum and sum of squares of each psi channel's window per offset, ``(2, R, K)`` float64 (BN1's moments)."""
    return _module.patchwise_moments(xpad, *_split(offsets), height, width)


def patchwise_hidden(xpad, offsets, height: int, width: int, scale, shift, w1) -> torch.Tensor:
    """``sum_j W1_j relu(scale[:, j] * window_j + shift[:, j])``, ``(N, G, H, W)``."""
    return _module.patchwise_hidden(xpad, *_split(offsets), height, width, scale, shift, w1)


def patchwise_backward_sums(xpad, offsets, height: int, width: int, scale, shift, w1, grad_hid, weight_grads: bool):
    """First backward pass: ``(grad_w1 (K, G, R) or None without weight_grads, sums (2, R, K))``
    (see csrc/patchwise_ops.cpp)."""
    return _module.patchwise_backward_sums(xpad, *_split(offsets), height, width, scale, shift, w1, grad_hid,
                                           weight_grads)


def patchwise_backward_input(xpad, offsets, height: int, width: int, scale, shift, w1, grad_hid, coef_a, coef_f,
                             coef_0) -> torch.Tensor:
    """Second backward pass: the gradient of ``xpad`` (see csrc/patchwise_ops.cpp)."""
    return _module.patchwise_backward_input(xpad, *_split(offsets), height, width, scale, shift, w1, grad_hid,
                                            coef_a, coef_f, coef_0)
