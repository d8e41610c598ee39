"""Where a timm model's pretrained weights come from, settled before any network access.

``timm.create_model(NAME, pretrained=True)`` goes to the Hugging Face hub (or a URL) and, without
a network, retries for a minute before failing. So :func:`prepare_pretrained` first builds the
architecture with ``pretrained=False`` (no download) and reads its ``pretrained_cfg``:

* the class count of the pretrained head against the dataset's, refused at once when they
  differ (pretrained weights keep their own head), naming ``--checkpoint`` for a fine-tuned
  state dict and ``pretrained=False``;
* whether the weights are already on this machine (the hub's cache, torch hub's checkpoint folder,
  or a local ``file``): then they are read with the hub set offline, so nothing is fetched;
* otherwise whether the weights' host answers within :data:`CONNECT_TIMEOUT` seconds; when it does
  not, the command fails at once naming ``--checkpoint LOCAL_FILE`` and ``pretrained=False``.
"""
from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from robust_attn.sources.base import SourceError

__all__ = ["CONNECT_TIMEOUT", "HF_HOST", "pretrained_config", "cached_weights", "reachable", "prepare_pretrained",
           "offline_hub"]

CONNECT_TIMEOUT = 3.0
HF_HOST = "huggingface.co"
HF_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin", "open_clip_model.safetensors")


def pretrained_config(net) -> dict:
    """The model's ``pretrained_cfg`` as a dict (empty when timm gives none)."""
    cfg = getattr(net, "pretrained_cfg", None) or getattr(net, "default_cfg", None) or {}
    if not isinstance(cfg, dict):
        cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    return cfg


def cached_weights(cfg: dict) -> str | None:
    """The local copy of the pretrained weights ``cfg`` names, or None: its ``file``, the hub's
    cache of ``hf_hub_id`` or torch hub's checkpoint of ``url``."""
    if cfg.get("file") and Path(cfg["file"]).is_file():
        return str(cfg["file"])
    hub_id = cfg.get("hf_hub_id")
    if hub_id:
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            try_to_load_from_cache = None
        if try_to_load_from_cache is not None:
            repo, _, revision = str(hub_id).partition("@")
            names = (cfg["hf_hub_filename"],) if cfg.get("hf_hub_filename") else HF_FILES
            for name in names:
                found = try_to_load_from_cache(repo, name, revision=revision or None)
                if isinstance(found, str):
                    return found
    url = cfg.get("url")
    if url:
        import torch.hub

        local = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)
        if local.is_file():
            return str(local)
    return None


def reachable(host: str, port: int = 443, timeout: float = CONNECT_TIMEOUT) -> bool:
    """Whether a TCP connection to ``host`` opens within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def offline_hub():
    """The Hugging Face hub set offline for the block (weights already cached)."""
    keys = ("HF_HUB_OFFLINE",)
    saved = {k: os.environ.get(k) for k in keys}
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def prepare_pretrained(timm, name: str, kwargs: dict, num_classes: int, spec: str) -> contextlib.AbstractContextManager:
    """Check ``timm:NAME``'s pretrained weights before any download (module docstring); returns the
    context to build the pretrained model in (offline when the weights are cached)."""
    try:
        net = timm.create_model(name, pretrained=False, **kwargs)
    except (TypeError, ValueError) as err:
        raise SourceError(f"{spec!r}: timm cannot build it with {kwargs or 'no arguments'} ({err})") from None
    cfg = pretrained_config(net)
    classes = kwargs.get("num_classes", cfg.get("num_classes"))
    if classes is not None and int(classes) != int(num_classes):
        raise SourceError(f"{spec!r}: its pretrained weights classify {classes} classes but the dataset has "
                          f"{num_classes}; give --checkpoint LOCAL_STATE_DICT (weights fine-tuned on these "
                          f"{num_classes} classes) with --model-args num_classes={num_classes}, or --model-args "
                          f"pretrained=False for random weights")
    if cached_weights(cfg) is not None:
        return offline_hub()
    host = HF_HOST if cfg.get("hf_hub_id") else (urlparse(cfg["url"]).hostname if cfg.get("url") else None)
    if host is not None and not reachable(host):   # no host named: timm's own lookup decides
        raise SourceError(f"{spec!r}: its pretrained weights are not on this machine and {host} cannot be reached "
                          f"(no network?); give --checkpoint LOCAL_STATE_DICT (a .pth/.safetensors of this model), "
                          f"or --model-args pretrained=False for random weights")
    return contextlib.nullcontext()
