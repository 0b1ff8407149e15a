"""NaViT: a ViT over packed rows of patches from images at their native resolution."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from navit_lightning.batch import PackedBatch
from navit_lightning.errors import ConfigError, is_number, require_counts, require_flags, require_positive
from navit_lightning.models.attention import (
    Attention,
    Backend,
    check_backend_name,
    compute_dtype,
    make_backend,
)
from navit_lightning.models.pooling import AttentionPool, MeanPool, image_lengths, segment_ids
from navit_lightning.models.pos_embed import FactorizedPosEmbed


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, qk_norm: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, qk_norm)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor, backend: Backend, plan: Any) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), backend, plan)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """uint8 flattened patches -> normalised pixels -> token vectors."""

    def __init__(
        self,
        patch_size: int,
        channels: int,
        dim: int,
        pixel_mean: Sequence[float],
        pixel_std: Sequence[float],
    ) -> None:
        super().__init__()
        patch_dim = patch_size * patch_size * channels
        # (pixel - mean) / std as pixel * scale + shift, one value per flattened pixel (the
        # channels innermost): one pass over the patches, vectorised along the patch (a
        # broadcast over 3 channels is not), and no float copy of the uint8 pixels first.
        # A mean or std of one value serves every channel (expand).
        scale = 1 / (torch.tensor(pixel_std).expand(channels) * 255)
        shift = -torch.tensor(pixel_mean).expand(channels) * 255 * scale
        self.register_buffer("scale", scale.repeat(patch_size * patch_size), persistent=False)
        self.register_buffer("shift", shift.repeat(patch_size * patch_size), persistent=False)
        # No LayerNorm over a patch's pixels (vit-pytorch's NaViT has one): it rescales a
        # flat, noisy patch to unit variance, erasing the brightness that tells inside from
        # outside an object.
        self.proj = nn.Sequential(nn.Linear(patch_dim, dim), nn.LayerNorm(dim))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """(..., p*p*C) uint8 -> (..., dim)."""
        if patches.dtype != torch.uint8:  # pixels of 0..1 in floats read as near black, silently
            raise ValueError(
                f"PackedBatch.patches is {patches.dtype}: NaViT reads uint8 pixels of 0..255, as "
                "data.packing.pack lays them out"
            )
        return self.proj(torch.addcmul(self.shift, patches, self.scale))


class NaViT(nn.Module):
    """Patch n' Pack ViT: one feature vector per image slot, (R, K, dim), from a PackedBatch.

    The classification head lives with the task (NaViTClassifier), so that under strategy=dp
    it runs once over the whole batch's images."""

    def __init__(
        self,
        patch_size: int = 16,
        channels: int = 3,
        dim: int = 192,
        depth: int = 12,
        heads: int = 3,
        mlp_ratio: float = 4.0,
        qk_norm: bool = True,
        max_grid: int = 64,
        fractional_pos: bool = False,
        pool: str = "attention",
        attention: str = "auto",
        grad_checkpointing: bool = False,
        pixel_mean: Sequence[float] = (0.5, 0.5, 0.5),
        pixel_std: Sequence[float] = (0.5, 0.5, 0.5),
    ) -> None:
        super().__init__()
        require_counts(
            "model.net",
            patch_size=patch_size,
            channels=channels,
            dim=dim,
            depth=depth,
            heads=heads,
            max_grid=max_grid,
        )
        require_positive("model.net", mlp_ratio=mlp_ratio)
        for name, values in (("pixel_mean", pixel_mean), ("pixel_std", pixel_std)):
            if not (
                isinstance(values, Sequence) and len(values) in (1, channels) and all(map(is_number, values))
            ):
                raise ConfigError(
                    f"model.net.{name}={values} must be a list of {channels} numbers, one per channel, or one"
                )
        require_positive("model.net", **{f"pixel_std[{i}]": std for i, std in enumerate(pixel_std)})
        require_flags(
            "model.net", qk_norm=qk_norm, fractional_pos=fractional_pos, grad_checkpointing=grad_checkpointing
        )
        self.num_features = dim
        self.patch_dim = patch_size * patch_size * channels
        self.mlp_hidden = int(dim * mlp_ratio)
        if self.mlp_hidden < 1:
            raise ConfigError(
                f"model.net.mlp_ratio={mlp_ratio} gives each block's MLP {self.mlp_hidden} hidden units "
                f"at model.net.dim={dim}: raise it to at least {math.ceil(1000 / dim) / 1000}"
            )
        self.attention = check_backend_name(attention)
        self.grad_checkpointing = grad_checkpointing
        self.patch_size = patch_size
        self.patch_embed = PatchEmbed(patch_size, channels, dim, pixel_mean, pixel_std)
        self.pos_embed = FactorizedPosEmbed(dim, max_grid, fractional_pos)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, qk_norm) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        pools = {"attention": lambda: AttentionPool(dim, heads), "mean": MeanPool}
        if pool not in pools:
            raise ConfigError(f"model.net.pool={pool!r} is unknown: use one of {sorted(pools)}")
        self.pool = pools[pool]()
        self.apply(init_weights)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        rows, max_images = batch.grid.shape[:2]
        device = batch.patches.device
        backend = make_backend(self.attention, device, compute_dtype(device, self.norm.weight.dtype))
        plan = backend.plan(batch.image_ids, max_images)  # once per batch, shared by every layer
        # Each token's image grid, for fractional positions: (R, L, 2).
        slot = batch.image_ids.clamp(min=0)
        token_grid = torch.gather(batch.grid, 1, slot[..., None].expand(-1, -1, 2))
        # The network runs in the backend's token layout (the rows, or image buckets).
        patches, coords, token_grid = (
            backend.arrange(t, plan) for t in (batch.patches, batch.coords, token_grid)
        )
        dump = rows * max_images  # the segment of every token that belongs to no image
        segments = backend.arrange(segment_ids(batch.image_ids, max_images), plan, fill=dump)
        x = self.patch_embed(patches) + self.pos_embed(coords, token_grid)
        # grad_checkpointing: each block keeps only its input for the backward, which runs the
        # block's forward again. Non-reentrant, torch's recommended kind: it stops recomputing
        # once it has what the backward needs, and works with every way of calling backward.
        recompute = self.grad_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            if recompute:
                x = checkpoint(block, x, backend, plan, use_reentrant=False)
            else:
                x = block(x, backend, plan)
        pooled = self.pool(self.norm(x).flatten(0, -2), segments.flatten(), dump)
        return pooled.unflatten(0, (rows, max_images))

    def no_weight_decay(self) -> set[str]:
        """The parameters that weight decay would pull towards zero for nothing, by name (as
        timm's models name them): the position tables and the pooling query."""
        return {
            name
            for name, _ in self.named_parameters()
            if name.startswith("pos_embed.") or name == "pool.query"
        }

    def train_flops(self, batch: PackedBatch) -> torch.Tensor:
        """Model FLOPs of one forward + backward on the batch's real tokens: the matmuls
        (backward twice the forward, but no input gradient for the pixels), attention counted
        within images only (4 n^2 dim per image and layer, whatever the backend computes).
        Norms, softmax and activations are left out, as torch's FLOP counter does."""
        # The tokens each image keeps (fewer than its grid when tokens were dropped): (R, K).
        tokens_per_image = image_lengths(batch.image_ids, batch.grid.shape[1]).float()
        tokens, squares = tokens_per_image.sum(), tokens_per_image.pow(2).sum()
        images = (tokens_per_image > 0).sum()
        d, depth = self.num_features, len(self.blocks)
        per_token = depth * (8 * d * d + 4 * d * self.mlp_hidden)
        per_batch = depth * 4 * d * squares
        if isinstance(self.pool, AttentionPool):  # mean pooling: no matmul
            # values and scores per token, the output per image, the query folded into the keys once
            per_token += 2 * d * (d + self.pool.heads)
            per_batch += 2 * d * d * (images + 1)
        return 2 * (2 * self.patch_dim * d) * tokens + 3 * (per_token * tokens + per_batch)


def init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
