import json

from PIL import Image

from navit_lightning.data import shapes


def test_generation_is_deterministic_varied_and_done_once(tmp_path):
    spec = shapes.ShapesSpec(num_train=138, num_val=6, num_test=6)  # train: three chunks of jobs
    first = shapes.generate(tmp_path / "a", spec, workers=1)
    # pool processes draw other images than in the first: each image depends on its seed alone
    second = shapes.generate(tmp_path / "b", spec, workers=3)
    files = sorted(p.relative_to(first) for p in first.rglob("*.*") if p.suffix in {".png", ".jpg"})
    assert len(files) == 150
    assert {p.parts[1] for p in files} == set(shapes.CLASSES)
    assert all((first / p).read_bytes() == (second / p).read_bytes() for p in files)
    sizes = {Image.open(first / p).size for p in files}
    assert len(sizes) > 20 and all(spec.min_side <= min(size) for size in sizes)
    assert json.loads((first / shapes.DONE_MARKER).read_text())["num_train"] == 138

    (first / files[0]).unlink()  # a finished set of the same spec is not written again
    shapes.generate(first, spec, workers=1)
    assert not (first / files[0]).exists()


def test_a_new_spec_replaces_the_old_images(tmp_path):
    shapes.generate(tmp_path, shapes.ShapesSpec(num_train=12, num_val=6, num_test=6), workers=1)
    shapes.generate(tmp_path, shapes.ShapesSpec(num_train=6, num_val=6, num_test=6, seed=1), workers=1)
    assert len([p for p in (tmp_path / "train").rglob("*.*")]) == 6
