"""Classification heads over pooled per-image features: (N, dim) -> (N, num_classes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from navit_lightning.errors import ConfigError
from navit_lightning.models.navit import init_weights


def linear_head(dim: int, num_classes: int) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_classes))


class BatchNormMlp(nn.Sequential):
    """Linear, BatchNorm over the batch's images, GELU, Linear: the BatchNorm is what
    trainer.sync_batchnorm=true synchronises across ddp ranks (as SyncBatchNorm).

    A training batch of one image (an epoch's last batch takes what is left; a rank's share,
    a batch with unreadable images left out) has no batch statistics, and BatchNorm raises:
    it is normalised by the running statistics instead, which it leaves as they are. Where
    SyncBatchNorm gathers the statistics of every rank, each rank must enter that collective
    and the images of all of them make the batch; one image over all of them (the other
    ranks' batches filler) would leave running_var NaN, the unbiased variance of one value
    (torch checks the count on one rank only): the step keeps running_var as it was."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__(nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.GELU(), nn.Linear(dim, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, dim) -> (N, num_classes)."""
        project, norm, activation, classify = self
        x = project(x)
        if not self.training:
            x = norm(x)
        elif gathers_across_ranks(norm):
            before = norm.running_var.clone()  # on the device: the count over ranks is not on the host
            x = norm(x)
            norm.running_var.copy_(torch.where(norm.running_var.isfinite(), norm.running_var, before))
        elif len(x) == 1:
            x = F.batch_norm(x, norm.running_mean, norm.running_var, norm.weight, norm.bias, eps=norm.eps)
        else:
            x = norm(x)
        return classify(activation(x))


def gathers_across_ranks(norm: nn.Module) -> bool:
    """Whether a training forward of `norm` syncs its statistics with other processes."""
    if not (isinstance(norm, nn.SyncBatchNorm) and dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(norm.process_group or dist.group.WORLD) > 1


HEADS = {"linear": linear_head, "bn_mlp": BatchNormMlp}


def build_head(kind: str, dim: int, num_classes: int) -> nn.Module:
    if kind not in HEADS:
        raise ConfigError(f"model.head={kind!r} is unknown: use one of {sorted(HEADS)}")
    head = HEADS[kind](dim, num_classes)
    head.apply(init_weights)
    return head
