import re

import pytest
import torch
from einops import rearrange

from navit_lightning.batch import PackedBatch, PackedShape
from navit_lightning.bench.profile import peak_host_bytes
from navit_lightning.data.packing import pack
from navit_lightning.errors import ConfigError
from navit_lightning.models import NaViT
from navit_lightning.models.navit import PatchEmbed
from navit_lightning.models.pooling import AttentionPool, MeanPool
from navit_lightning.models.pos_embed import FactorizedPosEmbed
from tests.test_packing import PATCH_DIM, make_sample

SHAPE = PackedShape(rows=3, row_len=40, max_images=4)
GRIDS = [(3, 5), (2, 2), (6, 4), (1, 7), (4, 4), (5, 1), (2, 6)]


def make_net(**kwargs) -> NaViT:
    torch.manual_seed(0)
    defaults = dict(patch_size=4, dim=32, depth=2, heads=4, max_grid=8)
    return NaViT(**(defaults | kwargs)).eval()


def features_by_label(net: NaViT, batch: PackedBatch) -> dict[int, torch.Tensor]:
    features = net(batch)
    return {int(batch.labels[r, k]): features[r, k] for r, k in (batch.labels >= 0).nonzero().tolist()}


def test_patch_embedding_normalises_each_pixel_by_its_channel_then_projects():
    """The one-pass pixel * scale + shift against (pixel / 255 - mean) / std per channel."""
    mean, std = (0.1, 0.5, 0.9), (0.2, 0.3, 0.4)
    embed = PatchEmbed(patch_size=2, channels=3, dim=8, pixel_mean=mean, pixel_std=std)
    patches = torch.randint(0, 256, (5, 2 * 2 * 3), dtype=torch.uint8)
    pixels = rearrange(patches.double() / 255, "n (pp c) -> n pp c", c=3)
    normalised = (pixels - torch.tensor(mean, dtype=torch.float64)) / torch.tensor(std, dtype=torch.float64)
    expected = embed.proj(rearrange(normalised, "n pp c -> n (pp c)").float())
    torch.testing.assert_close(embed(patches), expected, atol=1e-5, rtol=1e-5)


# The two layouts: the rows themselves (sdpa, and flex and varlen on GPUs), image buckets.
LAYOUTS = pytest.mark.parametrize("attention", ["sdpa", "segments"])


@LAYOUTS
@pytest.mark.parametrize("pool", ["attention", "mean"])
@pytest.mark.parametrize("fractional_pos", [False, True])
def test_image_packed_with_others_gives_the_same_features_as_alone(attention, pool, fractional_pos):
    net = make_net(pool=pool, fractional_pos=fractional_pos, attention=attention)
    samples = [make_sample(h, w, label=i, seed=i) for i, (h, w) in enumerate(GRIDS)]
    with torch.no_grad():
        packed = features_by_label(net, pack(samples, SHAPE, PATCH_DIM))
        assert sorted(packed) == list(range(len(samples)))
        for sample in samples:
            alone = features_by_label(net, pack([sample], PackedShape(1, SHAPE.row_len, 1), PATCH_DIM))
            torch.testing.assert_close(packed[sample.label], alone[sample.label], atol=1e-5, rtol=0)


def test_row_chunks_give_the_same_features_as_the_whole_batch():
    net = make_net()
    samples = [make_sample(h, w, label=i, seed=i) for i, (h, w) in enumerate(GRIDS)]
    batch = pack(samples, SHAPE, PATCH_DIM)
    with torch.no_grad():
        whole = net(batch)
        for chunk in (slice(0, 1), slice(1, 3), slice(2, 3)):
            part = PackedBatch(*(field[chunk] for field in batch))
            torch.testing.assert_close(net(part), whole[chunk], atol=1e-5, rtol=0)


@LAYOUTS
def test_padding_never_leaks_and_gradients_are_finite(attention):
    net = make_net(attention=attention).train()
    samples = [make_sample(2, 3, label=0, seed=0), make_sample(3, 3, label=1, seed=1)]
    batch = pack(samples, SHAPE, PATCH_DIM)
    noisy_padding = batch._replace(
        patches=torch.where(
            (batch.image_ids == -1)[..., None], torch.randint_like(batch.patches, 0, 256), batch.patches
        )
    )
    torch.testing.assert_close(net(batch)[batch.labels >= 0], net(noisy_padding)[batch.labels >= 0])
    empty = pack([], SHAPE, PATCH_DIM)
    loss = net(batch)[batch.labels >= 0].sum() + net(empty).sum() * 0
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)


@pytest.mark.parametrize(
    "fractional, expected_rows, expected_columns",
    # a 4x2 grid of an 8-entry table: absolute indexes by the coordinate itself; fractional
    # by coordinate / side x 8, so that the image spans the table (0, 2, 4, 6 and 0, 4)
    [(False, [0, 1, 2, 3], [0, 1]), (True, [0, 2, 4, 6], [0, 4])],
)
def test_a_token_at_row_y_column_x_gets_row_table_y_plus_column_table_x(
    fractional, expected_rows, expected_columns
):
    embed = FactorizedPosEmbed(dim=16, max_grid=8, fractional=fractional)
    coords = torch.cartesian_prod(torch.arange(4), torch.arange(2))  # (8, 2): (row, column)
    grid = torch.tensor([4, 2]).expand(len(coords), 2)
    expected = torch.stack(
        [embed.y[expected_rows[y]] + embed.x[expected_columns[x]] for y, x in coords.tolist()]
    )
    torch.testing.assert_close(embed(coords, grid), expected, rtol=0, atol=0)


def test_one_pixel_mean_and_std_serve_every_channel():
    """[0.5] passed the check, and the first batch failed with a shape error."""
    one = PatchEmbed(4, 3, 8, pixel_mean=[0.5], pixel_std=[0.25])
    each = PatchEmbed(4, 3, 8, pixel_mean=[0.5] * 3, pixel_std=[0.25] * 3)
    assert torch.equal(one.scale, each.scale) and torch.equal(one.shift, each.shift)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        # Hydra reads `no` and `off` as strings, which Python takes as true
        (dict(fractional_pos="no"), "model.net.fractional_pos=no must be true or false"),
        (dict(qk_norm="off"), "model.net.qk_norm=off must be true or false"),
        (dict(mlp_ratio=0.01), "model.net.mlp_ratio=0.01 gives each block's MLP 0 hidden units"),
        # it built, and failed at the first batch with a shape error
        (dict(dim=30, heads=4), "model.net.dim=30 must be divisible by model.net.heads=4"),
        # it trained on NaN to the end, exit 0; the other failed in a traceback of a shape error
        (dict(pixel_std=[0, 1, 1]), re.escape("model.net.pixel_std[0]=0 must be a number above 0")),
        (dict(pixel_std=[0.5, 0.5]), re.escape("model.net.pixel_std=[0.5, 0.5] must be a list of 3 numbers")),
        (dict(pixel_mean=0.5), "model.net.pixel_mean=0.5 must be a list of 3 numbers, one per channel"),
    ],
)
def test_settings_that_would_build_another_network_silently_are_refused(setting, message):
    with pytest.raises(ConfigError, match=message):
        make_net(**setting)


def test_the_smallest_mlp_ratio_a_refusal_suggests_builds():
    with pytest.raises(ConfigError, match=r"raise it to at least \S+$") as refusal:
        make_net(dim=12, heads=3, mlp_ratio=0.01)
    smallest = float(str(refusal.value).split()[-1])  # 1 / 12, rounded up
    assert make_net(dim=12, heads=3, mlp_ratio=smallest).mlp_hidden == 1


@pytest.mark.parametrize("scale", [1.0, 1e4])  # scores in the hundreds overflow exp() unless shifted
def test_attention_pooling_is_each_images_softmax_attention_of_its_query(scale):
    """Against keys formed and scored as written, forward and gradients (the module folds the
    query into the keys' weights)."""
    torch.manual_seed(0)
    pool = AttentionPool(dim=16, heads=4).double()
    with torch.no_grad():
        pool.query.mul_(scale)
    tokens = torch.randn(7, 16, dtype=torch.float64, requires_grad=True)
    segments = torch.tensor([0, 0, 0, 1, 1, 2, 2])  # two images; segment 2: padding, left out
    pooled = pool(tokens, segments, num_segments=2)
    expected = []
    for rows in [slice(0, 3), slice(3, 5)]:
        k, v = rearrange(pool.kv(tokens[rows]), "n (two h d) -> two h n d", two=2, h=4)
        attention = torch.softmax(k @ pool.query[:, :, None] / 4**0.5, dim=1)  # (h, n, 1) over n
        expected.append(pool.proj(rearrange((attention * v).sum(1), "h d -> (h d)")))
    expected = torch.stack(expected)
    # the module's softmax runs in float32, whatever the tokens' dtype
    torch.testing.assert_close(pooled, expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(pooled).all()
    inputs = [tokens, *pool.parameters()]
    weights = torch.randn_like(expected)
    for got, want in zip(
        torch.autograd.grad((pooled * weights).sum(), inputs),
        torch.autograd.grad((expected * weights).sum(), inputs),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mean_pooling_is_each_images_mean_token():
    tokens = torch.randn(7, 16, dtype=torch.float64)
    segments = torch.tensor([0, 0, 0, 2, 2, 3, 3])  # images 0 and 2; 1 is empty; 3: padding
    pooled = MeanPool()(tokens, segments, num_segments=3)
    torch.testing.assert_close(pooled[0], tokens[:3].mean(0))
    torch.testing.assert_close(pooled[2], tokens[3:5].mean(0))
    assert not pooled[1].any()  # an empty slot: zeros, not 0 / 0


def test_absolute_positions_beyond_the_table_are_refused():
    net = make_net(max_grid=4)
    batch = pack([make_sample(2, 6, label=0, seed=0)], SHAPE, PATCH_DIM)
    with pytest.raises(ValueError, match=r"or train with a larger model\.net\.max_grid"):
        net(batch)


@pytest.mark.parametrize(
    ("max_grid", "fractional", "fits"),
    [
        (6, False, True),  # the side the absolute tables hold: its last entry is index 5
        (5, False, False),  # one patch past them: refused with the fix, not an IndexError
        (4, True, True),  # fractional positions scale every side into the table: no bound
    ],
)
def test_the_position_tables_bound_an_images_side_only_for_absolute_positions(max_grid, fractional, fits):
    """An image 6 patches wide against tables of max_grid entries."""
    net = make_net(max_grid=max_grid, fractional_pos=fractional)
    batch = pack([make_sample(2, 6, label=0, seed=0)], SHAPE, PATCH_DIM)
    if fits:
        assert torch.isfinite(net(batch)).all()
    else:
        with pytest.raises(ConfigError, match=r"an image is 6 patches long but model\.net\.max_grid=5"):
            net(batch)


@LAYOUTS
def test_grad_checkpointing_gives_the_same_gradients_in_a_fraction_of_the_memory(attention):
    """Each block keeps only its input and runs again in the backward: the same gradients,
    and a lower peak of host memory over the forward and backward."""
    samples = [make_sample(h, w, label=i, seed=i) for i, (h, w) in enumerate(GRIDS)]
    batch = pack(samples, SHAPE, PATCH_DIM)
    grads, peaks = [], []
    for checkpointed in (False, True):
        net = make_net(attention=attention, depth=4, grad_checkpointing=checkpointed).train()
        peaks.append(peak_host_bytes(lambda net=net: net(batch)[batch.labels >= 0].pow(2).mean().backward()))
        grads.append([p.grad for p in net.parameters()])
    for grad, checkpointed_grad in zip(*grads, strict=True):
        torch.testing.assert_close(checkpointed_grad, grad, atol=1e-6, rtol=1e-5)
    assert peaks[1] < 0.6 * peaks[0], peaks
