"""Per-image pooling over packed rows, without a dense mask.

Tokens are reduced per segment (row, image slot) with scatter/index_add, so the cost is
linear in the number of tokens whatever the number of images.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
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
    """A learned query per head attends over each image's tokens (as in NaViT's MAP head).

    Its keys are never formed: a head's score of a token x is (W_k x + b_k) . q =
    x . (W_k^T q) + b_k . q, one (dim -> heads) product where the keys took a (dim -> dim) one
    and then their product with the query. b_k . q adds the same to all of a head's scores,
    which the softmax takes out: the keys' bias is left out (its gradient was always zero).
    kv keeps the keys' and values' weights in one Linear, as checkpoints hold them."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Parameter(torch.randn(heads, dim // heads) * 0.02)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, segments: torch.Tensor, num_segments: int) -> torch.Tensor:
        """(N, D) tokens of (N,) segments -> (num_segments, D), one vector per segment (those
        without tokens are meaningless); tokens of segment `num_segments` are left out."""
        key_weight, value_weight = self.kv.weight.chunk(2)  # (D, D) each
        value_bias = self.kv.bias.chunk(2)[1]
        query = self.query * self.query.shape[-1] ** -0.5  # (H, d)
        score_weight = einsum(key_weight.unflatten(0, (self.heads, -1)), query, "h d c, h d -> h c")
        scores = F.linear(x, score_weight)  # (N, H)
        v = F.linear(x, value_weight, value_bias).unflatten(-1, (self.heads, -1))  # (N, H, d)
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
