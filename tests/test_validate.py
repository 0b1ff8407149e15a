"""Settings this machine cannot run are refused before any process starts, with one line."""

import os
import re
import traceback

import hydra
import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.demos.boring_classes import BoringModel
from omegaconf import OmegaConf, open_dict
from torch.multiprocessing.spawn import ProcessRaisedException

from navit_lightning import CONFIG_DIR
from navit_lightning import eval as eval_script
from navit_lightning import predict as predict_script
from navit_lightning.data.datamodule import PackedImageDataModule
from navit_lightning.errors import ConfigError
from navit_lightning.eval import evaluate
from navit_lightning.predict import predict
from navit_lightning.strategies import HydraDDPStrategy
from navit_lightning.train import build
from navit_lightning.utils import checkpoints, validate
from navit_lightning.utils.entry_point import refusal, refuse_null_groups, refuse_two_modes
from navit_lightning.utils.instantiate import instantiate_datamodule
from navit_lightning.utils.validate import check_launch, check_monitors
from tests.conftest import TINY_RUN, bare_trainer
from tests.test_configs import compose_train


def config(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize(
    ("gpus", "overrides", "message"),
    [
        (0, ["trainer.accelerator=gpu"], "no CUDA GPU is visible: use trainer.accelerator=cpu"),
        (0, ["trainer.precision=16-mixed"], "on CPU use trainer.precision=bf16-mixed"),
        # GPUs are visible, but the run asks for the CPU: it runs there, and Lightning would turn
        # 16-mixed into bf16-mixed with a warning alone
        (
            2,
            ["trainer.accelerator=cpu", "trainer.precision=16-mixed"],
            "trainer.precision=16-mixed needs a CUDA GPU: on CPU use trainer.precision=bf16-mixed",
        ),
        (
            0,
            ["trainer.sync_batchnorm=true", "strategy=ddp", "trainer.devices=2"],
            "sync_batchnorm=true needs CUDA",
        ),
        (2, ["trainer.devices=4", "strategy=ddp"], "trainer.devices=4 but 2 CUDA GPU(s) are visible"),
        (0, ["trainer.strategy=dp"], "trainer.strategy=dp is unknown: use strategy=<one of auto, ddp"),
        (0, ["strategy=dp"], "strategy=dp drives several CUDA GPUs from one process and none is visible"),
        (2, ["strategy=dp", "trainer.num_nodes=2"], "for trainer.num_nodes>1 use strategy=ddp"),
        (2, ["strategy=dp", "trainer.sync_batchnorm=true"], "drop trainer.sync_batchnorm"),
        (2, ["strategy=dp", "model.compile=true"], "model.compile=true cannot run under strategy=dp"),
        (0, ["model.net.attention=varlen"], "varlen is flash attention on CUDA: on CPU use"),
        (2, ["model.net.attention=varlen"], "needs bf16 or fp16 but trainer.precision=32-true"),
        (0, ["model.net.attention=flex"], "flex cannot train on CPU"),
        (  # they held neither the run's config nor its class names, and failed in eval.py
            0,
            ["+callbacks.model_checkpoint.save_weights_only=true"],
            "callbacks.model_checkpoint.save_weights_only=true: Lightning leaves the callbacks' part out",
        ),
        (0, ["~logger"], "callbacks.learning_rate_monitor needs a logger and the config has none (~logger"),
        (
            0,
            ["~logger", "callbacks=device_stats", "callbacks.learning_rate_monitor=null"],
            "has none (~logger, debug=fdr): add callbacks.device_stats=null, or keep logger=tensorboard",
        ),
        (0, ["trainer.reload_dataloaders_every_n_epochs=0"], "so it must rebuild it every epoch: keep 1"),
        # under ddp every rank failed in a traceback
        (0, ["trainer.use_distributed_sampler=true"], "shares every epoch among the ranks itself"),
        (0, ["patch_budgets=[16,0]"], "must be a list of positive patch counts, e.g. patch_budgets="),
        (0, ["patch_budgets=36"], "must be a list of positive patch counts"),
        (0, ["patch_budgets=[true]"], "must be a list of positive patch counts"),  # taken as 1
        (0, ["patch_budgets=[9,16,9]"], "16, 9] repeats 9: give each budget once"),
        (0, ["model.lr_scaling=square"], "model.lr_scaling='square' is unknown: use one of"),
        (
            0,
            ["model.lr_scaling=sqrt", "model.lr_reference_tokens=0"],
            "lr_reference_tokens=0 must be 1 or more",
        ),
        (
            0,
            ["model.lr_scaling=sqrt", "model.lr_reference_tokens=abc"],
            "lr_reference_tokens=abc must be 1 or more",
        ),
        (0, ["model.net.channels=1"], "model.net.channels=1: the data module gives RGB patches"),
        (0, ["trainer.precision=16-true"], "16-true trains float16 weights without loss scaling"),
        (0, ["trainer.precision=transformer-engine"], "transformer-engine needs a CUDA GPU: on CPU use"),
        (0, ["~scheduler"], "~scheduler removed the config model.scheduler follows"),
        (0, ["data=imagefolder"], "data.root must be set: add data.root=/path/to/images to the command"),
        (0, ["data=shards"], "data.root must be set: add data.root=/path/to/images to the command"),
        (
            2,
            ["optimizer.fused=true", "trainer.precision=bf16-mixed"],
            "optimizer.fused=true cannot clip gradients under trainer.precision=bf16-mixed",
        ),
        (
            0,
            ["optimizer.fused=true", "trainer.precision=bf16"],
            "optimizer.fused=true cannot clip gradients under trainer.precision=bf16:",
        ),
        # a model config's own optimizer, not the optimizer group's (which it leaves unused)
        (
            0,
            [
                "model.optimizer={_target_:torch.optim.AdamW,_partial_:true,lr:0.0005,fused:true}",
                "trainer.precision=bf16",
            ],
            "optimizer.fused=true cannot clip gradients under trainer.precision=bf16:",
        ),
        (0, ["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0 must be 1"),
        (0, ["trainer.accumulate_grad_batches=true"], "trainer.accumulate_grad_batches=True must be 1"),
        (0, ["trainer.gradient_clip_val=-1"], "a negative bound reverses every gradient"),
        # Lightning's constructor took these; they failed mid-fit in a traceback, in every rank
        (0, ["trainer.gradient_clip_val=abc"], "trainer.gradient_clip_val=abc must be a number"),
        (0, ["trainer.val_check_interval=0"], "trainer.val_check_interval=0 must be a number of training"),
        (
            0,
            ["trainer.val_check_interval=1.5"],
            "val_check_interval=1.5 must be a number of training batches",
        ),
        (0, ["trainer.limit_val_batches=1.5"], "trainer.limit_val_batches=1.5 must be a number of batches"),
        (0, ["trainer.max_epochs=abc"], "trainer.max_epochs=abc must be a whole number, or -1"),
        (0, ["trainer.log_every_n_steps=abc"], "trainer.log_every_n_steps=abc must be a whole number"),
        (0, ["trainer.num_nodes=abc"], "trainer.num_nodes=abc must be a whole number above 0"),
        (0, ["trainer.limit_val_batches=abc"], "trainer.limit_val_batches=abc must be a number of batches"),
        (0, ["trainer.devices=-3"], "trainer.devices=-3 must be a count (1 or more), -1 or auto"),
        (0, ["trainer.devices=[]"], "must be a count (1 or more), -1 or auto for every device"),
        # read as "not warn": torch's deterministic algorithms were left off
        (0, ["trainer.deterministic=warning"], "trainer.deterministic=warning must be true, false or warn"),
        (0, ["trainer.check_val_every_n_epoch=0"], "trainer.check_val_every_n_epoch=0 must be 1 or more"),
        (0, ["trainer.limit_train_batches=0"], "trainer.limit_train_batches=0 trains no batch"),
        (0, ["trainer.max_epochs=0"], "trainer.max_epochs=0 trains no batch"),
        (0, ["trainer.max_steps=0"], "trainer.max_steps=0 trains no batch"),
        (
            0,
            ["trainer.limit_test_batches=0"],
            "trainer.limit_test_batches=0 tests no batch: leave it out, or",
        ),
        (
            0,
            ["debug=fdr", "ckpt_path=last"],
            "trainer.fast_dev_run=True (debug=fdr) runs a few batches of each stage and resumes no "
            "ckpt_path=last: start from its weights with init_from=logs/train/runs/<run>/checkpoints/",
        ),
        (0, ["data.patch_size=16"], "data.patch_size=16 but model.net.patch_size=8: the data's patches"),
        (0, ["model.net.patch_size=0"], "model.net.patch_size=0 must be a whole number above 0"),
        (0, ["optimizer.lr=-1"], "optimizer: Invalid learning rate: -1"),
        (0, ["+optimizer.momentum=0.9"], "optimizer: AdamW.__init__() got an unexpected keyword argument"),
        (0, ["scheduler.warmup_steps=-1"], "scheduler.warmup_steps=-1 must be 0 (no warm-up) or more"),
        (0, ["scheduler.min_lr_ratio=1.5"], "scheduler.min_lr_ratio=1.5 is a share of the base rate"),
        (0, ["init_from=nowhere.ckpt"], "init_from=nowhere.ckpt does not exist: pass a run's checkpoint"),
        (0, ["init_from=/"], "init_from=/ is a folder: pass a run's checkpoint file"),
        (0, ["train=false"], "train=false tests a checkpoint, the network's weights would be its initial"),
        (0, ["seed=null"], "seed=null must be a whole number from 0 to 4294967295: every rank plans"),
        (0, ["seed=-1"], "seed=-1 must be a whole number from 0 to 4294967295"),
        (0, ["seed=4294967296"], "seed=4294967296 must be a whole number"),
        (0, ["seed=1.5"], "seed=1.5 must be a whole number"),
        # tracebacks about the first setting read (the strategy group still writes trainer.strategy)
        (0, ["~trainer"], "~trainer removed a config every run needs: choose trainer=default"),
        (0, ["~model"], "~model removed a config every run needs: choose model=<one of navit_base, "),
    ],
)
def test_refused(monkeypatch, gpus, overrides, message):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_launch(config(*overrides))


@pytest.mark.parametrize(
    ("task", "overrides", "message"),
    [
        ("eval", [], "ckpt_path must be set: add ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt"),
        ("predict", [], "ckpt_path and input must be set: add ckpt_path=logs/train/runs/<run>/checkpoints/"),
        (
            "eval",
            ["ckpt_path=run.ckpt", "split=tset"],
            "split='tset' is unknown: use split=val or split=test",
        ),
        (  # it ended in a KeyError after loading the network: no accuracy logged
            "eval",
            ["ckpt_path=run.ckpt", "split=val", "trainer.limit_val_batches=0"],
            "trainer.limit_val_batches=0 evaluates no batch",
        ),
        ("predict", ["ckpt_path=run.ckpt", "input=.", "~paths"], "~paths removed a config every run needs"),
    ],
)
def test_eval_and_predict_refuse_what_they_miss(task, overrides, message):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(task, overrides=overrides)
    run = {"eval": evaluate, "predict": predict}[task]
    with pytest.raises(ConfigError, match=re.escape(message)):
        run(cfg)


def saved_run(folder, attention: str | None):
    """A checkpoint file of a run with this attention backend (None: from before the setting),
    as eval.py's checks read it."""
    path = folder / "run.ckpt"
    net = {} if attention is None else {"attention": attention}
    torch.save({"state_dict": {}, "run_config": {"model": {"net": net}}}, path)
    return path


@pytest.mark.parametrize("task", ["eval", "predict"])
@pytest.mark.parametrize(
    ("trained", "overrides", "message"),
    [
        (
            "varlen",
            [],
            "model.net.attention=varlen is flash attention on CUDA: on CPU use +model.net.attention=auto",
        ),
        ("varlen", ["+model.net.attention=flex"], None),  # FlexAttention's forward runs on CPU
        (  # in float32 and half types: inductor failed in a traceback
            "auto",
            ["+model.net.attention=flex", "trainer.precision=64-true"],
            "model.net.attention=flex runs no float64 on CPU (trainer.precision=64-true): use +model",
        ),
        ("varlen", ["+model.net.attention=varlen"], "on CPU use +model.net.attention=auto"),
        ("auto", [], None),
    ],
)
def test_eval_and_predict_check_the_checkpoints_attention_before_they_start(
    tmp_path, monkeypatch, task, trained, overrides, message
):
    """A run trained on a GPU with varlen, evaluated on a CPU: it failed in a traceback from
    the first batch (flash attention has no CPU kernel), the advice of its error too. The
    check reads the checkpoint the script reads: once (a CRC pass over a large file each)."""
    image = tmp_path / "image.png"
    image.touch()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        given = [f"ckpt_path={saved_run(tmp_path, trained)}", "trainer.accelerator=cpu", *overrides]
        cfg = compose(task, overrides=given + ([f"input={image}"] if task == "predict" else []))
    reads = []
    monkeypatch.setattr(checkpoints, "read_checkpoint", counted(checkpoints.read_checkpoint, reads))
    monkeypatch.setattr(validate, "read_checkpoint", counted(validate.read_checkpoint, reads))

    class Checked(Exception):
        """What choosing the data raises here: the checks before it have passed."""

    def data_for(*args, **kwargs):
        raise Checked

    script = {"eval": eval_script, "predict": predict_script}[task]
    monkeypatch.setattr(script, "data_for", data_for)
    with pytest.raises(Checked if message is None else ConfigError, match=message and re.escape(message)):
        getattr(script, {"eval": "evaluate", "predict": "predict"}[task])(cfg)
    assert len(reads) == 1


def counted(function, calls: list):
    def call(*args, **kwargs):
        calls.append(args)
        return function(*args, **kwargs)

    return call


@pytest.mark.parametrize(
    ("gpus", "overrides"),
    [
        (0, []),
        (0, ["trainer.precision=bf16-mixed", "trainer.accelerator=cpu", "trainer.devices=2", "strategy=ddp"]),
        (
            2,
            [
                "trainer.devices=2",
                "strategy=ddp",
                "trainer.sync_batchnorm=true",
                "trainer.precision=16-mixed",
            ],
        ),
        (2, ["strategy=dp", "trainer.devices=2", "trainer.precision=bf16-mixed", "model.head=bn_mlp"]),
        (0, ["trainer.strategy=ddp_spawn", "trainer.accelerator=cpu"]),
        (2, ["model.net.attention=varlen", "trainer.precision=bf16-mixed"]),
        (2, ["model.net.attention=flex"]),
        (0, ["~logger", "callbacks.learning_rate_monitor=null"]),
        (0, ["optimizer.fused=true"]),
        (0, ["trainer.gradient_clip_val=null", "trainer.accumulate_grad_batches=4", "model.scheduler=null"]),
        (0, ["optimizer._target_=torch.optim.SGD", "~optimizer.betas", "+optimizer.momentum=0.9"]),
        (0, ["trainer.gradient_clip_val=0", "seed=0"]),  # no clipping, as Lightning takes it
        (0, ["seed=4294967295"]),  # the largest numpy takes
        (2, ["optimizer.fused=true", "trainer.precision=bf16-mixed", "trainer.gradient_clip_val=null"]),
        # Lightning's own names for a checkpoint, not files: ckpt_path=last resumes a run
        (0, ["ckpt_path=last"]),
        (0, ["ckpt_path=best", "train=false"]),
        # no warm-up (the Optuna search's first value) and a decay to 0 are schedules too
        (0, ["scheduler.warmup_steps=0", "scheduler.min_lr_ratio=0"]),
        # a model config of one's own without it: NaViT's default (a ConfigAttributeError)
        (0, ["~model.net.attention"]),
        (0, ["~strategy"]),  # Lightning's default, auto: it was a traceback
    ],
)
def test_allowed(monkeypatch, gpus, overrides):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    check_launch(config(*overrides))


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        (["trainer.devices=2"], True),  # auto: Lightning's ddp, ranks started as scripts
        (["trainer.strategy=ddp", "trainer.devices=2"], True),
        (["trainer.strategy=ddp_find_unused_parameters_true", "trainer.devices=2"], True),
        (["strategy=ddp", "trainer.devices=2"], False),  # the config group's: ranks run the job
        (["trainer.strategy=ddp_spawn", "trainer.devices=2"], False),  # ranks started in-process
        (["trainer.strategy=ddp_fork", "trainer.devices=2"], False),
        (["trainer.devices=1"], False),
        (["trainer.strategy=ddp", "trainer.num_nodes=2"], True),
        (["strategy=ddp", "trainer.num_nodes=2"], False),
    ],
)
def test_a_sweep_refuses_ranks_that_would_start_as_the_whole_sweep(monkeypatch, overrides, refused):
    monkeypatch.setattr(validate, "in_sweep", lambda: True)
    trainer = config("trainer.accelerator=cpu", *overrides).trainer
    if refused:
        with pytest.raises(
            ConfigError, match=r"in a sweep \(-m\): Lightning's launcher would start every rank"
        ):
            validate.check_sweep_launch(trainer, 1)
    else:
        validate.check_sweep_launch(trainer, 1)


@pytest.mark.parametrize(
    ("devices", "count"),
    [(3, 3), (-1, 4), ("-1", 4), ("auto", 4), ("2", 2), ("0,1", 2), ("0,1,", 2), ([0, 1], 2), ("x", 1)],
)
def test_devices_are_counted_as_lightning_reads_them(devices, count):
    assert validate.device_count(devices, 4) == count


# What torchrun sets in each process, but the number of processes, WORLD_SIZE.
TORCHRUN = {"TORCHELASTIC_RUN_ID": "myrun", "RANK": "0", "LOCAL_RANK": "0"}
# What SLURM sets in a job's batch script, but the number of tasks, SLURM_NTASKS; srun adds its
# step's id in the tasks it starts.
SLURM_BATCH = {"SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0"}
SRUN = SLURM_BATCH | {"SLURM_STEP_ID": "0"}


def launched_by(monkeypatch, launcher: dict[str, str]) -> None:
    """The environment of a process that `launcher`'s variables say who started."""
    for name in ("MASTER_ADDR", "TORCHELASTIC_RUN_ID", "LSB_JOBID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    ("launcher", "overrides", "message"),
    [
        (
            TORCHRUN | {"WORLD_SIZE": "2"},
            ["strategy=ddp"],
            r"torchrun started 2 process\(es\), but "
            r"trainer.devices=1 x trainer.num_nodes=1 makes 1: set trainer.devices to its --nproc_per_node",
        ),
        (TORCHRUN | {"WORLD_SIZE": "1"}, ["strategy=ddp", "trainer.devices=2"], "torchrun started 1 process"),
        (
            SRUN | {"SLURM_NTASKS": "2"},
            ["strategy=ddp"],
            r"the SLURM job has 2 task\(s\) \(SLURM_NTASKS\), one process each under srun, but trainer",
        ),
        # each task trained a whole run of its own, all in one folder
        (SRUN | {"SLURM_NTASKS": "2"}, [], r"one process each under srun, but trainer.devices=1 x"),
        (SRUN | {"SLURM_NTASKS": "1"}, [], None),
        # salloc's interactive step, a shell srun started: SLURM_NTASKS is the allocation's
        (SRUN | {"SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "1"}, [], None),
        (SLURM_BATCH | {"SLURM_NTASKS": "4"}, [], None),  # one device in the batch script
        # it waited for the ranks srun would have started
        (
            SLURM_BATCH | {"SLURM_NTASKS": "2"},
            ["strategy=ddp", "trainer.devices=2"],
            r"the SLURM job has 2 tasks \(SLURM_NTASKS\) and this process is none of them: start the run",
        ),
        # each of them started two more ranks: two groups met on one store
        (
            TORCHRUN | {"WORLD_SIZE": "2"},
            ["strategy=ddp_spawn", "trainer.devices=2"],
            r"torchrun started 2 process\(es\): strategy=ddp_spawn would start the ranks again in each; use",
        ),
        (
            SRUN | {"SLURM_NTASKS": "2"},
            ["trainer.strategy=ddp_spawn", "trainer.devices=2"],
            r"one process each under srun: strategy=ddp_spawn would start the ranks again in each; use",
        ),
        (TORCHRUN | {"WORLD_SIZE": "4"}, ["strategy=ddp", "trainer.devices=2", "trainer.num_nodes=2"], None),
    ],
)
def test_the_processes_a_launcher_started_must_be_the_trainers_devices(
    monkeypatch, launcher, overrides, message
):
    """Lightning failed in every process with a traceback, after the data was set up."""
    launched_by(monkeypatch, launcher)
    cfg = config("trainer.accelerator=cpu", *overrides)
    if message:
        with pytest.raises(ConfigError, match=message):
            check_launch(cfg)
    else:
        check_launch(cfg)


def test_a_sweeps_ranks_that_srun_started_are_no_sweep_of_lightnings_launcher(monkeypatch):
    """Under srun Lightning's launcher starts no process: a sweep (-m) in a SLURM job's tasks,
    one per device, with trainer.strategy=ddp runs each job in the tasks srun started (they
    share the first task's sweep folder), and must not be refused as the launcher's would be."""
    monkeypatch.setattr(validate, "in_sweep", lambda: True)
    launched_by(monkeypatch, SRUN | {"SLURM_NTASKS": "2"})
    trainer = config("trainer.accelerator=cpu", "trainer.strategy=ddp", "trainer.devices=2").trainer
    validate.check_sweep_launch(trainer, 1)


@pytest.mark.parametrize(
    ("gpus", "overrides", "ddp"),
    [
        (0, ["trainer.accelerator=cpu", "trainer.devices=2"], True),
        (4, ["trainer.devices=-1"], True),
        (0, ["trainer.accelerator=cpu", "trainer.num_nodes=2"], True),
        (4, ["trainer.accelerator=cpu", "trainer.devices=auto"], False),  # one CPU process
        (4, [], False),
        (0, ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=ddp"], False),
    ],
)
def test_strategy_auto_given_several_devices_is_the_ddp_groups(monkeypatch, gpus, overrides, ddp):
    """Lightning's own DDPStrategy reran the script outside the Hydra job: each rank wrote a
    log file of its own, and a sweep was refused."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    launched_by(monkeypatch, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "0"})
    cfg = config(*overrides)
    given = cfg.trainer.strategy
    check_launch(cfg)
    if ddp:
        assert cfg.trainer.strategy == {"_target_": "navit_lightning.strategies.HydraDDPStrategy"}
        assert isinstance(hydra.utils.instantiate(cfg.trainer.strategy), HydraDDPStrategy)
    else:
        assert cfg.trainer.strategy == given


def test_a_cpu_run_on_a_gpu_host_is_one_device_to_sweeps_and_launchers(monkeypatch):
    """trainer.devices=auto on CPU is one process, however many GPUs are visible."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    on_cpu = ["trainer.accelerator=cpu", "trainer.devices=auto"]
    monkeypatch.setattr(validate, "in_sweep", lambda: True)
    check_launch(config(*on_cpu, "trainer.strategy=ddp"))
    monkeypatch.setattr(validate, "in_sweep", lambda: False)
    launched_by(monkeypatch, TORCHRUN | {"WORLD_SIZE": "1"})
    check_launch(config(*on_cpu, "strategy=ddp"))


def test_a_sweep_of_several_processes_under_torchrun_is_refused(monkeypatch):
    """Its second job's ranks met over torchrun's store of the first job and hung or failed;
    one process has nothing to meet."""
    monkeypatch.setattr(validate, "in_sweep", lambda: True)
    launched_by(monkeypatch, TORCHRUN | {"WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match=r"a sweep \(-m\) under torchrun"):
        validate.check_sweep_launch(config("strategy=ddp", "trainer.devices=2").trainer, 1)
    launched_by(monkeypatch, TORCHRUN | {"WORLD_SIZE": "1"})
    validate.check_sweep_launch(config().trainer, 1)


@pytest.mark.parametrize(("task", "given"), [("eval", []), ("predict", ["input=images"])])
@pytest.mark.parametrize("attention", ["auto", None], ids=["auto", "a checkpoint from before the setting"])
def test_eval_and_predict_take_seed_null(tmp_path, task, given, attention):
    """They plan no training epochs: seed=null has Lightning draw one, as it did."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(task, overrides=[f"ckpt_path={saved_run(tmp_path, attention)}", *given, "seed=null"])
    check_launch(cfg, training=False)
    validate.check_run_attention(cfg, checkpoints.load_training_run(cfg.ckpt_path)[0])


@pytest.mark.parametrize(
    ("launcher", "refused"),
    [
        ({}, True),
        ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "1"}, False),
        (TORCHRUN | {"WORLD_SIZE": "8"}, False),
        (SRUN | {"SLURM_NTASKS": "8"}, False),
    ],
    ids=["none", "by hand", "torchrun", "slurm"],
)
def test_nodes_without_a_meeting_point_are_refused(monkeypatch, launcher, refused):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    launched_by(monkeypatch, launcher)
    cfg = config("strategy=ddp", "trainer.devices=4", "trainer.num_nodes=2")
    if refused:
        with pytest.raises(
            ConfigError, match=r"num_nodes=2 but no launcher \(torchrun, SLURM\) and no MASTER_ADDR"
        ):
            check_launch(cfg)
    else:
        check_launch(cfg)


@pytest.mark.parametrize(("amx", "avx512_bf16"), [(False, False), (True, False), (False, True)])
def test_bf16_on_a_cpu_without_bf16_instructions_is_warned_about(monkeypatch, recwarn, amx, avx512_bf16):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    check_launch(config("trainer.precision=bf16-mixed"))
    check_launch(config())
    slow = [w for w in recwarn if "on a CPU without bf16 instructions" in str(w.message)]
    assert len(slow) == (0 if amx or avx512_bf16 else 1)
    assert slow == [] or "trainer.precision=32-true is likely faster here" in str(slow[0].message)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.rows=0"], "data.rows=0 must be a whole number above 0"),
        (["data.rows=1.5"], "data.rows=1.5 must be a whole number above 0"),
        (["data.num_workers=-1"], "data.num_workers=-1 must be 0 (load in this process) or more"),
        (["data.val_fraction=1"], "data.val_fraction=1 is the share of images held out: 0 < it < 1"),
        (["data.hflip=2"], "data.hflip=2 is a probability: 0 <= it <= 1"),
        (["data.min_patches=40"], "data.min_patches=40 must be between 1 and data.max_patches=36"),
        (["data.generate.num_train=abc"], "data.generate.num_train=abc must be a whole number above 0"),
        (["data.generate.num_val=5"], "data.generate.num_val=5 must be at least 6: an image of each class"),
        (["data.generate.min_side=300"], "data.generate.min_side=300 must not be above max_side=192"),
        (
            ["data.generate.max_aspect=0.5"],
            "data.generate.max_aspect=0.5 must be 1 or above (2 allows 2:1 and 1:2)",
        ),
        (["data.generate.seed=1.5"], "data.generate.seed=1.5 must be a whole number"),
        (["model.net.heads=0"], "model.net.heads=0 must be a whole number above 0"),
        (["model.net.mlp_ratio=0"], "model.net.mlp_ratio=0 must be a number above 0"),
        (["model.net.mlp_ratio=abc"], "model.net.mlp_ratio=abc must be a number above 0"),
        (["model.net.pool=max"], "model.net.pool='max' is unknown: use one of ['attention', 'mean']"),
        (["trainer.num_nodes=0"], "trainer: `num_nodes` must be a positive integer, but got 0."),
        (["+trainer.epochs=3"], "trainer: Trainer.__init__() got an unexpected keyword argument 'epochs'"),
        (["model.net.depth=2.5"], "model.net.depth=2.5 must be a whole number above 0"),
        (["+model.net.dpeth=2"], "model.net: NaViT.__init__() got an unexpected keyword argument 'dpeth'"),
        (  # a config of one's own in Hydra's form, as for anything else it builds
            ["optimizer._partial_=false"],
            "optimizer: AdamW.__init__() missing 1 required positional argument: 'params': add "
            "`_partial_: true` to its config, the model passes its parameters when it builds it",
        ),
        (
            ["model.net._target_=navit_lightning.models.NaVit"],
            "model.net._target_=navit_lightning.models.NaVit cannot be imported: ModuleNotFoundError("
            "\"No module named 'navit_lightning.models.NaVit'\"); Are you sure that 'NaVit' is "
            "importable from module 'navit_lightning.models'?",
        ),
        (
            ["data._target_=my_project.Data"],
            'data._target_=my_project.Data cannot be imported: ModuleNotFoundError("No module named '
            "'my_project'\"); Are you sure that module 'my_project' is installed?",
        ),
        (
            ["callbacks.resume_checkpoint.every_n_train_steps=500"],
            "callbacks.resume_checkpoint: Combination of parameters every_n_train_steps=500, "
            "every_n_epochs=0 and train_time_interval=0:10:00 should be mutually exclusive.",
        ),
    ],
)
def test_a_constructor_refusing_a_setting_says_which_in_one_line(overrides, message, tmp_path):
    """What the data module, the network and Lightning's Trainer refuse when train.py builds
    them, before any other process starts: the entry points print refusal()'s line."""
    group = overrides[0].lstrip("+").split(".")[0]
    cfg = config(*overrides, f"paths.output_dir={tmp_path}")
    node = {"model": cfg.model.net, "callbacks": cfg.callbacks.resume_checkpoint}.get(group, cfg[group])
    with pytest.raises(InstantiationException) as raised:
        hydra.utils.instantiate(node)
    assert refusal(raised.value) == message


def test_a_constructor_failing_otherwise_keeps_its_traceback():
    with pytest.raises(InstantiationException) as raised:
        hydra.utils.instantiate(
            {"_target_": "navit_lightning.models.pos_embed.FactorizedPosEmbed", "dim": "oops", "max_grid": 4}
        )
    assert refusal(raised.value) is None


def test_a_setting_lightning_refuses_when_the_fit_starts_says_which_in_one_line(tmp_path):
    """Lightning checks val_check_interval against the batches of an epoch inside the fit; an
    error of the same form from other code keeps its traceback."""
    trainer = bare_trainer(val_check_interval=1000, default_root_dir=tmp_path)
    with pytest.raises(ValueError) as raised:
        trainer.fit(BoringModel())
    assert refusal(raised.value).startswith(
        "trainer.val_check_interval: `val_check_interval` (1000) must be less than or equal to the number "
        "of the training batches (64)."
    )
    with pytest.raises(ValueError) as ours:
        raise ValueError("`val_check_interval` (1000) is not Lightning's")
    assert refusal(ours.value) is None
    # named further on (a traceback, as a fraction under one batch was)
    with pytest.raises(MisconfigurationException) as fraction:
        bare_trainer(limit_train_batches=0.001, default_root_dir=tmp_path).fit(BoringModel())
    assert refusal(fraction.value).startswith(
        "trainer.limit_train_batches: You requested to check 0.001 of the `train_dataloader` but "
        "0.001 * 64 < 1"
    )
    # a resume whose checkpoint is past trainer.max_epochs (in Hydra's error, exit 1)
    trainer = bare_trainer(
        max_epochs=2, limit_train_batches=2, limit_val_batches=0, default_root_dir=tmp_path
    )
    trainer.fit(BoringModel())
    trainer.save_checkpoint(tmp_path / "done.ckpt")
    with pytest.raises(MisconfigurationException) as past:
        bare_trainer(max_epochs=1, default_root_dir=tmp_path).fit(
            BoringModel(), ckpt_path=tmp_path / "done.ckpt"
        )
    assert refusal(past.value).startswith(
        "trainer.max_epochs: You restored a checkpoint with current_epoch=2, but you have set "
        "Trainer(max_epochs=1)."
    )


def test_lightning_refusing_a_trainer_argument_by_misconfiguration_is_one_line_and_no_other_name_is():
    """Lightning raises MisconfigurationException as well as ValueError for a Trainer argument;
    a name in backquotes that no Trainer argument has (a hook) keeps its traceback."""
    from lightning.pytorch.core.hooks import DataHooks
    from lightning.pytorch.loops.fit_loop import _FitLoop

    with pytest.raises(MisconfigurationException) as raised:
        _FitLoop(None, max_epochs=-2)
    assert refusal(raised.value) == (
        "trainer.max_epochs: `max_epochs` must be a non-negative integer or -1. You passed in -2."
    )
    with pytest.raises(MisconfigurationException) as hook:
        DataHooks().train_dataloader()
    assert refusal(hook.value) is None


def test_a_ddp_spawn_ranks_refusal_reaches_the_launching_process_as_its_line():
    """torch sends the launching process a spawned rank's error as its traceback's text."""
    try:
        raise ConfigError("trainer.val_check_interval: past the batches")
    except ConfigError:
        sent = traceback.format_exc()
    assert refusal(ProcessRaisedException(sent, 1, 123)) == "trainer.val_check_interval: past the batches"
    other = sent.replace("navit_lightning.errors.ConfigError", "RuntimeError")
    assert refusal(ProcessRaisedException(other, 1, 123)) is None


@pytest.mark.parametrize(
    ("arguments", "refused"),
    [
        (["-m", "seed=1,2", "--cfg", "job"], "--multirun with --cfg"),
        (["-mc", "job"], "--multirun with --cfg"),  # as argparse reads them
        (["--multi", "seed=1,2", "--info=config"], "--multirun with --info"),
        (["-c", "hydra", "-i"], "--cfg with --info"),
        (["--cfg", "job", "seed=1"], None),
        (["-m", "seed=1,2", "hydra/launcher=slurm"], None),
        (["-cn", "eval", "--config-dir", "mine", "-m", "data.root=/x/-m"], None),  # Hydra's other short flags
        (["-m", "--cfg", "job", "--help"], None),  # Hydra answers --help first
    ],
)
def test_two_of_hydras_modes_in_one_command_are_refused_in_one_line(capsys, arguments, refused):
    if refused:
        with pytest.raises(SystemExit) as exit_:
            refuse_two_modes(arguments)
        assert exit_.value.code == 2
        said = capsys.readouterr().err
        assert said.startswith(f"error: {refused}: Hydra does one of them per command")
        assert ("drop -m" in said) == ("multirun" in refused)
    else:
        refuse_two_modes(arguments)
        assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("arguments", "refused"),
    [
        (["logger=null"], True),
        (["model=null"], True),
        (["seed=1", "callbacks=null"], True),
        (["+logger=null"], True),
        (["ckpt_path=null"], False),
        (["patch_budgets=null", "data.num_workers=null"], False),
        (["model.scheduler=null", "callbacks.pictures=null"], False),
        (["hydra/launcher=null"], False),
        (["logger=tensorboard"], False),
    ],
)
def test_null_is_refused_for_a_config_group_and_taken_for_a_setting(capsys, arguments, refused):
    """A group set to null ends in Hydra's traceback, and is refused in one line naming
    ~group; a setting set to null (patch_budgets=null, callbacks.pictures=null: the README's
    own switches, model.scheduler=null for a constant rate) must reach Hydra untouched."""
    if refused:
        with pytest.raises(SystemExit) as exit_:
            refuse_null_groups(arguments)
        assert exit_.value.code == 2
        group = arguments[-1].split("=")[0].lstrip("+")
        assert f"Hydra cannot set a config group to null; ~{group} removes it" in capsys.readouterr().err
    else:
        refuse_null_groups(arguments)
        assert capsys.readouterr().err == ""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.precision=16-mixed"], "trainer.precision=16-mixed needs a CUDA GPU"),
        (["trainer.precision=bogus"], "trainer: Precision 'bogus' is invalid. Allowed precision values"),
        (["logger=null"], "logger=null: Hydra cannot set a config group to null; ~logger removes it"),
        # Hydra's advice for ckpt_pth=last: the run trained from scratch, exit code 0
        (["+ckpt_pth=last"], "+ckpt_pth=last adds a setting that nothing reads (did you mean ckpt_path?)"),
        (["model.compile=off"], "model.compile=off must be true or false"),
        (["data.max_patches=200"], "data.max_patches=200 exceeds data.row_len=144"),
        (["model.head=mlp"], "model.head='mlp' is unknown: use one of ['bn_mlp', 'linear']"),
        (["model.net.attention=dense"], "model.net.attention='dense' is unknown"),
        (["data.multiprocessing_context=forx"], "data.multiprocessing_context='forx' is unknown: use one of"),
        # a folder of the user's own (here the project root) given to the built-in set: it was
        # refused where the set is written, after the config was printed and the ranks started
        (["data.root=${paths.root_dir}"], "holds files that the built-in data set did not write: to train"),
        (
            ["callbacks=early_stopping", "callbacks.early_stopping.monitor=val/accc"],
            "callbacks.early_stopping.monitor=val/accc is not a metric the model logs: use one of train/acc",
        ),
    ],
)
def test_refusal_is_one_line_and_exit_code_2(run_entry_point, overrides, message):
    """One refusal of each kind (checked before the launch, by a constructor, by Hydra, by
    the monitor check) as train.py prints it; test_refused and the in-process tests above
    check each setting's own."""
    # as a machine without a GPU sees them, also where the suite runs on one
    result = run_entry_point("train.py", *overrides, check=False, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2
    lines = (result.stdout + result.stderr).splitlines()
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and message in errors[0], errors
    assert lines == errors  # Lightning's "Seed set to 42" came before the line of some


@pytest.mark.parametrize(
    ("monitor", "mode", "refusal"),
    [
        ("val/loss", "max", "callbacks.model_checkpoint.monitor=val/loss with mode=max takes the highest"),
        ("val/acc", "min", "takes the lowest as the best: add callbacks.model_checkpoint.mode=max"),
        ("val/loss", None, None),  # Lightning's default mode, min
        ("val/acc", "max", None),
        ("train/images_per_batch", "min", None),  # no better way that the name tells
    ],
)
def test_a_monitor_whose_mode_takes_the_worst_as_the_best_is_refused(monitor, mode, refusal):
    """monitor=val/loss alone kept the configs' mode: max: the run tested its worst
    checkpoint, and early stopping stopped a run whose loss was falling."""
    checkpoint = {"monitor": monitor} | ({"mode": mode} if mode else {})
    callbacks = OmegaConf.create({"model_checkpoint": checkpoint, "learning_rate_monitor": None})  # null: off
    monitorable = {"val/loss", "val/acc", "train/images_per_batch"}
    if refusal is None:
        check_monitors(callbacks, monitorable)
        return
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        check_monitors(callbacks, monitorable)


@pytest.mark.parametrize(("monitor", "refused"), [("val/acc", True), ("train/acc", False)])
def test_an_early_stop_on_validation_in_a_run_without_validation_is_refused(monitor, refused):
    """It never checked, and the run trained to its end without a word."""
    stop = {"_target_": "navit_lightning.utils.callbacks.StopEarly", "monitor": monitor, "mode": "max"}
    callbacks = OmegaConf.create({"early_stopping": stop})
    check_monitors(callbacks, {"val/acc", "train/acc"})
    if not refused:  # checked at each training epoch's end
        check_monitors(callbacks, {"val/acc", "train/acc"}, validates=False)
        return
    with pytest.raises(
        ConfigError, match=re.escape(f"callbacks.early_stopping.monitor={monitor} is never checked")
    ):
        check_monitors(callbacks, {"val/acc", "train/acc"}, validates=False)


@pytest.mark.slow
def test_a_setting_refused_in_ddp_spawns_ranks_is_one_line_and_exit_code_2(run_entry_point):
    """Lightning checks val_check_interval in the ranks, which ddp_spawn's launching process
    heard of as a traceback; and no rank warns of a save lost before the first step."""
    spawned = ["strategy=ddp_spawn", "trainer.accelerator=cpu", "trainer.devices=2"]
    result = run_entry_point("train.py", *TINY_RUN, "trainer.val_check_interval=1000", *spawned, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1 and "trainer.val_check_interval: `val_check_interval` (1000) must be" in errors[0]
    assert "Traceback" not in output and "not saved" not in output, output[-3000:]


@pytest.mark.slow
def test_an_unknown_strategy_option_is_refused_with_the_options(run_entry_point):
    result = run_entry_point("train.py", "strategy=foo", check=False)
    assert result.returncode != 0
    assert "Could not find 'strategy/foo'" in result.stderr and "ddp_spawn" in result.stderr


class PlainModule(L.LightningModule):
    """A module of one's own that is no NaViTClassifier, taking the model config's settings."""

    def __init__(self, **settings: object) -> None:
        super().__init__()


class DataWithoutNames(L.LightningDataModule):
    """A datamodule of one's own that counts its classes but does not name them."""

    def __init__(self, **settings: object) -> None:
        super().__init__()
        self.num_classes = 6


def test_a_datamodule_is_built_without_reading_its_data(tmp_path):
    """Its num_classes lists the data folder: looked for with hasattr, a predict.py on a
    machine without the checkpoint's training data was refused for the folder."""
    gone = {
        "_target_": "navit_lightning.data.datamodule.PackedImageDataModule",
        "root": str(tmp_path / "gone"),
    }
    assert isinstance(instantiate_datamodule(OmegaConf.create(gone)), PackedImageDataModule)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [f"model._target_={__name__}.PlainModule"],
            f"model._target_={__name__}.PlainModule is no NaViTClassifier: the callbacks and the "
            "end-of-fit sweep read what it keeps",
        ),
        (
            [f"data._target_={__name__}.DataWithoutNames"],
            f"data._target_={__name__}.DataWithoutNames has no class_names: a datamodule gives the "
            "number of classes (num_classes) and their names (class_names(), a list)",
        ),
    ],
)
def test_a_module_of_ones_own_is_refused_where_it_lacks_what_the_entry_points_read(
    tmp_path, project_root, overrides, message
):
    """They failed with a traceback where they were first read: a datamodule's class names
    at the build, a module's batch counts in the callbacks after the first step."""
    cfg = compose_train([*TINY_RUN, *overrides], tmp_path, project_root)
    with open_dict(cfg):
        del cfg.hydra  # as a run's config holds none
    with pytest.raises(ConfigError, match=re.escape(message)):
        build(cfg)
