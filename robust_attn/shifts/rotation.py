"""Zero-shot rotation and flipping (SAN, Zhao et al. 2020, section 5.4 and Table 9).

The paper tests on the validation images unchanged, rotated *clockwise* by 90, 180 and 270
degrees, and flipped upside-down (about the horizontal axis), and reports top-1 / top-5 with the
drop from the unrotated result in percentage points. Beyond the paper this module adds the
left-right flip and an angle sweep.

Choices where the paper is silent:

* The exact conditions use index permutations (no interpolation): clockwise by 90 degrees is
  ``out[i, j] = in[H - 1 - j, i]``. Note ``torch.rot90(x, 1, (H, W))`` turns *counter*-clockwise,
  so clockwise is ``k = -1``.
* The rotation is applied to the already preprocessed (resized and centre-cropped) test image,
  so the 90-degree conditions permute exactly the pixels the unrotated condition sees.
* Angle sweep: rotation about the image centre with bilinear interpolation and zeros (black,
  before normalization) filling the corners that fall outside the source; the output keeps the
  input size (corners of the source are cut). Angles that are multiples of 90 are the exact
  conditions and are not repeated in the sweep.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

__all__ = ["RotationCondition", "PAPER_CONDITIONS", "rotation_conditions", "DEFAULT_ANGLE_STEP", "rotate_clockwise",
           "flip_upside_down", "flip_left_right", "rotate_angle", "apply_condition"]


@dataclass(frozen=True)
class RotationCondition:
    """One test-time manipulation. ``kind``: ``identity``, ``rot90`` (exact, clockwise by
    ``angle`` in {90, 180, 270}), ``flip_ud``, ``flip_lr`` or ``angle`` (interpolated, clockwise
    by ``angle`` degrees)."""

    name: str
    kind: str
    angle: float = 0.0
    interpolation: str = "none"
    fill: str = "none"

    def as_dict(self) -> dict:
        return asdict(self)


PAPER_CONDITIONS = (
    RotationCondition("none", "identity", 0.0),
    RotationCondition("cw90", "rot90", 90.0),
    RotationCondition("cw180", "rot90", 180.0),
    RotationCondition("cw270", "rot90", 270.0),
    RotationCondition("flip_ud", "flip_ud", 0.0),
)


#: the angle sweep's step in degrees, the study's and ``eval rotation``'s: its angles hold Table 9's
#: 90, 180 and 270 (which run as exact rotations, left out of the sweep)
DEFAULT_ANGLE_STEP = 30.0


def rotation_conditions(angle_step: float = DEFAULT_ANGLE_STEP, hflip: bool = True) -> list[RotationCondition]:
    """The paper's five conditions (Table 9), then the left-right flip (if ``hflip``), then the
    sweep ``angle_step, 2 * angle_step, ... < 360`` without multiples of 90 (``angle_step=0``:
    no sweep)."""
    conditions = list(PAPER_CONDITIONS)
    if hflip:
        conditions.append(RotationCondition("flip_lr", "flip_lr", 0.0))
    if angle_step < 0 or angle_step >= 360:
        raise ValueError(f"--angle-step must be in [0, 360) degrees (0 turns the sweep off), got {angle_step}")
    if angle_step:
        k = 1
        while k * angle_step < 360 - 1e-9:
            angle = round(k * angle_step, 6)
            if abs(angle / 90 - round(angle / 90)) > 1e-9:
                conditions.append(RotationCondition(f"angle{angle:g}", "angle", float(angle),
                                                    "bilinear", "zeros"))
            k += 1
    return conditions


def rotate_clockwise(images: torch.Tensor, quarter_turns: int) -> torch.Tensor:
    """Rotate (..., H, W) images clockwise by ``quarter_turns`` x 90 degrees, exactly."""
    return torch.rot90(images, k=-quarter_turns, dims=(-2, -1))


def flip_upside_down(images: torch.Tensor) -> torch.Tensor:
    """Mirror about the horizontal axis (top row becomes the bottom row)."""
    return images.flip(-2)


def flip_left_right(images: torch.Tensor) -> torch.Tensor:
    return images.flip(-1)


def rotate_angle(images: torch.Tensor, degrees: float) -> torch.Tensor:
    """Rotate (N, C, H, W) images clockwise by ``degrees`` about the centre; bilinear, zero fill.

    Output pixel at centred pixel coordinates p (x right, y down) takes the input at R(-theta) p,
    where R(theta) = [[cos, -sin], [sin, cos]] turns clockwise on screen (y points down).
    Works in pixel units, so non-square images rotate without shearing.
    """
    n, _, h, w = images.shape
    t = math.radians(degrees)
    c, s = math.cos(t), math.sin(t)
    # normalized coords u = x / (W/2), v = y / (H/2); x_in = c x + s y, y_in = -s x + c y.
    theta = torch.tensor([[c, s * h / w, 0.0], [-s * w / h, c, 0.0]], dtype=images.dtype,
                         device=images.device).expand(n, 2, 3)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def apply_condition(images: torch.Tensor, condition: RotationCondition) -> torch.Tensor:
    if condition.kind == "identity":
        return images
    if condition.kind == "rot90":
        return rotate_clockwise(images, int(round(condition.angle / 90)))
    if condition.kind == "flip_ud":
        return flip_upside_down(images)
    if condition.kind == "flip_lr":
        return flip_left_right(images)
    if condition.kind == "angle":
        return rotate_angle(images, condition.angle)
    raise ValueError(f"unknown rotation condition kind {condition.kind!r}")
