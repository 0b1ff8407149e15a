"""Self-attention restricted to each image of a packed row, behind interchangeable backends.

A backend turns the batch's image ids into a plan once per batch (a mask, a block mask,
segment offsets) that every layer shares, then attends with it:

- sdpa: scaled_dot_product_attention with a dense (R, 1, L, L) document mask: the portable
  reference; it computes all L^2 scores of a row and masks most of them away.
- flex: FlexAttention with a document block mask: blocks outside every image are skipped.
  Compiled (CPU and CUDA); its first step compiles for a while.
- segments: each image's tokens gathered into a batch of images of similar length (buckets
  of 16 tokens), SDPA per bucket with a key-padding mask, outputs scattered back: a row
  costs about the sum of its images' n_i^2, on any device, with gradients. Its plan reads
  the image lengths on the host (one sync per batch) and its shapes change per batch.
- varlen: flash attention over variable-length segments (CUDA): each image is a sequence
  of its own, so a row costs the sum of its images' n_i^2. A row's padding is one more short
  segment, whose outputs are never used.

FlexAttention has no backward on CPU (torch 2.13): there, flex serves evaluation only.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from navit_lightning.errors import ConfigError
from navit_lightning.models.pooling import image_lengths


def document_mask(image_ids: torch.Tensor) -> torch.Tensor:
    """(R, L) image ids -> (R, 1, L, L) bool mask, True where query and key share an image.

    Padding tokens (one shared id) attend to each other, so no query row is fully masked
    and SDPA never produces NaN; their outputs are never pooled.
    """
    return rearrange(image_ids, "r i -> r 1 i 1") == rearrange(image_ids, "r j -> r 1 1 j")


class Backend(Protocol):
    name: str

    def plan(self, image_ids: torch.Tensor) -> Any:
        """What every layer needs to attend within images, built once per batch."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any) -> torch.Tensor:
        """q, k, v: (R, L, H, D), as the qkv projection lays them out (views, no copy)
        -> (R, L, H, D)."""


class SdpaBackend:
    name = "sdpa"

    def plan(self, image_ids: torch.Tensor) -> torch.Tensor:
        return document_mask(image_ids)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (R, H, L, D) views
        return F.scaled_dot_product_attention(q, k, v, attn_mask=plan).transpose(1, 2)


@cache
def _compiled_flex_attention() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class FlexBackend:
    name = "flex"

    def __init__(self, block_size: int = 128) -> None:
        self.block_size = block_size

    def plan(self, image_ids: torch.Tensor) -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        def same_image(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return image_ids[b, q] == image_ids[b, kv]

        rows, length = image_ids.shape
        return create_block_mask(
            same_image, rows, None, length, length, device=image_ids.device, BLOCK_SIZE=self.block_size
        )

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (R, H, L, D) views
        return _compiled_flex_attention()(q, k, v, block_mask=plan).transpose(1, 2)


class SegmentPlan(NamedTuple):
    order: torch.Tensor  # (P,) flat token positions, bucket by bucket, image by image; an
    # image's slots beyond its length repeat its first token
    back: torch.Tensor  # (R*L,) each token's place in that order; padding tokens -> P (zeros)
    buckets: list[tuple[int, int]]  # (images, length) of each bucket, in order
    keys: list[torch.Tensor]  # per bucket (images, 1, 1, length): the key-padding mask


class SegmentsBackend:
    name = "segments"
    bucket_step = 16

    def plan(self, image_ids: torch.Tensor) -> SegmentPlan:
        rows, length = image_ids.shape
        device = image_ids.device
        # A row holds at most `length` images: a slot bound known without a host sync.
        lengths = image_lengths(image_ids, length)
        row = torch.arange(rows, device=device)[:, None]
        # Images lie in slot order from each row's start (see data.packing.pack).
        starts = (lengths.cumsum(1) - lengths + row * length).flatten()
        lengths = lengths.flatten()
        host_lengths = lengths.tolist()  # the one host sync
        order, own, buckets, keys = [], [], [], []
        for bucket in sorted({-(-n // self.bucket_step) * self.bucket_step for n in host_lengths if n}):
            members = torch.tensor(
                [i for i, n in enumerate(host_lengths) if bucket - self.bucket_step < n <= bucket],
                device=device,
            )
            offsets = torch.arange(bucket, device=device)
            inside = offsets < lengths[members, None]  # (S, bucket)
            order.append((starts[members, None] + torch.where(inside, offsets, 0)).flatten())
            own.append(inside.flatten())
            buckets.append((len(members), bucket))
            keys.append(inside[:, None, None, :])
        if not order:  # an all-padding filler batch
            order, own = [starts.new_zeros(0)], [lengths.new_zeros(0, dtype=torch.bool)]
        order_all, own_all = torch.cat(order), torch.cat(own)
        back = torch.full((rows * length,), len(order_all), device=device)
        back[order_all[own_all]] = torch.arange(len(order_all), device=device)[own_all]
        return SegmentPlan(order_all, back, buckets, keys)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        rows = q.shape[0]
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))  # (R*L, H, D), views where strides allow
        gathered = [t.index_select(0, plan.order) for t in (q, k, v)]  # (P, H, D), one gather each
        outputs, offset = [], 0
        for (images, bucket), keys in zip(plan.buckets, plan.keys, strict=True):
            size = images * bucket
            qb, kb, vb = (
                rearrange(t[offset : offset + size], "(s l) h d -> s h l d", l=bucket) for t in gathered
            )
            attended = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=keys)
            outputs.append(rearrange(attended, "s h l d -> (s l) h d"))
            offset += size
        # Back to the token order; padding tokens read the appended zero row (never pooled).
        outputs.append(v.new_zeros(1, *v.shape[1:]))
        return torch.cat(outputs).index_select(0, plan.back).unflatten(0, (rows, -1))


class VarlenBackend:
    """Segments: every image, and each row's padding, in row-major order over the flattened
    batch; the longest segment is bounded by the row length (no host sync to find it)."""

    name = "varlen"

    def plan(self, image_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        rows, length = image_ids.shape
        # A segment starts at each row start and wherever the image id changes.
        starts = torch.ones_like(image_ids, dtype=torch.bool)
        starts[:, 1:] = image_ids[:, 1:] != image_ids[:, :-1]
        positions = torch.arange(rows * length, device=image_ids.device, dtype=torch.int32)
        begins = positions[starts.flatten()]
        return torch.cat([begins, begins.new_tensor([rows * length])]), length

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: tuple[torch.Tensor, int]
    ) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        offsets, max_len = plan
        rows = q.shape[0]
        # Autocast leaves the op's inputs as they come (q, k out of LayerNorm in float32).
        dtype = compute_dtype(q.device, q.dtype)
        if dtype not in HALF_DTYPES:
            raise ConfigError(
                "model.net.attention=varlen needs bf16 or fp16: use trainer.precision=bf16-mixed, "
                "or model.net.attention=flex for float32"
            )
        q, k, v = (t.to(dtype).flatten(0, 1).contiguous() for t in (q, k, v))
        out = varlen_attn(q, k, v, offsets, offsets, max_len, max_len)
        return out.unflatten(0, (rows, -1))


BACKENDS: dict[str, type] = {
    "sdpa": SdpaBackend,
    "segments": SegmentsBackend,
    "flex": FlexBackend,
    "varlen": VarlenBackend,
}


HALF_DTYPES = (torch.bfloat16, torch.float16)


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype matmuls run in here: autocast's when it is on, else the tensors' own."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


def varlen_available(device: torch.device) -> bool:
    """Flash varlen needs CUDA and an sm80+ GPU (Ampere or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def check_backend_name(name: str) -> str:
    if name != "auto" and name not in BACKENDS:
        raise ConfigError(f"model.net.attention={name!r} is unknown: use auto or one of {sorted(BACKENDS)}")
    return name


# On CPU, measured (docs/benchmarks.md): dense sdpa is faster for short rows, segments from
# 1024 tokens a row on (and flat as rows grow).
CPU_SEGMENTS_FROM_ROW_LEN = 1024


def make_backend(name: str, device: torch.device, dtype: torch.dtype, row_len: int) -> Backend:
    """`auto`: on CUDA varlen in bf16/fp16 (flash needs them) and flex in float32; on CPU
    sdpa for short rows and segments for long ones."""
    if name == "auto":
        if device.type != "cuda":
            name = "segments" if row_len >= CPU_SEGMENTS_FROM_ROW_LEN else "sdpa"
        elif dtype in HALF_DTYPES and varlen_available(device):
            name = "varlen"
        else:
            name = "flex"
    return BACKENDS[name]()


class Attention(nn.Module):
    """Multi-head self-attention with per-head q/k LayerNorm (as in NaViT)."""

    def __init__(self, dim: int, heads: int, qk_norm: bool = True) -> None:
        super().__init__()
        if dim % heads:
            raise ConfigError(f"model.net.dim={dim} must be divisible by model.net.heads={heads}")
        self.heads = heads
        head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.LayerNorm(head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, backend: Backend, plan: Any) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "r l (three h d) -> three r l h d", three=3, h=self.heads)
        out = backend(self.q_norm(q), self.k_norm(k), v, plan)
        return self.proj(rearrange(out, "r l h d -> r l (h d)"))
