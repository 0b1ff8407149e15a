"""predict.py as a user runs it: a messy folder predicted to the end, the class names of the
checkpoint, agreement with eval.py, and one-line refusals."""

import csv
import io
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from PIL import Image

from navit_lightning.batch import PackedShape
from navit_lightning.data.folder import image_files_under
from navit_lightning.data.packing import pack
from navit_lightning.data.shapes import CLASSES
from navit_lightning.data.transforms import image_to_sample
from navit_lightning.errors import DataError, OutputError
from navit_lightning.lit_module import NaViTClassifier
from navit_lightning.predict import PredictionWriter
from tests.conftest import (
    DDP_TWO_RANKS,
    REPO,
    TINY_RUN,
    TINY_SET,
    GlooStrategy,
    on_two_gloo_ranks,
    run_folder,
)
from tests.test_bad_input import make_messy_folder
from tests.test_resolution import accuracy_lines

pytestmark = pytest.mark.slow

BROKEN = ["a/truncated.png", "a/truncated.jpg", "b/garbage.jpg", "b/empty.png"]


@pytest.fixture
def trained(run_entry_point):
    run_entry_point("train.py", *TINY_RUN, "patch_budgets=null")
    run = run_folder(run_entry_point.root)
    return run / "checkpoints" / "last.ckpt"


def predict(run_entry_point, ckpt, folder, run_dir, *overrides) -> tuple[str, list[dict[str, str]]]:
    result = run_entry_point(
        "predict.py", f"ckpt_path={ckpt}", f"input={folder}", f"hydra.run.dir={run_dir}", *overrides
    )
    with open(run_dir / "predictions.csv", newline="") as file:
        return result.stdout + result.stderr, list(csv.DictReader(file))


def test_predict_a_messy_folder_to_the_end(run_entry_point, trained, tmp_path):
    folder = make_messy_folder(tmp_path / "images")
    output, rows = predict(run_entry_point, trained, folder, tmp_path / "run", "top_k=3")
    readable = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and p.suffix != ".txt" and str(p.relative_to(folder)) not in BROKEN
    )
    assert [row["path"] for row in rows] == [str(p) for p in readable]
    assert list(rows[0]) == [
        "path", "class", "probability", "class_2", "probability_2", "class_3", "probability_3"
    ]  # fmt: skip
    for row in rows:
        assert {row["class"], row["class_2"], row["class_3"]} <= set(CLASSES)  # names, not numbers
        ranked = [float(row[name]) for name in ("probability", "probability_2", "probability_3")]
        assert ranked == sorted(ranked, reverse=True) and 0 < sum(ranked) <= 1 + 1e-5
    for name in BROKEN:
        assert len(re.findall(rf"skipping \S*{re.escape(name)}:", output)) == 1, name
    assert f"{len(readable)} image(s) predicted, {len(BROKEN)} file(s) left out as unreadable" in output


def test_predicted_classes_are_those_eval_counts_and_python_sees(run_entry_point, trained, tmp_path):
    shapes = run_entry_point.root / TINY_SET
    _, rows = predict(run_entry_point, trained, shapes / "val", tmp_path / "run")
    # from Python: Lightning's load_from_checkpoint looked for hyperparameters (a TypeError)
    model = NaViTClassifier.load_from_checkpoint(trained)

    class Tuned(NaViTClassifier):  # a subclass of one's own, from a file object, as Lightning's
        def __init__(self, *args: Any, smoothing: float = 0.0, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.smoothing = smoothing

    checkpoint = io.BytesIO(trained.read_bytes())
    tuned = Tuned.load_from_checkpoint(checkpoint, map_location={}, compile=False, smoothing=0.1)
    assert type(tuned) is Tuned and tuned.smoothing == 0.1  # its settings and the trained class's
    with pytest.raises(TypeError, match="cannot be called on an instance"):  # as Lightning's
        tuned.load_from_checkpoint(trained)  # would return another model, this one unchanged
    max_patches = torch.load(trained, weights_only=True)["run_config"]["data"]["max_patches"]
    assert model.class_names == sorted(CLASSES) and not model.training
    for row in rows[:4]:
        sample = image_to_sample(Image.open(row["path"]), 0, model.net.patch_size, max_patches)
        batch = pack([sample], PackedShape(1, len(sample.patches), 1), sample.patches.shape[1])
        with torch.no_grad():
            probability, label = model(batch).softmax(-1)[0].max(0)
        assert model.class_names[label] == row["class"]
        assert probability.item() == pytest.approx(float(row["probability"]), abs=1e-5)
    hits = [row["class"] == row["path"].split("/")[-2] for row in rows]
    result = run_entry_point(
        "eval.py", f"ckpt_path={trained}", "split=val", "data=imagefolder", f"data.root={shapes}"
    )
    val = shapes / "val"
    accuracy = float(re.search(r"val accuracy: ([0-9.]+)", result.stdout + result.stderr).group(1))
    assert len(rows) == len(image_files_under(val))
    assert sum(hits) / len(hits) == pytest.approx(accuracy, abs=5e-5)  # printed to 4 places
    # a checkpoint saved before class names were stored: its labels, by number
    checkpoint = torch.load(trained, map_location="cpu", weights_only=True)
    del checkpoint["class_names"]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    _, numbered = predict(run_entry_point, tmp_path / "old.ckpt", val, tmp_path / "old")
    assert [sorted(CLASSES)[int(row["class"])] for row in numbered] == [row["class"] for row in rows]


def make_input(root, kind):
    if kind == "missing":
        return root / "missing"
    (root / kind).mkdir()
    if kind == "none-decodable":  # its header reads, its pixels do not
        image = io.BytesIO()
        Image.new("RGB", (64, 64)).save(image, "PNG")
        (root / kind / "truncated.png").write_bytes(image.getvalue()[:60])
    else:
        (root / kind / ("notes.txt" if kind == "no-images" else "broken.png")).write_text("not an image")
    return root / kind


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", r"input=\S+missing does not exist: pass an image file or a folder"),
        (
            "no-images",
            r"input=\S+no-images holds no image files .+, but 1 file\(s\) of other types left out \(.txt 1\)",
        ),
        ("none-readable", r"none of the 1 input file\(s\) is a readable image"),
        ("none-decodable", r"none of the 1 input file\(s\) could be decoded"),  # exited 0, an empty CSV
    ],
)
def test_an_input_without_images_is_refused_with_one_line(run_entry_point, trained, tmp_path, kind, message):
    result = run_entry_point(
        "predict.py", f"ckpt_path={trained}", f"input={make_input(tmp_path, kind)}", check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert re.search(rf"error: {message}", output) and "Traceback" not in output, output[-3000:]
    assert not list((run_entry_point.root / "logs").rglob("predictions*"))  # no part left, no empty CSV


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("top_k=0", "top_k=0 is how many classes each image lists"),  # wrote rows of paths only
        ("top_k=-1", "top_k=-1 is how many classes each image lists"),  # a traceback from topk
        ("patch_budget=-5", "patch_budget=-5 is the most patches an image is scaled to"),  # Pillow's
        ("patch_budget=0", "patch_budget=0 is the most patches"),  # taken for null without a word
        # the input (a folder without images) was listed, maybe for minutes, before the checkpoint
        ("top_k=1", "ckpt_path=.+run.ckpt does not exist"),
    ],
)
def test_a_bad_top_k_or_patch_budget_is_refused_with_one_line(run_entry_point, tmp_path, override, message):
    result = run_entry_point(
        "predict.py", f"ckpt_path={tmp_path / 'run.ckpt'}", f"input={tmp_path}", override, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2 and re.search(f"error: {message}", output), output
    assert "Traceback" not in output


def test_a_budget_past_the_position_tables_or_no_batch_is_refused_before_any_image(
    run_entry_point, trained, tmp_path
):
    """A 2000x20 panorama at 400 patches is 200 long, the tables 36: predict.py failed at its
    batch, no CSV for the other images, naming eval.py's key; eval.py after the budgets before.
    A limit of no batch wrote nothing and said nothing, exit 0."""
    for number, name in enumerate(CLASSES):
        (tmp_path / "in" / name).mkdir(parents=True)
        Image.new("RGB", (2000, 20) if number == 0 else (40, 40)).save(tmp_path / "in" / name / "0.png")
    result = run_entry_point(
        "predict.py",
        f"ckpt_path={trained}",
        f"input={tmp_path / 'in'}",
        "+trainer.limit_predict_batches=0",
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "error: trainer.limit_predict_batches=0 predicts nothing" in output
    result = run_entry_point(
        "predict.py", f"ckpt_path={trained}", f"input={tmp_path / 'in'}", "patch_budget=400", check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output[-3000:]
    panorama = tmp_path / "in" / CLASSES[0] / "0.png"
    assert (
        f"error: at patch_budget=400 input image {panorama} is 200 patches long, past model.net.max_grid=36"
        in output
    )
    result = run_entry_point(
        "eval.py",
        f"ckpt_path={trained}",
        "data=imagefolder",
        f"data.root={tmp_path / 'in'}",
        "split=val",
        "patch_budgets=[9,400,16]",
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert f"error: patch_budgets: at 400 val image {panorama} is 200 patches long" in output
    assert "leave out 400" in output and "val at patch budget" not in output  # none evaluated


def test_eval_makes_a_moved_runs_built_in_set_before_checking_its_budgets(run_entry_point, trained, tmp_path):
    """The run's data.root gone (another clone): the budgets' check read the set before
    eval.py had made it in this PROJECT_ROOT's data folder, a FileNotFoundError."""
    checkpoint = torch.load(trained, map_location="cpu", weights_only=True)
    checkpoint["run_config"]["data"]["root"] = str(tmp_path / "gone" / "shapes")
    torch.save(checkpoint, tmp_path / "moved.ckpt")
    elsewhere = tmp_path / "elsewhere"
    result = run_entry_point(
        "eval.py",
        f"ckpt_path={tmp_path / 'moved.ckpt'}",
        "split=val",
        "patch_budgets=[9,36]",
        env={"PROJECT_ROOT": str(elsewhere)},
    )
    assert set(accuracy_lines(result.stdout + result.stderr, "val")) == {9, 36}
    assert (elsewhere / TINY_SET / "shapes.json").is_file()


def test_eval_takes_the_attention_backend_and_refuses_other_model_settings(run_entry_point, trained):
    """+model.net.depth=3 was left out without a word: the checkpoint's network was evaluated."""
    result = run_entry_point("eval.py", f"ckpt_path={trained}", "+model.net.depth=3", check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "error: model.net.depth given: eval.py and predict.py build" in output

    def accuracy(*overrides: str) -> float:
        result = run_entry_point("eval.py", f"ckpt_path={trained}", *overrides)
        return float(re.search(r"test accuracy: ([0-9.]+)", result.stdout + result.stderr).group(1))

    assert accuracy("+model.net.attention=sdpa") == accuracy("+model.net.attention=segments")
    result = run_entry_point("eval.py", f"ckpt_path={trained}", "+model.net.attention=bogus", check=False)
    assert "error: model.net.attention='bogus' is unknown" in result.stdout + result.stderr  # it is applied


def test_two_ddp_ranks_predict_what_one_process_does(run_entry_point, trained, tmp_path):
    val = run_entry_point.root / TINY_SET / "val"
    _, alone = predict(run_entry_point, trained, val, tmp_path / "alone")
    _, split = predict(run_entry_point, trained, val, tmp_path / "ddp", *DDP_TWO_RANKS)
    assert [row["path"] for row in split] == [row["path"] for row in alone]
    for one, two in zip(alone, split, strict=True):
        assert one["class"] == two["class"]
        assert float(one["probability"]) == pytest.approx(float(two["probability"]), abs=1e-5)


def test_the_csv_lists_at_most_every_class_most_probable_first_in_input_order(tmp_path):
    """top_k=5 of 3 classes (topk would fail past them); a batch holds b.png before a.png."""
    writer = PredictionWriter(
        tmp_path / "predictions.csv", [Path("a.png"), Path("b.png")], ["x", "y", "z"], 5
    )
    trainer = SimpleNamespace(
        global_rank=0,
        world_size=1,
        is_global_zero=True,
        strategy=one_process(),
        predict_dataloaders=None,
    )
    writer.on_predict_start(trainer, None)
    probabilities = torch.tensor([[0.2, 0.5, 0.3], [0.7, 0.1, 0.2]])
    writer.write_on_batch_end(trainer, None, (torch.tensor([1, 0]), probabilities), None, None, 0)
    writer.on_predict_end(trainer, None)
    with open(tmp_path / "predictions.csv", newline="") as file:
        rows = list(csv.reader(file))
    assert rows == [
        ["path", "class", "probability", "class_2", "probability_2", "class_3", "probability_3"],
        ["a.png", "x", "0.700000", "z", "0.200000", "y", "0.100000"],
        ["b.png", "y", "0.500000", "z", "0.300000", "x", "0.200000"],
    ]


def write_one_row(folder: str) -> None:
    """café.png predicted as été, in this process's locale."""
    writer = PredictionWriter(Path(folder, "predictions.csv"), [Path("café.png")], ["été", "hiver"], 1)
    trainer = fake_trainer()
    writer.on_predict_start(trainer, None)
    writer.write_on_batch_end(trainer, None, (torch.tensor([0]), torch.tensor([[0.9, 0.1]])), None, None, 0)
    writer.on_predict_end(trainer, None)


def test_the_csv_is_utf8_in_any_locale(tmp_path):
    """A Latin-1 locale wrote class names in Latin-1; an ASCII one (LANG=C without Python's
    UTF-8 mode) failed on them."""
    ascii_only = {**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    command = f"from tests.test_predict import write_one_row; write_one_row({str(tmp_path)!r})"
    result = subprocess.run(
        [sys.executable, "-c", command], env=ascii_only, capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "predictions.csv").read_bytes().decode("utf-8").splitlines()[
        1
    ] == "café.png,été,0.900000"


def one_process(**methods) -> SimpleNamespace:
    """A strategy whose collectives return what this process gives, and `methods`."""
    return SimpleNamespace(
        broadcast=lambda value: value, reduce_boolean_decision=lambda decision, all: decision, **methods
    )


def fake_trainer(batches: int = 1) -> SimpleNamespace:
    """A one-process trainer whose loader has `batches` batches, one predicted."""
    return SimpleNamespace(
        global_rank=0,
        world_size=1,
        is_global_zero=True,
        strategy=one_process(),
        num_predict_batches=[1],
        predict_dataloaders=[None] * batches,
    )


@pytest.mark.parametrize(
    ("batches", "said"), [(1, "left out as unreadable"), (3, "left out by trainer.limit")]
)
def test_files_a_batch_limit_left_out_are_not_called_unreadable(tmp_path, caplog, batches, said):
    """fast_dev_run or trainer.limit_predict_batches: 32 files never read were 'unreadable'."""
    writer = PredictionWriter(tmp_path / "predictions.csv", [Path("a.png"), Path("b.png")], ["x", "y"], 1)
    trainer = fake_trainer(batches)
    writer.on_predict_start(trainer, None)
    writer.write_on_batch_end(trainer, None, (torch.tensor([0]), torch.tensor([[0.9, 0.1]])), None, None, 0)
    with caplog.at_level("INFO"):
        writer.on_predict_end(trainer, None)
    assert f"1 image(s) predicted, 1 file(s) {said}" in caplog.text


PATHS = [Path(f"{i}.png") for i in range(12)]
# rank 1 ends first, as it may; rank 0 takes one round more (two rows a round)
SHARES = {0: [10, 2, 0, 5, 7], 1: [1, 11, 3]}


def predict_a_share(rank: int, folder: Path) -> str:
    """`rank`'s share written into its own output folder, on a 2-rank gloo group."""
    writer = PredictionWriter(folder / f"rank{rank}" / "predictions.csv", PATHS, ["x", "y"], 1)
    trainer = SimpleNamespace(
        global_rank=rank,
        world_size=2,
        is_global_zero=rank == 0,
        strategy=GlooStrategy(),
        num_predict_batches=[1],
        predict_dataloaders=[None],
    )
    writer.on_predict_start(trainer, None)
    numbers = SHARES[rank]
    probabilities = torch.tensor([[0.9, 0.1]] * len(numbers))
    writer.write_on_batch_end(trainer, None, (torch.tensor(numbers), probabilities), None, None, 0)
    writer.on_predict_end(trainer, None)
    return "done"


def test_two_ranks_rows_meet_on_rank_zero_in_input_order_whatever_their_folders(tmp_path, monkeypatch):
    """Each rank's output folder its own (a node-local PROJECT_ROOT on each node): rank zero
    found no part of rank 1 and lost every row. The rows come through the process group, in
    rounds, by input number (10 after 2), and no part is left."""
    monkeypatch.setattr("navit_lightning.predict.ROWS_A_ROUND", 2)
    assert on_two_gloo_ranks(predict_a_share, tmp_path) == {0: "done", 1: "done"}
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "rank0/predictions.csv"
    ]
    with open(tmp_path / "rank0" / "predictions.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["path"] for row in rows] == [f"{i}.png" for i in sorted(SHARES[0] + SHARES[1])]


def test_a_failed_or_empty_prediction_leaves_no_csv_and_no_part(tmp_path):
    """No image decoded: refused, not an empty CSV; a run failing midway leaves no part."""
    paths = [Path("a.png"), Path("b.png")]
    trainer = fake_trainer()
    writer = PredictionWriter(tmp_path / "predictions.csv", paths, ["x", "y"], 1)
    writer.on_predict_start(trainer, None)
    with pytest.raises(DataError, match=r"none of the 2 input file\(s\) could be decoded"):
        writer.on_predict_end(trainer, None)
    assert list(tmp_path.iterdir()) == []

    failing = PredictionWriter(tmp_path / "predictions.csv", paths, ["x", "y"], 1)
    failing.on_predict_start(trainer, None)
    failing.write_on_batch_end(trainer, None, (torch.tensor([0]), torch.tensor([[0.9, 0.1]])), None, None, 0)
    failing.on_exception(trainer, None, RuntimeError("out of memory"))
    assert list(tmp_path.iterdir()) == []


def test_ranks_that_listed_other_files_are_refused_together(tmp_path):
    """Each ddp rank lists the input itself: a folder that changed in between had images
    predicted twice or never (exit 0). Every rank takes the same decision: no rank waits."""
    writer = PredictionWriter(tmp_path / "predictions.csv", [tmp_path / "a.png"], ["a", "b"], top_k=1)
    decisions = []

    def reduce_boolean_decision(decision, all):
        decisions.append(decision)
        return decision

    strategy = SimpleNamespace(
        broadcast=lambda digest: "rank 0's other list", reduce_boolean_decision=reduce_boolean_decision
    )
    with pytest.raises(DataError, match="the ranks listed different files under input="):
        writer.on_predict_start(SimpleNamespace(strategy=strategy, global_rank=1), None)
    assert decisions == [False] and not list(tmp_path.iterdir())


def test_the_writer_leaves_no_batch_numbers_piling_up(tmp_path):
    """Lightning's predict loop keeps every batch's image numbers: 190 bytes an image."""
    writer = PredictionWriter(tmp_path / "predictions.csv", [tmp_path / "a.png"], ["a", "b"], top_k=1)
    writer._part = io.StringIO()
    sampler = SimpleNamespace(seen_batch_indices=[[0]])
    trainer = SimpleNamespace(global_rank=0, predict_dataloaders=SimpleNamespace(batch_sampler=sampler))
    writer.write_on_batch_end(trainer, None, (torch.tensor([0]), torch.tensor([[0.25, 0.75]])), [0], None, 0)
    assert (
        sampler.seen_batch_indices == [()]
        and writer._part.getvalue() == f"0,{tmp_path / 'a.png'},b,0.750000\r\n"
    )


def test_a_folder_where_the_predictions_go_is_one_line_and_leaves_no_partial_file(tmp_path):
    """The rename into place raised outside the check of the writes: a traceback."""
    writer = PredictionWriter(tmp_path / "predictions.csv", [Path("a.png")], ["x", "y"], 1)
    (tmp_path / "predictions.csv").mkdir()
    trainer = fake_trainer()
    writer.on_predict_start(trainer, None)
    writer.write_on_batch_end(trainer, None, (torch.tensor([0]), torch.tensor([[0.9, 0.1]])), None, None, 0)
    with pytest.raises(
        OutputError, match=rf"^{re.escape(str(tmp_path / 'predictions.csv'))} is a folder: move it"
    ):
        writer.on_predict_end(trainer, None)
    assert [path.name for path in tmp_path.iterdir()] == ["predictions.csv"]


class FullDisk(io.StringIO):
    """A part file on a full disk: its buffered rows fail to be written, at a row or at close."""

    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")

    def close(self) -> None:
        raise OSError(28, "No space left on device")


def test_a_full_disk_is_one_line_that_names_the_file_and_leaves_no_part(tmp_path):
    """Three chained OSError tracebacks, and the part file stayed (its close raised before the
    unlink)."""
    writer = PredictionWriter(tmp_path / "predictions.csv", [Path("a.png")], ["x", "y"], 1)
    trainer = fake_trainer()
    writer.on_predict_start(trainer, None)
    part = writer._part_path(0)
    writer._part.close()
    writer._part = FullDisk()
    prediction = (torch.tensor([0]), torch.tensor([[0.9, 0.1]]))
    with pytest.raises(
        OutputError, match=rf"^{re.escape(str(part))} cannot be written \(No space left on device; "
    ):
        writer.write_on_batch_end(trainer, None, prediction, None, None, 0)
    writer.on_exception(trainer, None, OutputError("full"))
    assert not part.exists() and list(tmp_path.iterdir()) == []
