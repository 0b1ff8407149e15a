"""Checks of the composed config that refuse, before any process starts, what would
otherwise fail deep inside Lightning or torch (or silently do something else)."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import hydra
import torch
from lightning.fabric.plugins.environments import (
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from navit_lightning import config_options
from navit_lightning.errors import ConfigError, is_count, is_number, is_whole, require_counts
from navit_lightning.utils.checkpoints import (
    CKPT_PATH_EXAMPLE,
    LIGHTNING_CKPT_NAMES,
    read_checkpoint,
)
from navit_lightning.utils.instantiate import dotted_settings
from navit_lightning.utils.launch import in_sweep, srun_tasks
from navit_lightning.utils.schedules import check_lr_scaling

GPU_ACCELERATORS = {"gpu", "cuda"}
# Lightning turns 16-mixed into bf16-mixed on CPU with only a warning; Transformer Engine's
# failed in the Trainer's constructor, advising to install a CUDA-only package.
GPU_ONLY_PRECISIONS = {"16-mixed", "16", "transformer-engine", "transformer-engine-float16"}
HALF_PRECISIONS = {"bf16-mixed", "16-mixed", "bf16-true", "16-true", "bf16", "16"}
# Lightning reads the bare "bf16" and "16" as their -mixed forms.
MIXED_PRECISIONS = {"bf16-mixed", "16-mixed", "bf16", "16"}
DP_TARGET = "navit_lightning.strategies.PackedDataParallelStrategy"
# strategy=ddp's (its settings are the class's defaults)
HYDRA_DDP_TARGET = "navit_lightning.strategies.HydraDDPStrategy"
# Lightning's callbacks that log, and end a fit without a logger in a traceback
CALLBACKS_NEEDING_A_LOGGER = (".LearningRateMonitor", ".DeviceStatsMonitor")
# What the configs leave as ??? for the command line to fill in, with an example value.
REQUIRED_EXAMPLES = {
    "data.root": "/path/to/images",
    "ckpt_path": CKPT_PATH_EXAMPLE,
    "input": "<an image file or a folder of images>",
}
# A setting every option of a config group writes, and only that group
GROUP_MARKS = {"trainer": "_target_", "model": "_target_", "data": "_target_", "paths": "output_dir"}
# The largest seed numpy's generators take (Lightning's seed_everything checks the same).
MAX_SEED = 2**32 - 1
# The launchers Lightning detects and takes the nodes' meeting point from (its cluster
# environments; Kubeflow's sets MASTER_ADDR).
NODE_LAUNCHERS = (
    SLURMEnvironment,
    TorchElasticEnvironment,
    LSFEnvironment,
    MPIEnvironment,
)


def check_launch(cfg: DictConfig, training: bool = True) -> None:
    """Refuses, in one line each, a config that this machine cannot run or that would fail (or
    train wrongly) once its processes have started; and settles the strategy: strategy=auto
    given several devices becomes strategy=ddp's. training=False (eval.py, predict.py): the
    model, and so its attention backend, comes from the checkpoint, which they read once after
    this (check_run_attention)."""
    check_groups_kept(cfg, ("trainer", "paths", "model", "data") if training else ("trainer", "paths"))
    check_required(cfg)
    for group, fix in (
        ("optimizer", "choose one: optimizer=adamw"),
        ("scheduler", "for a constant rate use model.scheduler=null"),
    ):
        if training and group not in cfg and OmegaConf.is_interpolation(cfg.model, group):
            raise ConfigError(f"~{group} removed the config model.{group} follows (${{{group}}}): {fix}")
    if training:
        check_seed(cfg.get("seed"))
    trainer = cfg.trainer
    check_trainer_types(trainer)
    if "strategy" not in trainer:  # ~strategy: Lightning's default
        with open_dict(trainer):
            trainer.strategy = "auto"
    check_strategy_name(trainer.strategy)
    gpus = torch.cuda.device_count()
    accelerator = str(trainer.accelerator)
    if accelerator in GPU_ACCELERATORS and gpus == 0:
        raise ConfigError(
            f"trainer.accelerator={accelerator} but no CUDA GPU is visible: use trainer.accelerator=cpu"
        )
    on_gpu = runs_on_gpu(trainer)
    visible_devices = gpus if on_gpu else 1  # what devices=-1 or auto takes
    if trainer.strategy == "auto" and device_count(trainer.devices, visible_devices) * trainer.num_nodes > 1:
        # Lightning's choice would be its own DDPStrategy, whose ranks 1.. rerun the script
        # outside this Hydra job: a log file of each rank's, the whole sweep in each under -m
        with open_dict(trainer):
            trainer.strategy = {"_target_": HYDRA_DDP_TARGET}
    devices = trainer.devices
    if on_gpu and isinstance(devices, int) and devices > gpus:
        raise ConfigError(
            f"trainer.devices={devices} but {gpus} CUDA GPU(s) are visible: "
            f"use trainer.devices={gpus} (or -1 for all of them)"
        )
    if not on_gpu and str(trainer.precision) in GPU_ONLY_PRECISIONS:
        raise ConfigError(
            f"trainer.precision={trainer.precision} needs a CUDA GPU: on CPU use trainer.precision=bf16-mixed"
        )
    if not on_gpu and trainer.sync_batchnorm:
        raise ConfigError(
            "trainer.sync_batchnorm=true needs CUDA GPUs (torch's SyncBatchNorm runs on GPU only): "
            "drop it on CPU, where ddp ranks keep their own BatchNorm statistics"
        )
    if not on_gpu and str(trainer.precision).startswith("bf16") and not cpu_has_bf16_instructions():
        rank_zero_warn(
            f"trainer.precision={trainer.precision} on a CPU without bf16 instructions (AMX or "
            "AVX512-BF16): bf16 matmuls ran at 0.23x the speed of float32 on such a CPU "
            "(docs/benchmarks.md), so trainer.precision=32-true is likely faster here"
        )
    if is_dp(trainer.strategy):
        check_dp(cfg, on_gpu)
    check_sweep_launch(trainer, visible_devices)
    check_nodes_can_meet(trainer.num_nodes)
    check_launched_processes(trainer, visible_devices)
    if trainer.get("reload_dataloaders_every_n_epochs", 1) != 1:
        raise ConfigError(
            f"trainer.reload_dataloaders_every_n_epochs={trainer.reload_dataloaders_every_n_epochs}: "
            "an epoch's packed batches vary in number and Lightning counts them when it builds the "
            "loader, so it must rebuild it every epoch: keep 1"
        )
    if trainer.get("use_distributed_sampler"):  # under ddp every rank failed in a traceback
        raise ConfigError(
            "trainer.use_distributed_sampler=true: the data module's batch sampler shares every "
            "epoch among the ranks itself, and Lightning cannot wrap it in its own; keep false"
        )
    check_patch_budgets(cfg.get("patch_budgets"))
    if training:
        check_training_numbers(trainer)
        check_optimization(cfg.model)
        check_fused_optimizer(cfg)
        # NaViT's default where a model config of one's own leaves it out
        check_attention(cfg.model.net.get("attention", "auto"), on_gpu, str(trainer.precision))
        check_lr_scaling(cfg.model.get("lr_scaling"), cfg.model.get("lr_reference_tokens", 1))
        # named here: the data module, built first, would name data.patch_size, which follows it
        require_counts("model.net", patch_size=cfg.model.net.patch_size)
        if cfg.data.get("patch_size", cfg.model.net.patch_size) != cfg.model.net.patch_size:
            raise ConfigError(
                f"data.patch_size={cfg.data.patch_size} but model.net.patch_size={cfg.model.net.patch_size}: "
                "the data's patches are the network's; set model.net.patch_size alone"
            )
        if cfg.model.net.get("channels", 3) != 3:
            raise ConfigError(
                f"model.net.channels={cfg.model.net.channels}: the data module gives RGB patches "
                "(grey images too are converted to RGB); keep 3"
            )
        check_callbacks(cfg)
        check_starting_point(cfg, trainer)


def check_callbacks(cfg: DictConfig) -> None:
    """What a fit's callbacks would fail on, or leave out of its checkpoints."""
    callbacks = {name: callback for name, callback in (cfg.get("callbacks") or {}).items() if callback}
    if weights_only := [name for name, callback in callbacks.items() if callback.get("save_weights_only")]:
        # Lightning calls no callback's on_save_checkpoint for them
        raise ConfigError(
            f"callbacks.{weights_only[0]}.save_weights_only=true: Lightning leaves the callbacks' "
            "part out of such a checkpoint, the run's config and class names that eval.py, "
            "predict.py and init_from read (and callbacks=ema's average): keep it false"
        )
    logging_callbacks = [
        name
        for name, callback in callbacks.items()
        if str(callback.get("_target_")).endswith(CALLBACKS_NEEDING_A_LOGGER)
    ]
    if not cfg.get("logger") and logging_callbacks:
        # Lightning's fail at the start of fit without a logger, in a traceback
        raise ConfigError(
            f"callbacks.{logging_callbacks[0]} needs a logger and the config has none (~logger, "
            f"debug=fdr): add callbacks.{logging_callbacks[0]}=null, or keep logger=tensorboard"
        )


def check_starting_point(cfg: DictConfig, trainer: DictConfig) -> None:
    """What the fit starts from (a checkpoint to resume or to test, init_from's weights) and
    whether it has anything to train, and to test."""
    ckpt_path, fitting = cfg.get("ckpt_path"), cfg.get("train", True)
    # Lightning skips the fit, and the run exited 0, testing its untrained weights (a run
    # from a checkpoint's weights may have nothing left to train: its epoch is past them)
    from_weights = ckpt_path is not None or cfg.get("init_from") is not None
    untrained = [
        f"trainer.{name}={trainer[name]}"
        for name in ("limit_train_batches", "max_epochs", "max_steps")
        if trainer.get(name) == 0 and (name == "limit_train_batches" or not from_weights)
    ]
    if fitting and untrained:
        raise ConfigError(
            f"{untrained[0]} trains no batch (Lightning skips the fit): leave it out, or test a "
            f"checkpoint with train=false ckpt_path={CKPT_PATH_EXAMPLE} (or eval.py)"
        )
    if cfg.get("test") and trainer.get("limit_test_batches") == 0:  # Lightning skipped the test, exit 0
        raise ConfigError(
            "trainer.limit_test_batches=0 tests no batch: leave it out, or test=false to skip the test"
        )
    if not fitting and ckpt_path is None:
        raise ConfigError(
            f"train=false tests a checkpoint, the network's weights would be its initial ones: "
            f"give ckpt_path={CKPT_PATH_EXAMPLE} (or use eval.py)"
        )
    if ckpt_path is not None and ckpt_path not in LIGHTNING_CKPT_NAMES:
        read_checkpoint(ckpt_path)
    if fitting and trainer.get("fast_dev_run") and ckpt_path is not None:
        # Lightning's fast_dev_run ends the fit at epoch 1 and at step fast_dev_run: a
        # checkpoint past them was refused naming trainer.max_epochs, never set
        weights = CKPT_PATH_EXAMPLE if ckpt_path in LIGHTNING_CKPT_NAMES else ckpt_path
        raise ConfigError(
            f"trainer.fast_dev_run={trainer.fast_dev_run} (debug=fdr) runs a few batches of each "
            f"stage and resumes no ckpt_path={ckpt_path}: start from its weights with "
            f"init_from={weights}, or drop debug=fdr"
        )
    if cfg.get("init_from") is not None:
        read_checkpoint(cfg.init_from, key="init_from")


def check_groups_kept(cfg: DictConfig, groups: Sequence[str]) -> None:
    """`~trainer` or `~paths` ended in a traceback about the first setting read from it. A
    removed group is told by a setting each of its options writes: the strategy group still
    writes trainer.strategy into a removed trainer."""
    for group in groups:
        if GROUP_MARKS[group] not in cfg.get(group, {}):
            options = config_options(group)
            choice = options[0] if len(options) == 1 else f"<one of {', '.join(options)}>"
            raise ConfigError(f"~{group} removed a config every run needs: choose {group}={choice}")


def check_required(cfg: DictConfig) -> None:
    """Names every ??? left unset in one line, where OmegaConf would raise a traceback about
    the first one when it is read (data=imagefolder without data.root, eval.py without
    ckpt_path). The container keeps interpolations unresolved: they may need Hydra's runtime,
    which a composed config lacks."""
    settings = dotted_settings(OmegaConf.to_container(cfg))
    missing = sorted(key for key, value in settings.items() if value == MISSING)
    if missing:
        examples = " ".join(f"{key}={REQUIRED_EXAMPLES.get(key, '<value>')}" for key in missing)
        raise ConfigError(f"{' and '.join(missing)} must be set: add {examples} to the command")


def cpu_has_bf16_instructions() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX tiles or AVX512-BF16), as torch's own
    private probes tell; True where they are missing."""
    probes = (
        getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    )
    return any(probe is None or probe() for probe in probes)


def check_seed(seed: object) -> None:
    """Every rank plans the same epochs from the seed (the data's is the run's): seed=null
    left the data's unset (a traceback in the sampler), and would draw one per process under
    torchrun or srun; Lightning refuses what numpy cannot take, with a traceback."""
    if not is_whole(seed) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(
            f"seed={'null' if seed is None else seed} must be a whole number from 0 to {MAX_SEED}: "
            "every rank plans the same batches from it (another number gives other draws)"
        )


def check_trainer_types(trainer: DictConfig) -> None:
    """Trainer settings that Lightning's constructor takes unchecked and then fails on, mid-fit
    and in every rank (a string compared or divided by: max_epochs=abc, log_every_n_steps=abc),
    or reads as another setting (deterministic=warning: no deterministic algorithms)."""
    require_counts("trainer", num_nodes=trainer.get("num_nodes"))
    devices = trainer.get("devices")
    if not is_devices(devices):
        raise ConfigError(
            f"trainer.devices={devices} must be a count (1 or more), -1 or auto for every device, "
            "or device indices ([0,1] or '0,1')"
        )
    for name in ("max_epochs", "max_steps"):
        value = trainer.get(name)
        if value is not None and not (is_whole(value) and value >= -1):
            raise ConfigError(f"trainer.{name}={value} must be a whole number, or -1 for no limit")
    for stage in ("train", "val", "test", "predict"):
        value = trainer.get(f"limit_{stage}_batches")
        if value is not None and not is_batches(value, least=0):
            raise ConfigError(
                f"trainer.limit_{stage}_batches={value} must be a number of batches (0 or more) "
                "or a share of them (0.0 to 1.0)"
            )
    every = trainer.get("log_every_n_steps")
    if every is not None and not (is_whole(every) and every >= 0):
        raise ConfigError(
            f"trainer.log_every_n_steps={every} must be a whole number of steps (0: no step logs)"
        )
    deterministic = trainer.get("deterministic")
    if not (deterministic is None or isinstance(deterministic, bool) or deterministic == "warn"):
        raise ConfigError(
            f"trainer.deterministic={deterministic} must be true, false or warn (deterministic "
            "algorithms, a warning for an op that has none)"
        )


def is_batches(value: object, least: int) -> bool:
    """A number of batches Lightning takes: a whole number from `least`, or a share of an
    epoch's from 0.0 to 1.0 (Lightning refused a float above 1.0 only after its first lines)."""
    return (is_whole(value) and value >= least) or (is_number(value) and 0.0 <= value <= 1.0)


def is_devices(devices: object) -> bool:
    """A form of trainer.devices that Lightning reads (see device_count)."""
    if devices in ("auto", "-1") or (is_whole(devices) and (devices >= 1 or devices == -1)):
        return True
    if isinstance(devices, str):
        return re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*,?\s*", devices) is not None
    return (
        isinstance(devices, Sequence)
        and len(devices) > 0
        and all(is_whole(index) and index >= 0 for index in devices)
    )


def check_training_numbers(trainer: DictConfig) -> None:
    """What Lightning takes and then fails on mid-fit, in every rank, or trains wrongly with."""
    accumulate = trainer.get("accumulate_grad_batches", 1)
    if not is_count(accumulate):
        raise ConfigError(f"trainer.accumulate_grad_batches={accumulate} must be 1 (no accumulation) or more")
    if str(trainer.precision) == "16-true":
        raise ConfigError(
            "trainer.precision=16-true trains float16 weights without loss scaling (AdamW's eps "
            "underflows: NaN after the first step): use 16-mixed on a GPU, or bf16-mixed"
        )
    every = trainer.get("check_val_every_n_epoch")
    if every is not None and (not isinstance(every, int) or every < 1):
        raise ConfigError(
            f"trainer.check_val_every_n_epoch={every} must be 1 or more (validate every N epochs), "
            "or null with an integer trainer.val_check_interval (every N steps)"
        )
    interval = trainer.get("val_check_interval")
    # a number; Lightning reads a time ("00:00:10:00", a dict) itself. 0 failed in a
    # ZeroDivisionError after the first step.
    if is_number(interval) and not (is_batches(interval, least=1) and interval > 0):
        raise ConfigError(
            f"trainer.val_check_interval={interval} must be a number of training batches (1 or "
            "more: validate every N), a share of an epoch (above 0.0, up to 1.0) or a time (DD:HH:MM:SS)"
        )
    clip = trainer.get("gradient_clip_val")
    if clip is not None and not is_number(clip):
        raise ConfigError(
            f"trainer.gradient_clip_val={clip} must be a number (the largest gradient norm), or null "
            "for no clipping"
        )
    if clip is not None and clip < 0:
        raise ConfigError(
            f"trainer.gradient_clip_val={clip}: a negative bound reverses every gradient; use a "
            "positive one, or null for no clipping"
        )


def check_optimization(model: DictConfig) -> None:
    """Builds the model's optimizer, and its schedule, over a stand-in parameter: what their
    constructors refuse (a negative learning rate, an unknown argument) is refused here,
    rather than in configure_optimizers, by every rank once the fit has begun."""
    if model.get("optimizer") is None:
        return
    with refused_as("optimizer"):
        optimizer = hydra.utils.instantiate(model.optimizer)(params=[torch.nn.Parameter(torch.zeros(1))])
    if model.get("scheduler") is not None:
        with refused_as("scheduler"):
            hydra.utils.instantiate(model.scheduler)(optimizer, 1)


@contextmanager
def refused_as(group: str) -> Iterator[None]:
    """A constructor's refusal of its arguments as a ConfigError that names the config group."""
    try:
        yield
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{group}: {error}") from None


def check_fused_optimizer(cfg: DictConfig) -> None:
    """Lightning's mixed precision refuses to clip the gradients of an optimizer that unscales
    them itself (a fused one), and only at the first step."""
    precision, clip = str(cfg.trainer.precision), cfg.trainer.gradient_clip_val
    optimizer = cfg.model.get("optimizer") or {}  # the model's, which a model config may set itself
    if optimizer.get("fused") and precision in MIXED_PRECISIONS and clip:
        raise ConfigError(
            f"optimizer.fused=true cannot clip gradients under trainer.precision={precision}: "
            "set trainer.gradient_clip_val=null or optimizer.fused=null"
        )


def check_monitors(callbacks: DictConfig | None, monitorable: set[str], validates: bool = True) -> None:
    """A callback that monitors a metric the model never logs fails after the first
    validation, an epoch into the run (Lightning's own check). One whose mode goes the wrong
    way for its metric (the configs' mode: max, kept when the monitor became val/loss) kept
    the worst checkpoint, or stopped a run that was improving, without a word. An early stop
    on a validation metric in a run that validates nothing never checked, silently."""
    for name, settings in (callbacks or {}).items():
        settings = settings or {}  # callbacks.<name>=null: switched off
        monitor = settings.get("monitor")
        if (
            not validates
            and str(monitor).startswith("val/")
            and issubclass(hydra.utils.get_class(settings["_target_"]), EarlyStopping)
        ):
            raise ConfigError(
                f"callbacks.{name}.monitor={monitor} is never checked: trainer.limit_val_batches=0 "
                "runs no validation (drop one of the two)"
            )
        if monitor is not None and monitor not in monitorable:
            raise ConfigError(
                f"callbacks.{name}.monitor={monitor} is not a metric the model logs: "
                f"use one of {', '.join(sorted(monitorable))} (a model of your own names the "
                "metrics it logs in its monitorable_metrics())"
            )
        better = better_direction(monitor) if monitor is not None else None
        mode = settings.get("mode", "min")  # Lightning's default
        if better is not None and mode != better:
            raise ConfigError(
                f"callbacks.{name}.monitor={monitor} with mode={mode} takes the "
                f"{'highest' if mode == 'max' else 'lowest'} as the best: add callbacks.{name}.mode={better}"
            )


def better_direction(metric: str) -> str | None:
    """min for a loss, max for an accuracy; None for a metric of other kinds."""
    name = metric.rsplit("/", 1)[-1]
    return "min" if "loss" in name else "max" if name.startswith("acc") else None


def check_patch_budgets(budgets: object) -> None:
    if budgets is None:
        return
    if not isinstance(budgets, Sequence) or not all(is_count(budget) for budget in budgets):
        raise ConfigError(
            f"patch_budgets={budgets} must be a list of positive patch counts, "
            "e.g. patch_budgets=[9,16,36,64]"
        )
    repeated = sorted(budget for budget, count in Counter(budgets).items() if count > 1)
    if repeated:  # each evaluated twice: two rows of the csv, two points at one step
        raise ConfigError(
            f"patch_budgets={budgets} repeats {', '.join(map(str, repeated))}: give each budget once"
        )


def runs_on_gpu(trainer: DictConfig) -> bool:
    accelerator = str(trainer.accelerator)
    return accelerator in GPU_ACCELERATORS or (accelerator == "auto" and torch.cuda.device_count() > 0)


def check_run_attention(cfg: DictConfig, run: DictConfig) -> None:
    """eval.py's and predict.py's backend, once they have read the checkpoint's training config
    `run`: the run's (one trained on a GPU with varlen), or one given with a +."""
    attention = OmegaConf.select(cfg, "model.net.attention") or OmegaConf.select(
        run,
        "model.net.attention",
        default="auto",  # older checkpoints: none
    )
    check_attention(attention, runs_on_gpu(cfg.trainer), str(cfg.trainer.precision), training=False)


def check_attention(backend: str, on_gpu: bool, precision: str, training: bool = True) -> None:
    """training=False: eval.py's and predict.py's backend, the checkpoint's (a run trained on a
    GPU with varlen), which a `+` changes there; FlexAttention evaluates on CPU."""
    setting = "model.net.attention" if training else "+model.net.attention"
    if backend == "varlen" and not on_gpu:
        raise ConfigError(f"model.net.attention=varlen is flash attention on CUDA: on CPU use {setting}=auto")
    if backend == "varlen" and precision not in HALF_PRECISIONS:
        raise ConfigError(
            f"model.net.attention=varlen needs bf16 or fp16 but trainer.precision={precision}: "
            f"use trainer.precision=bf16-mixed, or {setting}=auto"
        )
    if backend == "flex" and not on_gpu and training:
        raise ConfigError(
            "model.net.attention=flex cannot train on CPU (torch has no FlexAttention backward there): "
            "use model.net.attention=auto"
        )
    if backend == "flex" and not on_gpu and precision.startswith("64"):
        raise ConfigError(
            f"model.net.attention=flex runs no float64 on CPU (trainer.precision={precision}): "
            f"use {setting}=auto"
        )


def check_strategy_name(strategy: object) -> None:
    """A plain trainer.strategy string must be one Lightning knows; the project's own
    strategies (dp, and ddp fixed for Hydra multirun) come from the strategy config group."""
    if not isinstance(strategy, str) or strategy in StrategyRegistry or strategy == "auto":
        return
    options = ", ".join(config_options("strategy"))
    raise ConfigError(f"trainer.strategy={strategy} is unknown: use strategy=<one of {options}>")


def check_sweep_launch(trainer: DictConfig, visible_devices: int) -> None:
    """In a sweep (-m), Lightning's own ddp launcher starts ranks 1.. with the sweep's command:
    each ran the whole sweep again, in folders of its own, and waited for peers that never came
    (Lightning issue 11300). The strategy config group's ddp starts them as the job."""
    if not in_sweep():
        return
    if TorchElasticEnvironment.detect() and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # torchrun's store outlives a job: the next one's ranks met over the last one's keys
        raise ConfigError(
            "a sweep (-m) under torchrun: its second job's ranks could not meet (they hung or "
            "failed); run the sweep without torchrun, with strategy=ddp, which starts each job's ranks"
        )
    strategy = trainer.strategy
    if not isinstance(strategy, str) or any(env.detect() for env in NODE_LAUNCHERS):
        return
    if starts_ranks_in_process(strategy):  # they run the job itself; the others run it as scripts
        return
    if device_count(trainer.devices, visible_devices) > 1 or trainer.num_nodes > 1:
        raise ConfigError(
            f"trainer.strategy={strategy} with trainer.devices={trainer.devices} in a sweep (-m): "
            "Lightning's launcher would start every rank as the whole sweep; use strategy=ddp"
        )


def starts_ranks_in_process(strategy: object) -> bool:
    """ddp_spawn and ddp_fork, Lightning's names or the strategy group's: the processes of the
    ranks start from the training process, not as scripts."""
    if isinstance(strategy, DictConfig):
        settings = strategy
    else:
        settings = StrategyRegistry[strategy]["init_params"] if strategy in StrategyRegistry else {}
    return settings.get("start_method") in ("spawn", "fork")


def device_count(devices: object, visible_devices: int) -> int:
    """How many devices Lightning reads trainer.devices as: a count, -1 or auto (all), a
    list of indices, or a string of either ("2", "0,1"); 1 for what it would refuse itself."""
    if devices in (-1, "-1", "auto"):
        return visible_devices
    if isinstance(devices, str) and "," in devices:
        return len([index for index in devices.split(",") if index.strip()])
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        return len(devices)
    try:
        return int(devices)
    except (TypeError, ValueError):
        return 1


def is_dp(strategy: object) -> bool:
    return isinstance(strategy, DictConfig) and strategy.get("_target_") == DP_TARGET


def check_nodes_can_meet(num_nodes: int) -> None:
    """Nodes started without a launcher meet at MASTER_ADDR, which Lightning takes to be
    127.0.0.1 where it is unset: each node would wait for the others startup_timeout_s (600 s)
    without a word, then end."""
    if num_nodes <= 1 or "MASTER_ADDR" in os.environ or any(env.detect() for env in NODE_LAUNCHERS):
        return
    raise ConfigError(
        f"trainer.num_nodes={num_nodes} but no launcher (torchrun, SLURM) and no MASTER_ADDR tells the "
        "nodes where to meet: start each node under torchrun or srun, or as MASTER_ADDR=<node 0's "
        "address> MASTER_PORT=29500 NODE_RANK=<i> python train.py ... (README: Beyond one machine)"
    )


def check_launched_processes(trainer: DictConfig, visible_devices: int) -> None:
    """Under torchrun and srun the launcher starts the processes and Lightning counts them as
    trainer.devices x trainer.num_nodes: where the two differ, every process ended in a
    traceback of Lightning's, or with one device each trained a whole run into one folder.
    A one-device run in a SLURM job's batch script or salloc shell runs without srun, where
    SLURM_NTASKS is the job's; a run of several devices there waited for ranks srun never
    started. ddp_spawn started its ranks again in every launched process: two groups on one
    store, and a traceback."""
    devices = device_count(trainer.devices, visible_devices)
    if TorchElasticEnvironment.detect():
        started = int(os.environ.get("WORLD_SIZE", 1))
        launched = f"torchrun started {started} process(es)"
        fix = "its --nproc_per_node and trainer.num_nodes its --nnodes"
    elif SLURMEnvironment.detect() and (
        srun_tasks() > 1 or devices * trainer.num_nodes > 1 or trainer.strategy != "auto"
    ):
        started = int(os.environ["SLURM_NTASKS"])
        if started > 1 and not srun_tasks():
            raise ConfigError(
                f"the SLURM job has {started} tasks (SLURM_NTASKS) and this process is none of them: "
                "start the run with srun, srun python train.py ... (scripts/train.sbatch)"
            )
        launched = f"the SLURM job has {started} task(s) (SLURM_NTASKS), one process each under srun"
        fix = "the tasks per node (--ntasks-per-node) and trainer.num_nodes the nodes"
    else:
        return
    if starts_ranks_in_process(trainer.strategy):
        raise ConfigError(
            f"{launched}: strategy=ddp_spawn would start the ranks again in each; use strategy=ddp"
        )
    if devices * trainer.num_nodes != started:
        raise ConfigError(
            f"{launched}, but trainer.devices={trainer.devices} x trainer.num_nodes={trainer.num_nodes} "
            f"makes {devices * trainer.num_nodes}: set trainer.devices to {fix}"
        )


def check_dp(cfg: DictConfig, on_gpu: bool) -> None:
    if not on_gpu:
        raise ConfigError(
            "strategy=dp drives several CUDA GPUs from one process and none is visible: "
            "on CPU use strategy=ddp trainer.accelerator=cpu trainer.devices=N"
        )
    if cfg.trainer.num_nodes > 1:
        raise ConfigError("strategy=dp runs on one machine: for trainer.num_nodes>1 use strategy=ddp")
    if cfg.trainer.sync_batchnorm:
        raise ConfigError(
            "strategy=dp runs the head once over the whole batch, so BatchNorm already sees every "
            "image: drop trainer.sync_batchnorm (it applies to strategy=ddp)"
        )
    if cfg.model.get("compile"):
        raise ConfigError(
            "model.compile=true cannot run under strategy=dp (a compiled network does not replicate): "
            "use strategy=ddp, or model.compile=false"
        )
