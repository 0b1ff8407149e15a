"""Self-attention restricted to each image of a packed row, behind interchangeable backends.

A backend turns the batch's image ids into a plan once per batch (a mask, a block mask,
segment offsets) that every layer shares, lays the tokens out for it (the packed rows
themselves, or image groups), then attends with it:

- sdpa: scaled_dot_product_attention with a dense (R, 1, L, L) document mask: the portable
  reference; it computes all L^2 scores of a row and masks most of them away.
- flex: FlexAttention with a document block mask: blocks outside every image are skipped.
  Compiled (CPU and CUDA); its first step compiles for a while.
- segments: the network runs on the images rather than the rows: the backend lays each
  image's tokens out once per batch, grouped with the images of its length, and every layer
  attends per group with SDPA (a key-padding mask where lengths differ, when the groups are
  coarser: `bucket_step`): no gather per layer, no padding in any layer, a batch costs the
  sum of its images' n_i^2. Any device, with gradients; on a CPU it attends in float32, also
  under bf16 autocast. Its plan reads the image lengths on the host (one sync per batch);
  under torch.compile it stays eager and the layers around it compile with a dynamic length.
- varlen: flash attention over variable-length segments (CUDA): each image is a sequence
  of its own, so a row costs the sum of its images' n_i^2. A row's padding is one more short
  segment, whose outputs are never used; an empty image slot a zero-length one, so that the
  plan has a fixed size (no host sync, one compiled graph). Each empty slot still costs a
  little: navit_base at K=64 slots and 1024-token rows (10 images a row) was 126 ms a step
  against 110 ms with only the real segments (H100, docs/benchmarks.md).

FlexAttention has no backward on CPU (torch 2.13): there, flex serves evaluation only.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from navit_lightning.batch import check_layout
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

    def plan(self, image_ids: torch.Tensor, max_images: int) -> Any:
        """What every layer needs to attend within images, built once per batch, from the
        (R, L) slot ids of a batch of at most `max_images` images a row."""

    def arrange(self, tokens: torch.Tensor, plan: Any, fill: int = 0) -> torch.Tensor:
        """(R, L, ...) per-token inputs -> the token layout this backend attends in; slots
        of that layout that hold no token get `fill`."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any) -> torch.Tensor:
        """q, k, v: (*layout, H, D), as the qkv projection lays them out (views, no copy)
        -> (*layout, H, D)."""


class RowLayout:
    """Attends in the packed rows themselves: (R, L, ...)."""

    def arrange(self, tokens: torch.Tensor, plan: Any, fill: int = 0) -> torch.Tensor:
        return tokens


class SdpaBackend(RowLayout):
    name = "sdpa"

    def plan(self, image_ids: torch.Tensor, max_images: int) -> torch.Tensor:
        return document_mask(image_ids)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (R, H, L, D) views
        return F.scaled_dot_product_attention(q, k, v, attn_mask=plan).transpose(1, 2)


@cache
def _compiled_flex_attention() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class FlexBackend(RowLayout):
    name = "flex"

    def __init__(self, block_size: int = 128) -> None:
        self.block_size = block_size

    def plan(self, image_ids: torch.Tensor, max_images: int) -> Any:
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
    """Tensors only, so that torch.compile guards on their sizes (dynamic after the first
    batches) and not on a per-batch structure."""

    order: torch.Tensor  # (P,) flat token position of each slot of the layout, bucket by
    # bucket, image by image; slots beyond an image's length -> R*L (a fill token)
    holds_token: torch.Tensor  # (P,) bool: the slot holds a token of its image
    buckets: torch.Tensor  # (B, 3) on the host: images, length, 1 if any image is shorter


class SegmentsBackend:
    name = "segments"
    # Exact lengths: 2 % faster than lengths rounded up to 4 tokens (navit_tiny, navit_small
    # and ViT-S on CPU), whose padding runs through every layer; 8 was 5 % slower than 4
    # (docs/benchmarks.md). A step above 1 groups images more coarsely, padded within a group.
    bucket_step = 1

    # Eager under torch.compile (plan, arrange, attend): the plan reads lengths on the host and
    # the bucket loop changes with every batch; the layers around them compile, with the
    # layout's length dynamic.
    @torch.compiler.disable
    def plan(self, image_ids: torch.Tensor, max_images: int) -> SegmentPlan:
        rows, length = image_ids.shape
        # The plan is built on the host and sent over once.
        image_ids = image_ids.cpu()  # the one host sync
        # Images lie in slot order from each row's start (see data.packing.pack). Checked here
        # too, for a network called by hand; Lightning's loop checks each host batch.
        check_layout(image_ids)
        lengths = image_lengths(image_ids, max_images)
        starts = (lengths.cumsum(1) - lengths + torch.arange(rows)[:, None] * length).flatten()
        lengths = lengths.flatten()
        by_bucket: dict[int, list[int]] = {}
        for image, n in enumerate(lengths.tolist()):
            if n:
                by_bucket.setdefault(-(-n // self.bucket_step) * self.bucket_step, []).append(image)
        order, holds_token, buckets = [], [], []
        for bucket, members in sorted(by_bucket.items()):
            offsets = torch.arange(bucket)
            inside = offsets < lengths[members, None]  # (S, bucket)
            order.append(torch.where(inside, starts[members, None] + offsets, rows * length).flatten())
            holds_token.append(inside.flatten())
            buckets.append((len(members), bucket, not inside.all()))
        if not buckets:  # an all-padding filler batch
            order, holds_token = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, dtype=torch.bool)]
        device = image_ids.device
        return SegmentPlan(
            torch.cat(order).to(device),
            torch.cat(holds_token).to(device),
            torch.tensor(buckets, dtype=torch.long).view(-1, 3),
        )

    @torch.compiler.disable
    def arrange(self, tokens: torch.Tensor, plan: SegmentPlan, fill: int = 0) -> torch.Tensor:
        """(R, L, ...) -> (P, ...): one gather per input, at the network's entry."""
        flat = tokens.flatten(0, 1)
        filler = flat.new_full((1, *flat.shape[1:]), fill)
        return torch.cat([flat, filler]).index_select(0, plan.order)

    @torch.compiler.disable
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        buckets = plan.buckets.tolist()
        if not buckets:  # an all-padding filler batch: (0, H, D) each
            # Still from q, k and v: under DDP every parameter must get its (zero) gradient,
            # or this rank's backward skips a bucket's all_reduce that the other ranks enter.
            return q + k + v
        if q.device.type != "cpu":
            return self.attend(q, k, v, plan)
        # On a CPU in float32, also under bf16 autocast: the CPU's bf16 flash kernel pads each
        # group to a long block (a group of 30 16-token images: 6.7 ms forward and backward in
        # bf16, 0.8 ms in float32 on an AMX CPU, docs/benchmarks.md). float64 (64-true, for
        # checking numerics) stays float64.
        dtype = torch.promote_types(v.dtype, torch.float32)
        with torch.autocast("cpu", enabled=False):
            return self.attend(q.to(dtype), k.to(dtype), v.to(dtype), plan).to(v.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        """SDPA within each group of the plan: (P, H, D) each -> (P, H, D)."""
        buckets = plan.buckets.tolist()
        # split, not slices: its backward is one cat, where each slice's fills a whole zero tensor
        sizes = [images * length for images, length, _ in buckets]
        outputs = []
        # views and transposes, not einops: this loop runs per bucket and layer, where its
        # parsing showed (2 % of a step, navit_tiny and ViT-S on CPU, docs/benchmarks.md)
        for qb, kb, vb, holds_token, (images, length, padded) in zip(
            *(t.split(sizes) for t in (q, k, v, plan.holds_token)), buckets, strict=True
        ):
            # (S*l, H, D) -> (S, H, l, D)
            qb, kb, vb = (t.unflatten(0, (images, length)).transpose(1, 2) for t in (qb, kb, vb))
            keys = holds_token.view(images, 1, 1, length) if padded else None
            attended = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=keys)
            outputs.append(attended.transpose(1, 2).flatten(0, 1))
        return torch.cat(outputs)


class VarlenBackend(RowLayout):
    """Segments over the flattened batch: each row is its K image slots in order, then its
    padding; an empty slot is a zero-length segment. So the plan has a fixed size, R*(K+1)+1
    offsets, and the longest segment is bounded by the row length: no host sync, and static
    shapes under torch.compile (no recompile as the image mix changes)."""

    name = "varlen"

    def plan(self, image_ids: torch.Tensor, max_images: int) -> tuple[torch.Tensor, int]:
        rows, length = image_ids.shape
        # Images lie in slot order from each row's start (see data.packing.pack).
        lengths = image_lengths(image_ids, max_images)  # (R, K)
        ends = lengths.cumsum(1)  # (R, K): where each slot's tokens end within the row
        row_starts = torch.arange(rows, device=image_ids.device)[:, None] * length
        bounds = torch.cat([row_starts, row_starts + ends], 1).flatten()  # (R*(K+1),)
        offsets = torch.cat([bounds, bounds.new_full((1,), rows * length)])
        return offsets.to(torch.int32), length

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
                "or model.net.attention=auto for float32"
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


def make_backend(name: str, device: torch.device, dtype: torch.dtype) -> Backend:
    """`auto`: on CUDA varlen in bf16/fp16 (flash needs them) and flex in float32; on CPU
    segments (measured, docs/benchmarks.md: as fast as dense sdpa at 144-token rows, faster
    from 256 on, and flat as rows grow)."""
    if name == "auto":
        if device.type != "cuda":
            name = "segments"
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
        """x: (*layout, dim), the backend's token layout."""
        # q, k and v each from its third of qkv's weight: three contiguous outputs, where one
        # matmul gives strided views that the q/k norms copy and whose gradients the backward
        # stacks (1.5..3.7 % of a CPU step in float32). x is cast once for the three (autocast
        # would cast it for each).
        x = x.to(compute_dtype(x.device, x.dtype))
        q, k, v = (
            F.linear(x, weight, bias).unflatten(-1, (self.heads, -1))
            for weight, bias in zip(self.qkv.weight.chunk(3), self.qkv.bias.chunk(3), strict=True)
        )
        out = backend(self.q_norm(q), self.k_norm(k), v, plan)
        return self.proj(rearrange(out, "... h d -> ... (h d)"))
