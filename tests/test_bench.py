"""The benchmarks run (their figures are for people, not asserted as speeds)."""

from navit_lightning.bench.data_loading import measure
from tests.conftest import TINY_RUN


def test_data_loading_benchmark_reports_every_figure(project_root, monkeypatch):
    monkeypatch.setenv("PROJECT_ROOT", str(project_root))
    figures = measure([*TINY_RUN], batches=3)
    assert 0 < figures["fill"] <= 1 and 0 < figures["fill_but_last"] <= 1
    assert figures["images_per_batch_mean"] > 1
    for name in ("loader_images_per_s", "loader_tokens_per_s", "train_images_per_s", "train_tokens_per_s"):
        assert figures[name] > 0, name
