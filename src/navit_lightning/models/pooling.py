"""Per-image pooling over packed rows, without a dense mask.

Tokens are reduced per segment (row, image slot) with scatter/index_add, so the cost is
linear in the number of tokens whatever the number of images.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from navit_lightning.batch import PAD_ID


def segment_ids(image_ids: torch.Tensor, max_images: int) -> torch.Tensor:
    """(R, L) slot ids -> (R, L) segment ids r*K + slot; padding -> R*K (a dump segment)."""
    rows = image_ids.shape[0]
    row_offset = torch.arange(rows, device=image_ids.device)[:, None] * max_images
    return torch.where(image_ids == PAD_ID, rows * max_images, row_offset + image_ids)


def image_lengths(image_ids: torch.Tensor, max_images: int) -> torch.Tensor:
    """(R, L) slot ids -> (R, max_images) tokens each slot holds (0 for an empty slot)."""
    rows = image_ids.shape[0]
    segments = segment_ids(image_ids, max_images).flatten()
    # scatter_add, not bincount: its output size is static, so torch.compile keeps one graph
    counts = segments.new_zeros(rows * max_images + 1).scatter_add_(0, segments, torch.ones_like(segments))
    return counts[:-1].view(rows, max_images)


def segment_sum(values: torch.Tensor, segments: torch.Tensor, num_segments: int) -> torch.Tensor:
    """(N, ...) values summed into (num_segments, ...) by segment id."""
    out = values.new_zeros((num_segments, *values.shape[1:]))
    return out.index_add(0, segments, values)


def segment_softmax(scores: torch.Tensor, segments: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Softmax of (N, H) scores over the tokens of each segment."""
    index = segments[:, None].expand_as(scores)
    seg_max = scores.new_full((num_segments, scores.shape[1]), float("-inf"))
    seg_max = seg_max.scatter_reduce(0, index, scores, reduce="amax", include_self=True)
    weights = (scores - seg_max[segments].detach()).exp()
    return weights / segment_sum(weights, segments, num_segments)[segments]


class AttentionPool(nn.Module):
    """A learned query per head attends over each image's tokens (as in NaViT's MAP head)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Parameter(torch.randn(heads, dim // heads) * 0.02)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, segments: torch.Tensor, num_segments: int) -> torch.Tensor:
        """(N, D) tokens of (N,) segments -> (num_segments, D), one vector per segment (those
        without tokens are meaningless); tokens of segment `num_segments` are left out."""
        k, v = rearrange(self.kv(x), "n (two h d) -> two n h d", two=2, h=self.heads)
        scores = (k * self.query).sum(-1) * k.shape[-1] ** -0.5  # (N, H)
        weights = segment_softmax(scores.float(), segments, num_segments + 1)
        pooled = segment_sum(weights.to(v.dtype)[..., None] * v, segments, num_segments + 1)
        return self.proj(rearrange(pooled[:-1], "s h d -> s (h d)"))


class MeanPool(nn.Module):
    """Mean of each image's tokens."""

    def forward(self, x: torch.Tensor, segments: torch.Tensor, num_segments: int) -> torch.Tensor:
        """(N, D) tokens of (N,) segments -> (num_segments, D); tokens of segment
        `num_segments` are left out."""
        sums = segment_sum(x, segments, num_segments + 1)[:-1]
        counts = segment_sum(torch.ones_like(x[:, :1]), segments, num_segments + 1)[:-1]
        return sums / counts.clamp(min=1)
