"""Distribution shifts applied to test images: common corruptions (Hendrycks &
Dietterich, ICLR 2019), occlusion and patch shuffling (Naseer et al., NeurIPS 2021), and SAN's
test-time rotations and flips (Zhao et al. 2020, Table 9).

* :mod:`robust_attn.shifts.corruptions`: the 15 ImageNet-C corruptions and the 4 extra ones at
  severities 1-5, own vectorised implementations with one entry point, :func:`corrupt`;
* :mod:`robust_attn.shifts.occlusion` and :mod:`robust_attn.shifts.shuffle`: random square
  occlusion, grid patch drop and grid patch shuffling, seeded per image;
* :mod:`robust_attn.shifts.rotation`: exact rotations by 90 degrees, flips and an interpolated
  angle sweep;
* :mod:`robust_attn.shifts.cache`: corrupted test sets made once per study, checksummed;
* :mod:`robust_attn.shifts.published`: CIFAR-10-C and ImageNet-C in their published layouts;
* :mod:`robust_attn.shifts.metrics`: corruption error (CE), mCE and relative mCE.

The protocols that evaluate models on them are :mod:`robust_attn.protocols.rotation`,
:mod:`robust_attn.protocols.corruption`,
:mod:`robust_attn.protocols.occlusion` and :mod:`robust_attn.protocols.shuffle`, through their
shared loop :mod:`robust_attn.protocols.shift_runner`.
"""
