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


def test_attention_benchmark_measures_every_layout_on_the_same_images(tmp_path, monkeypatch):
    import json
    import sys

    from navit_lightning.bench import attention

    out = tmp_path / "bench.json"
    argv = ["--models", "navit_tiny", "--tokens", "512", "--row-len", "256", "--steps", "1", "--no-compile"]
    monkeypatch.setattr(sys, "argv", ["bench", *argv, "--backends", "sdpa", "--json", str(out)])
    attention.main()
    results = json.loads(out.read_text())["results"]
    assert [(r["layout"], r["row_len"]) for r in results][:2] == [
        ("packed", 256),
        ("padded", results[1]["row_len"]),
    ]
    assert [r["row_len"] for r in results if r["layout"] == "scaling"] == list(attention.ROW_LENGTHS)
    assert len({r["images"] for r in results}) == 1  # every layout holds the same images
    assert all(r["step_ms"] > 0 and r["matmul_share"] > 0 for r in results)
