"""Self-attention restricted to each image of a packed row.

Masked SDPA over a per-row document mask: the portable reference implementation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn


def document_mask(image_ids: torch.Tensor) -> torch.Tensor:
    """(R, L) image ids -> (R, 1, L, L) bool mask, True where query and key share an image.

    Padding tokens (one shared id) attend to each other, so no query row is fully masked
    and SDPA never produces NaN; their outputs are never pooled.
    """
    return rearrange(image_ids, "r i -> r 1 i 1") == rearrange(image_ids, "r j -> r 1 1 j")


class Attention(nn.Module):
    """Multi-head self-attention with per-head q/k LayerNorm (as in NaViT)."""

    def __init__(self, dim: int, heads: int, qk_norm: bool = True) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"model.dim={dim} must be divisible by model.heads={heads}")
        self.heads = heads
        head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.LayerNorm(head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "r l (three h d) -> three r h l d", three=3, h=self.heads)
        out = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, attn_mask=mask)
        return self.proj(rearrange(out, "r h l d -> r l (h d)"))
