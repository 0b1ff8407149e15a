"""Other NaViT implementations as the attention benchmark's peers, at equal architecture on
the same images, each fed the way its users feed it:

- vit-pytorch's NaViT (`pip install --no-deps vit-pytorch`, pinned in the Makefile): a list of
  image tensors, packed by its own greedy grouping into rows of `group_max_seq_len` tokens,
  rows padded to the longest, a dense [L, L] block mask. Its package `__init__` imports
  torchvision (broken next to a CPU torch build, FACTS.md), so `na_vit.py` is loaded by path.
- timm's NaFlexViT (where timm imports): one image per row, padded to the batch's longest
  image, masked SDPA.

Each peer gives its network, its forward and its input (already on the device); the
benchmark trains them with the same step as this project's NaViT.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from einops import rearrange

from navit_lightning.batch import PAD_ID, PackedShape
from navit_lightning.data.packing import ImageSample, pack


def load_vit_pytorch_navit() -> ModuleType:
    """vit_pytorch/na_vit.py as a module of its own, without the package's __init__."""
    spec = importlib.util.find_spec("vit_pytorch")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "vit-pytorch is not installed: pip install --no-deps vit-pytorch==1.26.11 (as make setup does)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "na_vit.py"
    module_spec = importlib.util.spec_from_file_location("vit_pytorch_na_vit", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def images_of(samples: list[ImageSample], patch_size: int, channels: int, device: torch.device) -> list:
    """Flattened uint8 patches -> (C, H, W) float images, as a user's loader would give."""
    return [
        rearrange(
            s.patches.to(device).float() / 255,
            "(h w) (p1 p2 c) -> c (h p1) (w p2)",
            h=s.grid[0],
            p1=patch_size,
            p2=patch_size,
            c=channels,
        )
        for s in samples
    ]


Peer = tuple[torch.nn.Module, Callable[[Any], torch.Tensor], Any]  # network, forward, its input


def vit_pytorch_navit(arch: dict, samples: list[ImageSample], device: torch.device, row_len: int) -> Peer:
    na_vit = load_vit_pytorch_navit()
    p, dim, heads = arch["patch_size"], arch["dim"], arch["heads"]
    torch.manual_seed(0)
    net = na_vit.NaViT(
        image_size=p * arch["max_grid"],
        patch_size=p,
        num_classes=10,
        dim=dim,
        depth=arch["depth"],
        heads=heads,
        dim_head=dim // heads,
        mlp_dim=int(dim * arch["mlp_ratio"]),
        channels=arch["channels"],
    ).to(device)

    def forward(images: list[torch.Tensor]) -> torch.Tensor:
        return net(images, group_images=True, group_max_seq_len=row_len)

    return net, forward, images_of(samples, p, arch["channels"], device)


def timm_naflexvit(arch: dict, samples: list[ImageSample], device: torch.device) -> Peer:
    from timm.models.naflexvit import NaFlexVit, NaFlexVitCfg

    torch.manual_seed(0)
    cfg = NaFlexVitCfg(
        patch_size=arch["patch_size"],
        embed_dim=arch["dim"],
        depth=arch["depth"],
        num_heads=arch["heads"],
        mlp_ratio=arch["mlp_ratio"],
        qk_norm=arch["qk_norm"],
        pos_embed="factorized",
        pos_embed_grid_size=(arch["max_grid"], arch["max_grid"]),
        global_pool="map",
    )
    net = NaFlexVit(cfg, in_chans=arch["channels"], num_classes=10).to(device)
    # Its loader's layout: one image per row, padded to the batch's longest, (y, x) coords.
    longest = max(len(s.patches) for s in samples)
    rows = pack(
        samples, PackedShape(rows=len(samples), row_len=longest, max_images=1), samples[0].patches.shape[1]
    )
    inputs = {
        "patches": rows.patches.float() / 255,
        "patch_coord": rows.coords,
        "patch_valid": rows.image_ids != PAD_ID,
    }
    return net, net, {key: value.to(device) for key, value in inputs.items()}
