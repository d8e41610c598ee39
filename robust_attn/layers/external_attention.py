"""External attention (Guo et al., "Beyond Self-attention: External Attention using Two Linear
Layers for Visual Tasks", 2021, "EA" below; read from the notes in
``shared/papers/ea_external_attention_notes_zh.txt``: method sections 3.2-3.4 and the two
reference classes they quote).

Single head (``heads=1``), for an input ``X`` of ``C`` channels and ``N = H W`` pixels:

1. ``F = conv1x1(X)`` (``C -> C``, with bias, as in the notes' ``conv1``);
2. ``A~ = M_k F``: a memory ``M_k`` of ``S`` slots (``S x C``, no bias, ``S = 64``), ``(S, N)``;
3. double normalization (EA section 3.3): softmax over the *pixels* (``A^_{s,n} = softmax_n``),
   then L1 normalization over the *slots* (``A_{s,n} = A^_{s,n} / (eps + sum_s A^_{s,n})``);
4. ``Y = M_v A``: a second, independent memory ``M_v`` (``C x S``, no bias), ``(C, N)``;
5. ``out = ReLU(X + BN(conv1x1(Y)))`` (``C -> C``, no bias).

``M_k`` and ``M_v`` are two separate :class:`~torch.nn.Parameter` s. (The notes' code assigns
``linear_1.weight.data = linear_0.weight.data.permute(1, 0, 2)``, which makes ``M_v`` a view of
``M_k``'s storage: a hidden tie that a state-dict round trip silently breaks. We do not tie.)

Multi-head (``heads > 1``, EA section 3.4 and the notes' ``Attention`` class): the first 1x1
convolution expands to ``C * expansion`` channels (the notes' ``trans_dims`` with ``coef = 4``),
split into ``heads`` heads of ``d = C * expansion / heads`` channels; the memories ``M_k``
(``S x d``) and ``M_v`` (``d x S``) are shared by all heads (EA section 3.4), the double
normalization runs per head, the heads are concatenated and the output 1x1 convolution
(``C * expansion -> C``, ``W_o`` of EA's multi-head equation) + BN, residual and ReLU follow as
in the single-head module. The notes' transformer version has biases in its linear layers and
no BN/residual; we keep one convolutional module for both, so the memories stay bias-free.
With ``heads=1, expansion=1`` the two coincide.

Initialization follows the notes: convolution weights ``N(0, 2 / (k^2 C_out))``, ``M_k`` rows
``N(0, 2 / S)``, ``M_v`` ``N(0, 2 / C)`` (their ``Conv1d`` rule ``n = out_channels``), BN weight 1.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["double_normalize", "ExternalAttention"]


def double_normalize(logits: torch.Tensor, eps: float = 1e-9) -> torch.Tensor:
    """EA section 3.3 on ``(..., S, N)`` logits: softmax over pixels ``N`` (last dim), then L1
    normalization over slots ``S`` (second to last).

    Computed in float32 and returned in the logits' dtype: under bf16 autocast the two reductions
    keep float32 precision, and torch.compile's CPU code for the bf16 version gave NaN in training
    (torch 2.14; tests/test_train.py's compiled-training test on ea_resnet26 catches it)."""
    attn = torch.softmax(logits.float(), dim=-1)
    return (attn / (eps + attn.sum(dim=-2, keepdim=True))).to(logits.dtype)


class ExternalAttention(nn.Module):
    """External attention block ``ReLU(X + BN(W_o M_v DN(M_k W_i X)))`` (module docstring).

    Args:
        channels: ``C`` (input = output channels).
        slots: ``S``, memory size (EA uses 64).
        heads: 1 for the single-head module, > 1 for multi-head external attention.
        expansion: channel expansion before the heads split (notes' ``coef``; 1 or 4 typically).
        eps: of the L1 normalization.
    """

    #: ``bn`` reads only ``conv_out``'s output: an attack-time copy may fold the pair (attacks.fast_model)
    foldable_conv_bn = (("conv_out", "bn"),)

    def __init__(self, channels: int, slots: int = 64, heads: int = 1, expansion: int = 1, eps: float = 1e-9):
        super().__init__()
        inner = channels * expansion
        if heads < 1 or inner % heads:
            raise ValueError(f"channels * expansion = {inner} must be divisible by heads = {heads}")
        self.channels, self.slots, self.heads, self.expansion, self.eps = channels, slots, heads, expansion, eps
        self.head_dim = inner // heads
        self.conv_in = nn.Conv2d(channels, inner, 1, bias=True)
        self.memory_key = nn.Parameter(torch.empty(slots, self.head_dim))     # M_k: d -> S
        self.memory_value = nn.Parameter(torch.empty(self.head_dim, slots))   # M_v: S -> d
        self.conv_out = nn.Conv2d(inner, channels, 1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for conv in (self.conv_in, self.conv_out):
            nn.init.normal_(conv.weight, std=math.sqrt(2.0 / conv.out_channels))
        nn.init.zeros_(self.conv_in.bias)
        nn.init.normal_(self.memory_key, std=math.sqrt(2.0 / self.slots))
        nn.init.normal_(self.memory_value, std=math.sqrt(2.0 / self.head_dim))
        self.bn.reset_parameters()

    def extra_repr(self) -> str:
        return f"channels={self.channels}, slots={self.slots}, heads={self.heads}, expansion={self.expansion}"

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        """Double-normalized ``(N, heads, S, H*W)`` attention of ``x`` on the key memory."""
        n, _, h, w = x.shape
        feats = self.conv_in(x).reshape(n, self.heads, self.head_dim, h * w)
        logits = torch.matmul(self.memory_key.to(feats.dtype), feats)      # (N, heads, S, HW)
        return double_normalize(logits, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.channels:
            raise ValueError(f"ExternalAttention({self.channels}) expects (N, {self.channels}, H, W), "
                             f"got {tuple(x.shape)}")
        n, _, h, w = x.shape
        attn = self.attention_map(x)
        out = torch.matmul(self.memory_value.to(attn.dtype), attn)         # (N, heads, d, HW)
        out = self.bn(self.conv_out(out.reshape(n, self.heads * self.head_dim, h, w)))
        return F.relu(x + out)
