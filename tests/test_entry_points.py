"""train.py and eval.py run end to end in subprocesses, as a user types them."""

import re
import sys

import pytest

from tests.conftest import TINY_RUN

pytestmark = pytest.mark.slow


def only(paths):
    paths = list(paths)
    assert len(paths) == 1, paths
    return paths[0]


def assert_run_folder(run, validated: bool = True):
    checkpoints = run / "checkpoints"
    assert (checkpoints / "last.ckpt").is_file()
    # The best checkpoint by val/acc exists once a validation has run.
    assert bool(list(checkpoints.glob("epoch_*.ckpt"))) == validated
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_train_then_eval_reports_accuracy(run_entry_point):
    train = run_entry_point("train.py", *TINY_RUN)
    run = only((run_entry_point.root / "logs" / "train" / "runs").iterdir())
    assert_run_folder(run)
    assert "training batches per rank: [" in train.stdout + train.stderr
    assert "world size 1" in (run / "train.log").read_text()

    # The checkpoint alone says which network and data: no overrides needed.
    result = run_entry_point("eval.py", f"ckpt_path={run}/checkpoints/last.ckpt")
    accuracy = re.search(r"test accuracy: ([0-9.]+)", result.stdout + result.stderr)
    assert accuracy and 0.0 <= float(accuracy.group(1)) <= 1.0

    # The same network on another folder of images.
    images = run_entry_point.root / "data" / "shapes" / "val"
    result = run_entry_point(
        "eval.py",
        f"ckpt_path={run}/checkpoints/last.ckpt",
        "split=val",
        "data=imagefolder",
        f"data.root={images}",
        "data.num_workers=0",
    )
    assert re.search(r"val accuracy: [0-9.]+", result.stdout + result.stderr)


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_two_rank_ddp_on_cpu(run_entry_point, strategy):
    result = run_entry_point(
        "train.py",
        *TINY_RUN,
        f"strategy={strategy}",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "test=false",
    )
    output = result.stdout + result.stderr
    assert "world size 2" in output
    # One whole epoch, split evenly: both ranks ran the same number of batches.
    counts = re.search(r"training batches per rank: \[(\d+), (\d+)\]", output)
    assert counts and counts.group(1) == counts.group(2) and int(counts.group(1)) > 1
    # Each torchrun process names its Hydra run folder from its own clock (a start across a
    # second boundary gives rank 1 a folder of its own); only rank 0 writes the results.
    runs = (run_entry_point.root / "logs" / "train" / "runs").iterdir()
    assert_run_folder(only(run for run in runs if (run / "checkpoints").exists()))


def test_multirun_makes_one_folder_per_job(run_entry_point):
    run_entry_point("train.py", "-m", "seed=1,2", *TINY_RUN, "trainer.max_steps=3", "test=false")
    sweep = only((run_entry_point.root / "logs" / "train" / "multiruns").iterdir())
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    for job in jobs:
        assert_run_folder(sweep / job, validated=False)


def test_torchrun_two_processes_on_cpu(run_entry_point):
    """Lightning detects torchrun's environment and runs ddp in the processes it started."""
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2")
    result = run_entry_point(
        "train.py",
        *TINY_RUN,
        "strategy=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "test=false",
        launcher=torchrun,
    )
    output = result.stdout + result.stderr
    counts = re.search(r"training batches per rank: \[(\d+), (\d+)\]", output)
    assert counts and counts.group(1) == counts.group(2) and int(counts.group(1)) > 1
    # Each torchrun process names its Hydra run folder from its own clock (a start across a
    # second boundary gives rank 1 a folder of its own); only rank 0 writes the results.
    runs = (run_entry_point.root / "logs" / "train" / "runs").iterdir()
    assert_run_folder(only(run for run in runs if (run / "checkpoints").exists()))
