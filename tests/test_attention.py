"""Every attention backend gives the reference's (masked SDPA) outputs and gradients."""

import pytest
import torch

from navit_lightning.data.packing import PackedBatch, PackedShape, pack
from navit_lightning.models import NaViT
from navit_lightning.models.attention import varlen_available
from tests.test_packing import PATCH_DIM, make_sample

GRIDS = [(3, 5), (2, 2), (6, 4), (1, 7), (4, 4), (5, 1), (2, 6), (3, 3), (7, 2)]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def cases():
    for device in DEVICES:
        for backend in ("segments", "flex", "varlen"):
            if backend == "varlen" and not varlen_available(torch.device(device)):
                continue
            for dtype in (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,):
                yield pytest.param(device, backend, dtype, id=f"{device}-{backend}-{str(dtype)[6:]}")


def features_and_grads(backend: str, batch: PackedBatch, device: str, dtype: torch.dtype, grads: bool):
    torch.manual_seed(0)
    net = NaViT(patch_size=4, dim=64, depth=2, heads=4, max_grid=8, attention=backend).to(device)
    batch = PackedBatch(*(field.to(device) for field in batch))
    with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32), torch.set_grad_enabled(grads):
        features = net(batch)[batch.image_slots]
    if grads:
        features.float().pow(2).sum().backward()
    return features.float(), {name: p.grad.float() for name, p in net.named_parameters() if grads}


@pytest.mark.parametrize(("device", "backend", "dtype"), list(cases()))
def test_backend_matches_masked_sdpa(device, backend, dtype):
    samples = [make_sample(h, w, label=i, seed=i) for i, (h, w) in enumerate(GRIDS)]
    # Rows several images long, some padding at their ends.
    batch = pack(samples, PackedShape(rows=2, row_len=80, max_images=6), PATCH_DIM)
    with_grads = not (backend == "flex" and device == "cpu")  # FlexAttention has no CPU backward
    expected, expected_grads = features_and_grads("sdpa", batch, device, dtype, with_grads)
    features, grads = features_and_grads(backend, batch, device, dtype, with_grads)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(features, expected, **tolerance)
    for name, grad in expected_grads.items():
        scale = grad.abs().max().clamp(min=1e-6)
        torch.testing.assert_close(grads[name] / scale, grad / scale, **tolerance, msg=name)


def test_an_unknown_backend_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"model\.net\.attention='dense' is unknown"):
        NaViT(attention="dense")


def test_train_flops_match_torchs_flop_counter_where_dense_attention_is_all_real():
    """One image per row, no padding: the dense masked path computes exactly the in-image
    attention, so torch's counter (SDPA decomposed into bmm) must agree with train_flops;
    packing the same images together changes the dense work but not the model FLOPs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    net = NaViT(patch_size=4, dim=64, depth=2, heads=4, max_grid=8, attention="sdpa")
    samples = [make_sample(4, 4, label=i, seed=i) for i in range(3)]
    # The last image lost 6 of its 16 tokens (token dropping): FLOPs follow the kept ones.
    samples[-1] = samples[-1]._replace(patches=samples[-1].patches[:10], coords=samples[-1].coords[:10])
    for sample in samples:
        alone = pack([sample], PackedShape(rows=1, row_len=len(sample.patches), max_images=1), PATCH_DIM)
        with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
            net(alone).sum().backward()
        assert counter.get_total_flops() == int(net.train_flops(alone))
    alone = [pack([s], PackedShape(rows=1, row_len=16, max_images=1), PATCH_DIM) for s in samples]
    packed = pack(samples, PackedShape(rows=1, row_len=64, max_images=4), PATCH_DIM)
    assert int(net.train_flops(packed)) == sum(int(net.train_flops(batch)) for batch in alone)


def image_mixes(count: int):
    import random

    for seed in range(count):
        rng = random.Random(seed)
        grids = [(rng.randint(1, 6), rng.randint(1, 6)) for _ in range(rng.randint(3, 8))]
        samples = [make_sample(h, w, label=i, seed=10 * seed + i) for i, (h, w) in enumerate(grids)]
        yield pack(samples, PackedShape(rows=3, row_len=48, max_images=6), PATCH_DIM)


@pytest.mark.slow
def test_compiled_network_compiles_once_without_graph_breaks():
    """Static batch shapes: one graph for every image mix, no recompiles, no break per image."""
    from torch._dynamo.utils import counters

    net = NaViT(patch_size=4, dim=32, depth=2, heads=4, max_grid=8, attention="sdpa")
    net.compile()
    counters.clear()
    for batch in image_mixes(4):
        net(batch).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"] and not counters["recompiles"]


@pytest.mark.slow
def test_compiled_segments_settle_after_the_first_batches_and_match_eager():
    """segments' layout changes length with every batch: its layers recompile once with that
    length dynamic, then never again; it breaks the graph only around its own eager parts
    (plan, arrange, attend), never per image."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    eager = NaViT(patch_size=4, dim=32, depth=2, heads=4, max_grid=8, attention="segments")
    compiled = torch.compile(eager)
    counters.clear()
    graphs = []
    for batch in image_mixes(6):
        compiled(batch).sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[-1], f"graphs compiled after each batch: {graphs}"
    assert all("torch.compiler.disable" in reason for reason in counters["graph_break"])
    torch.testing.assert_close(compiled(batch), eager(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("device", "dtype", "expected"),
    [
        ("cpu", torch.float32, "segments"),
        ("cpu", torch.bfloat16, "segments"),
        ("cuda", torch.bfloat16, "varlen"),
        ("cuda", torch.float32, "flex"),
    ],
)
def test_auto_picks_a_backend_that_trains_on_the_device(monkeypatch, device, dtype, expected):
    from navit_lightning.models import attention

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert attention.make_backend("auto", torch.device(device), dtype).name == expected


@pytest.mark.parametrize("backend", ["sdpa", "segments"])
def test_an_all_padding_batch_gives_finite_features_and_gradients(backend):
    net = NaViT(patch_size=4, dim=32, depth=1, heads=2, max_grid=8, attention=backend)
    empty = pack([], PackedShape(rows=2, row_len=16, max_images=2), PATCH_DIM)
    features = net(empty)
    features.sum().backward()
    assert torch.isfinite(features).all()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)
