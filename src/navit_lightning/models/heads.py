"""Classification heads over pooled per-image features: (N, dim) -> (N, num_classes)."""

from __future__ import annotations

from torch import nn

from navit_lightning.errors import ConfigError
from navit_lightning.models.navit import init_weights


def linear_head(dim: int, num_classes: int) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_classes))


def bn_mlp_head(dim: int, num_classes: int) -> nn.Module:
    """An MLP with BatchNorm over the batch's images: what trainer.sync_batchnorm=true
    synchronises across ddp ranks (as SyncBatchNorm)."""
    return nn.Sequential(nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.GELU(), nn.Linear(dim, num_classes))


HEADS = {"linear": linear_head, "bn_mlp": bn_mlp_head}


def build_head(kind: str, dim: int, num_classes: int) -> nn.Module:
    if kind not in HEADS:
        raise ConfigError(f"model.head={kind!r} is unknown: use one of {sorted(HEADS)}")
    head = HEADS[kind](dim, num_classes)
    head.apply(init_weights)
    return head
