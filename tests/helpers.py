"""Shared test fixtures' building blocks: a tiny attackable ResNet, a tiny ImageNet folder and a
clean subprocess environment."""
from __future__ import annotations

import functools
import os
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

import robust_attn
from robust_attn.models.wrapper import NormalizedModel

REPO = Path(__file__).resolve().parents[1]
MEAN, STD = [0.49, 0.48, 0.45], [0.25, 0.24, 0.26]


def tiny_resnet(seed: int = 1, num_classes: int = 10, **arch) -> NormalizedModel:
    """resnet26 at width 0.25 for 32x32 input (``arch`` adds e.g. ``stem_downsample=4``), in eval
    mode, with random batch-norm affine parameters and running statistics: a default-initialized
    network zeroes each residual branch's last BN scale, which leaves only the shortcuts (96% of
    its input gradient exactly 0) and would make attack tests meaningless."""
    torch.manual_seed(seed)
    net = robust_attn.create_model("resnet26", num_classes=num_classes, resolution="cifar", width=0.25, **arch)
    gen = torch.Generator().manual_seed(seed)
    for module in net.modules():
        if isinstance(module, nn.BatchNorm2d):
            c = module.num_features
            module.weight.data = torch.rand(c, generator=gen) + 0.5
            module.bias.data = 0.1 * torch.randn(c, generator=gen)
            module.running_mean.copy_(0.1 * torch.randn(c, generator=gen))
            module.running_var.copy_(torch.rand(c, generator=gen) + 0.5)
    return NormalizedModel(net, MEAN, STD).eval()


class LeadingLinear(nn.Module):
    """A linear 5-class model on 3 x 8 x 8 images (weights drawn with ``seed``) whose class 0 leads
    by ``lead`` logits: no small perturbation fools it, yet every logit moves with every pixel."""

    def __init__(self, seed: int, lead: float):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(5, 3 * 8 * 8, generator=g))
        self.bias = nn.Parameter(torch.tensor([lead, 0.0, 0.0, 0.0, 0.0]))

    def forward(self, x):
        return x.flatten(1) @ self.weight.t() + self.bias


def subprocess_env() -> dict:
    """The environment for a ``python -m robust_attn.cli`` child: one thread, this checkout first,
    no leftover torchrun variables."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def sample_images(size: int, count: int = 2) -> np.ndarray:
    """CIFAR-10 test images (embedded in the package), upscaled bilinearly for larger sizes:
    uint8 (count, size, size, 3), a fresh copy each call."""
    return _sample_images(size, count).copy()


@functools.lru_cache(maxsize=8)
def _sample_images(size: int, count: int):
    import torch.nn.functional as F

    from robust_attn.data import build_dataset

    dataset = build_dataset("cifar10", split="test", limit=count)
    images = torch.stack([dataset[i][0] for i in range(count)])
    if size != images.shape[-1]:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    return (images.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)


class Recorder:
    """A generator that logs every draw."""

    def __init__(self, rng):
        self.rng, self.log = rng, defaultdict(list)

    def __getattr__(self, name):
        method = getattr(self.rng, name)

        def call(*args, **kwargs):
            out = method(*args, **kwargs)
            self.log[name].append(np.asarray(out))
            return out

        return call


#: three ImageNet-1k wnids and their indices in the standard sorted list of 1,000 (0 tench,
#: 207 golden retriever, 999 toilet tissue): the labels a tiny ImageNet folder must get
IMAGENET_CLASSES = {"n01440764": 0, "n02099601": 207, "n15075141": 999}


def tiny_imagenet(root: Path, layout: str, per_class: int = 1, size: tuple[int, int] = (300, 260),
                  seed: int = 0) -> list[tuple[Path, int]]:
    """ImageNet's val split under ``root/val`` as users hold it, with noise images of ``size``
    (width, height): ``layout="folders"`` (one folder per wnid) or ``"flat"`` (the
    ``ILSVRC2012_val_*.JPEG`` files plus ``LOC_val_solution.csv``). Returns (file, label) pairs
    in file order."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    files, rows, k = [], ["ImageId,PredictionString"], 0
    for wnid, label in IMAGENET_CLASSES.items():
        for _ in range(per_class):
            k += 1
            stem = f"ILSVRC2012_val_{k:08d}"
            path = root / "val" / (stem + ".JPEG" if layout == "flat" else f"{wnid}/{stem}.JPEG")
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
            files.append((path, label))
            rows.append(f"{stem},{wnid} 1 1 50 50")
    if layout == "flat":
        (root / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
    elif layout != "folders":
        raise ValueError(f"layout is 'folders' or 'flat', got {layout!r}")
    return files
