"""Training augmentations and evaluation transforms, on float tensors (C, H, W) in [0, 1].

* CIFAR-resolution sets (CIFAR-100, Fashion-MNIST padded to 32x32): random crop with 4-pixel
  zero padding and horizontal flip (He et al. 2016, section 4.2; the recipe the SAN and AA
  papers' CIFAR experiments follow).
* ImageNet: random-resized crop to 224 and horizontal flip for training; resize the short side
  to 256 then center-crop 224 for evaluation (SAN section 5.1).

Random draws use torch's global generator, so :class:`SeededAugment` can make them a function
of (seed, epoch, index).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = ["RandomCropFlip", "SeededAugment", "imagenet_train_transform", "imagenet_eval_transform"]


class RandomCropFlip:
    """Zero-pad by ``padding`` pixels, crop back to the input size at a random offset, then flip
    horizontally with probability 1/2."""

    def __init__(self, padding: int = 4, flip: bool = True):
        self.padding = padding
        self.flip = flip

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        _, h, w = image.shape
        p = self.padding
        if p:
            padded = F.pad(image, (p, p, p, p))
            top, left = (int(v) for v in torch.randint(0, 2 * p + 1, (2,)))
            image = padded[:, top:top + h, left:left + w]
        if self.flip and bool(torch.rand(()) < 0.5):
            image = image.flip(-1)
        return image.contiguous()

    def __repr__(self) -> str:
        return f"RandomCropFlip(padding={self.padding}, flip={self.flip})"


def imagenet_train_transform(size: int = 224):
    """Random-resized crop (scale 0.08-1, aspect 3/4-4/3, torchvision's defaults) + flip, on PIL."""
    from torchvision import transforms as T

    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor()])


def imagenet_eval_transform(size: int = 224, resize: int = 256):
    """Resize the short side to ``resize`` then center-crop ``size`` (single-crop evaluation)."""
    from torchvision import transforms as T

    return T.Compose([T.Resize(resize), T.CenterCrop(size), T.ToTensor()])


class SeededAugment(Dataset):
    """Makes a randomly augmented dataset's item ``i`` in epoch ``e`` a function of ``(seed, e, i)``.

    Each item is drawn under a private copy of torch's CPU generator seeded from the triple, so the
    augmentation is the same whatever the number of DataLoader workers, the process (DDP rank)
    or a resume in the middle of training. Call :meth:`set_epoch` at the start of every epoch.

    ``alternate_flip``: the alternating flip of airbench (Jordan 2024, section 3.6): image ``i`` is
    mirrored in even epochs if a coin drawn once from ``(seed, i)`` says so, and in odd epochs
    exactly when it was not, so every pair of consecutive epochs sees both orientations (the
    wrapped dataset should then not flip by itself).
    """

    def __init__(self, dataset: Dataset, seed: int = 0, alternate_flip: bool = False):
        self.dataset = dataset
        self.seed = int(seed)
        self.epoch = 0
        self.alternate_flip = alternate_flip
        self._coins = None
        if alternate_flip:
            gen = torch.Generator().manual_seed(self.seed)
            self._coins = torch.rand(len(dataset), generator=gen) < 0.5

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        item_seed = ((self.seed * 1_000_003 + self.epoch) * 100_000_007 + int(index)) % (2**63 - 1)
        state = torch.get_rng_state()
        try:  # seeding only the CPU generator: torch.manual_seed also seeds every accelerator (slow)
            torch.default_generator.manual_seed(item_seed)
            image, label = self.dataset[index]
        finally:
            torch.set_rng_state(state)
        if self._coins is not None and bool(self._coins[index]) != (self.epoch % 2 == 1):
            image = image.flip(-1)
        return image, label
