"""A Hydra sweeper that runs an Optuna study: `python train.py -m hparams_search=optuna`.

Each trial is one Hydra job whose overrides carry the sampled values, so under strategy=ddp
every rank of a trial (started with that job's overrides, strategies/ddp.py) trains the
same parameters. The study lives in a storage the sweeper alone reads and writes (SQLite in
the sweep folder by default): rerunning the same command continues it, a trial cut short by
a crash is failed and run again, and only the missing trials run. A trial that fails on its
own counts, as in Optuna's own n_trials: a study whose every trial fails ends.

It lives in the `hydra_plugins` package because Hydra instantiates sweepers from there only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from navit_lightning.utils.launch import external_launch_rank

log = logging.getLogger(__name__)


def distribution(override: Override) -> Any:
    """The Optuna distribution of a sweep override in Hydra's syntax (as hydra-optuna-sweeper
    reads it): interval(a, b) [tag(log, ...)], range(a, b[, step]), choice(...)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    sweep = override.value()
    if isinstance(sweep, IntervalSweep):
        log_scale = "log" in sweep.tags
        if isinstance(sweep.start, int) and isinstance(sweep.end, int) and not log_scale:
            return IntDistribution(sweep.start, sweep.end)
        return FloatDistribution(sweep.start, sweep.end, log=log_scale)
    if isinstance(sweep, RangeSweep):
        # the last value range() yields: its stop is excluded, as Python's is
        last = sweep.start + (math.ceil((sweep.stop - sweep.start) / sweep.step) - 1) * sweep.step
        if all(isinstance(value, int) for value in (sweep.start, sweep.stop, sweep.step)):
            return IntDistribution(sweep.start, last, step=sweep.step)
        # 0.8999999999999999 for range(0, 1, step=0.3): Optuna took it for off the steps and
        # dropped 0.9 from the space
        return FloatDistribution(sweep.start, round(last, 12), step=sweep.step)
    if isinstance(sweep, ChoiceSweep):
        return CategoricalDistribution(sweep.list)
    raise ValueError(
        f"hydra.sweeper.params.{override.key_or_group}={override.get_value_element_as_str()} is not a search "
        "space: use interval(a, b), tag(log, interval(a, b)), range(a, b, step=s) or choice(a, b)"
    )


# The study's record of the trials a crash cut short: failed, but not counted in n_trials.
CUT_SHORT = "cut_short_trials"
# In a study's folder: the name of the study whose trials it holds.
STUDY_OF_FOLDER = ".optuna_study"


def claim_folder(sweep_dir: Path, study_name: str) -> None:
    """Trial folders are numbered by trial (<sweep_dir>/<n>): a second study in a folder
    pinned with hydra.sweep.dir wrote its trials over the first one's, and its results file."""
    marker = sweep_dir / STUDY_OF_FOLDER
    if marker.exists() and (owner := marker.read_text()) != study_name:
        log.error(
            f"error: hydra.sweep.dir={sweep_dir} holds the trials of study {owner!r}, which study "
            f"{study_name!r} would write over: give it a folder of its own (another hydra.sweep.dir)"
        )
        raise SystemExit(2)
    marker.write_text(study_name)


def trials_run(study: Any) -> int:
    """The trials that ran to their end, completed or failed: what n_trials counts."""
    finished = sum(trial.state.is_finished() for trial in study.trials)
    return finished - len(study.user_attrs.get(CUT_SHORT, []))


class OptunaSweeper(Sweeper):
    def __init__(
        self,
        study_name: str,
        storage: str | None,
        direction: str,
        n_trials: int,
        n_jobs: int,
        seed: int,
        params: dict[str, str],
    ) -> None:
        self.study_name = study_name
        self.storage = storage
        self.direction = direction
        self.n_trials = n_trials
        self.n_jobs = n_jobs
        self.seed = seed
        self.params = params
        self.launcher: Any = None
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> None:
        import optuna

        if external_launch_rank() is not None:
            # every process of torchrun or srun would run a study of its own (and ask for
            # other parameters than its peers); srun sets no WORLD_SIZE
            log.error(
                "error: hparams_search runs as one process: python train.py -m hparams_search=optuna "
                "strategy=ddp trainer.devices=N (each trial's ranks are started by Lightning), not "
                "under torchrun or srun; on SLURM use hydra/launcher=slurm"
            )
            raise SystemExit(2)

        parser = OverridesParser.create()
        fixed = [o for o in parser.parse_overrides(arguments) if not o.is_sweep_override()]
        if len(fixed) != len(arguments):
            log.error(
                "error: hparams_search=optuna searches hydra.sweeper.params: give the other settings "
                "fixed values, and the search space as "
                "'hydra.sweeper.params={optimizer.lr:\"interval(1e-4,1e-3)\"}'"
            )
            raise SystemExit(2)
        searched = sorted({o.key_or_group for o in fixed} & set(self.params))
        if searched:  # each trial's value would replace it without a word
            log.error(
                f"error: {', '.join(searched)} given and searched by hparams_search: leave it out of the "
                "command, or give the whole space without it (~hydra.sweeper.params "
                "'+hydra.sweeper.params={...}': a space given alone is merged into the config's)"
            )
            raise SystemExit(2)
        try:
            space = {
                o.get_key_element(): distribution(o)
                for o in parser.parse_overrides([f"{key}={value}" for key, value in self.params.items()])
            }
        except ValueError as error:
            log.error(f"error: {error}")
            raise SystemExit(2) from None
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        with self._alone_in(sweep_dir):
            claim_folder(sweep_dir, self.study_name)
            study = optuna.create_study(
                study_name=self.study_name,
                storage=self.storage,
                direction=self.direction,
                load_if_exists=True,
            )
            self._refuse_other_settings(study, fixed)
            # A study continued by a new process: a sampler seeded as the first one was would draw
            # the parameters of its first trials again.
            study.sampler = optuna.samplers.TPESampler(seed=self.seed + len(study.trials))
            self._fail_interrupted(study)
            log.info(
                f"Optuna study {self.study_name!r} in {self.storage}: {trials_run(study)} of {self.n_trials} "
                "trials done"
            )
            while (todo := self.n_trials - trials_run(study)) > 0:
                trials = [study.ask(space) for _ in range(min(self.n_jobs, todo))]
                overrides = [
                    [
                        *(o.input_line for o in fixed),
                        *(f"{key}={value}" for key, value in trial.params.items()),
                    ]
                    for trial in trials
                ]
                results = self.launcher.launch(overrides, initial_job_idx=trials[0].number)
                valueless = [
                    trial.number
                    for trial, result in zip(trials, results, strict=True)
                    if not self._tell(study, trial, result)
                ]
                if valueless:  # every trial would end so: the study would run on without a result
                    log.error(
                        f"error: trial {valueless[0]} ended without optimized_metric="
                        f"{self.config.get('optimized_metric')}: name a metric the run logs, and let each "
                        "trial validate at least once"
                    )
                    raise SystemExit(2)
            self._write_results(study, sweep_dir)

    def _refuse_other_settings(self, study: Any, fixed: list[Override]) -> None:
        """A study continued under another direction, objective or search space ranked the
        trials of both together (and Optuna keeps the direction a study was created with,
        whatever it is given later): refused, once a trial has completed. Other fixed settings
        may change (ckpt_path=last, data.num_workers); those that did are named in a line."""
        settings = {
            "direction": self.direction,
            "optimized_metric": str(self.config.get("optimized_metric")),
            "hydra.sweeper.params": " ".join(f"{key}={value}" for key, value in sorted(self.params.items())),
        }
        given = {o.get_key_element(): o.get_value_element_as_str() for o in fixed}
        completed = any(trial.state.name == "COMPLETE" for trial in study.trials)
        # a study of an earlier version holds no settings: its direction alone is known
        kept = {**study.user_attrs.get("settings", settings), "direction": study.direction.name.lower()}
        if completed and (changed := [key for key, value in settings.items() if kept[key] != value]):
            log.error(
                f"error: study {self.study_name!r} ranks trials by "
                + ", ".join(f"{key}={kept[key]} (now {settings[key]})" for key in changed)
                + ": continue it with the same, or start another with hydra.sweeper.study_name=<name>"
            )
            raise SystemExit(2)
        before = study.user_attrs.get("fixed", given)
        other = sorted(key for key in before.keys() | given.keys() if before.get(key) != given.get(key))
        if completed and other:
            log.info(f"Optuna study {self.study_name!r}: its trials so far ran with other {', '.join(other)}")
        study.set_user_attr("settings", settings)
        study.set_user_attr("fixed", given)

    @contextmanager
    def _alone_in(self, sweep_dir: Path) -> Iterator[None]:
        """The study runs in one process at a time: a second one, started with the same command,
        took the first one's running trials for a crash's and failed them (the first then ended
        in a traceback)."""
        lock = FileLock(sweep_dir / ".study.lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log.error(
                f"error: another process runs a study in {sweep_dir}: wait for it to end, or give this one "
                "a folder of its own (another hydra.sweeper.study_name, or hydra.sweep.dir)"
            )
            raise SystemExit(2) from None
        try:
            yield
        finally:
            lock.release()

    @staticmethod
    def _fail_interrupted(study: Any) -> None:
        """Trials left running by a crashed sweep are failed, and not counted: they are run
        again as new ones."""
        import optuna

        for trial in study.get_trials(deepcopy=False, states=[optuna.trial.TrialState.RUNNING]):
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
            study.set_user_attr(CUT_SHORT, [*study.user_attrs.get(CUT_SHORT, []), trial.number])
            log.warning(
                f"trial {trial.number} was cut short by an earlier crash: counted as failed, a new trial "
                "(parameters drawn afresh) takes its place"
            )

    @staticmethod
    def _tell(study: Any, trial: Any, result: Any) -> bool:
        """Records the trial's value, or its failure; False where it ended without a value."""
        import optuna

        try:
            value = result.return_value  # raises the job's exception
        except Exception as error:
            log.warning(f"trial {trial.number} failed: {error!r}")
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return True
        if value is None:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return False
        study.tell(trial, float(value))
        log.info(f"trial {trial.number}: {float(value):.4f} with {trial.params}")
        return True

    def _write_results(self, study: Any, sweep_dir: Path) -> None:
        if not any(trial.value is not None for trial in study.trials):
            log.error(
                f"error: none of the {len(study.trials)} trials of study {self.study_name!r} completed "
                "(their errors are above)"
            )
            raise SystemExit(1)
        results = {
            "name": "optuna",
            "study_name": self.study_name,
            "direction": study.direction.name.lower(),
            "best_trial": study.best_trial.number,
            "best_params": study.best_params,
            "best_value": study.best_value,
            "trials": [
                {"number": t.number, "state": t.state.name, "value": t.value, "params": t.params}
                for t in study.trials
            ],
        }
        OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
        failed = sum(trial.state.name == "FAIL" for trial in study.trials)
        why = "failed or were cut short: see their folders' train.log"
        log.info(
            f"best {study.best_value:.4f} with {study.best_params}: {sweep_dir / 'optimization_results.yaml'}"
            + (f" ({failed} of {len(study.trials)} trials {why})" if failed else "")
        )
