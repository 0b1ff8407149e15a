"""python train.py -m: a sweep with a refused job; hparams_search=optuna: a study of short
trials, with 2-rank ddp trials, and continued after a crash."""

import logging

import pytest
from omegaconf import OmegaConf

from tests.conftest import DDP_TWO_RANKS, TINY_RUN

pytestmark = pytest.mark.slow

PARAMS = ["optimizer.lr", "optimizer.weight_decay", "scheduler.warmup_steps", "data.min_patches"]


def run_sweep(run_entry_point, *overrides: str):
    """train.py -m `overrides`, a failed job's error shown as Hydra shows it to users."""
    return run_entry_point("train.py", "-m", *overrides, check=False, env={"HYDRA_FULL_ERROR": "0"})


def only_sweep(run_entry_point):
    (folder,) = (run_entry_point.root / "logs" / "train" / "multiruns").iterdir()
    return folder


def study_folder(run_entry_point):
    return run_entry_point.root / "logs" / "train" / "optuna" / "shapes"


def results(run_entry_point) -> dict:
    return OmegaConf.to_container(OmegaConf.load(study_folder(run_entry_point) / "optimization_results.yaml"))


def test_a_refused_job_fails_alone_and_the_sweep_runs_the_others(run_entry_point):
    """A refusal ended the process (SystemExit) at the job: the jobs after it never ran.
    Hydra now records it as failed, runs the rest, and ends naming it, in one line."""
    result = run_sweep(run_entry_point, "optimizer.lr=-1,1e-3", *TINY_RUN, "test=false", "patch_budgets=null")
    assert result.returncode == 1
    assert (result.stdout + result.stderr).count("error: optimizer: Invalid learning rate: -1") == 1
    end = result.stderr.splitlines()
    failed = next(i for i, line in enumerate(end) if line.startswith("Error executing job with overrides:"))
    assert end[failed].startswith("Error executing job with overrides: ['optimizer.lr=-1'")
    assert end[failed + 1] == "optimizer: Invalid learning rate: -1"  # not a traceback
    sweep = only_sweep(run_entry_point)
    assert (sweep / "1" / "checkpoints" / "last.ckpt").is_file()


def test_a_crashed_job_after_a_refused_one_leaves_its_traceback(run_entry_point):
    """Hydra named the sweep's first failed job alone (job 0, refused): job 1's error was
    nowhere, its log ending at "Loading train_dataloader"."""
    result = run_sweep(
        run_entry_point,
        *TINY_RUN,
        "data.rows=0,4",
        "+callbacks.fail._target_=tests.collectives.FailAtTrainStart",
    )
    assert result.returncode == 1 and "error: data.rows=0 must be" in result.stdout + result.stderr
    sweep = only_sweep(run_entry_point)
    log = (sweep / "1" / "train.log").read_text()
    assert "error: this job failed" in log and "ZeroDivisionError: a callback of the user's own failed" in log


def test_a_sweep_of_several_devices_under_strategy_auto_runs_each_job_on_its_ranks(run_entry_point):
    """strategy=auto chose Lightning's ddp launcher: each job's rank 1 ran the whole sweep again
    in folders of its own and waited for peers for good, while the sweep exited 0 (then it was
    refused). It is strategy=ddp's now, whose ranks run the job."""
    result = run_sweep(run_entry_point, "seed=1,2", *TINY_RUN, "trainer.accelerator=cpu", "trainer.devices=2")
    assert result.returncode == 0, result.stderr[-3000:]
    sweep = only_sweep(run_entry_point)  # the ranks started no sweeps of their own
    for job in ("0", "1"):
        assert [path.name for path in (sweep / job).glob("*.log")] == ["train.log"]
        assert "world size 2" in (sweep / job / "train.log").read_text()


def test_a_ddp_job_that_fails_on_its_ranks_fails_alone(run_entry_point):
    """Each rank of job 0 fails at its first batch (position tables too short). Lightning's
    watch over the job's rank 1 outlived the job and killed the sweep's process during job 1."""
    result = run_sweep(
        run_entry_point,
        "model.net.max_grid=2,64",
        *TINY_RUN,
        *DDP_TWO_RANKS,
        "trainer.max_epochs=3",  # job 1 outlasts the watch's 5 s between looks
        "test=false",
        "patch_budgets=null",
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Error executing job with overrides: ['model.net.max_grid=2'" in result.stderr
    sweep = only_sweep(run_entry_point)
    assert (sweep / "1" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize("ranks", [[], DDP_TWO_RANKS], ids=["one", "ddp"])
def test_a_study_writes_the_best_parameters(run_entry_point, ranks):
    run_entry_point(
        "train.py", "-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2", *TINY_RUN, *ranks, timeout=600
    )
    found = results(run_entry_point)
    trials = found["trials"]
    assert [t["state"] for t in trials] == ["COMPLETE"] * 2
    assert found["best_value"] == max(t["value"] for t in trials)
    assert found["best_params"] == trials[found["best_trial"]]["params"]
    for trial in trials:
        job = study_folder(run_entry_point) / str(trial["number"])
        overrides = OmegaConf.load(job / ".hydra" / "overrides.yaml")
        # every job trained the values its trial asked for, and on every rank
        for name in PARAMS:
            assert f"{name}={trial['params'][name]}" in overrides
        log = (job / "train.log").read_text()
        assert f"world size {2 if ranks else 1}" in log
        if ranks:
            assert "training batches per rank: [" in log


def test_the_same_command_continues_a_study_cut_short(run_entry_point):
    import optuna

    # a sweep that crashed during its second trial: one trial done, one left running
    folder = study_folder(run_entry_point)
    folder.mkdir(parents=True)
    study = optuna.create_study(
        study_name="shapes", storage=f"sqlite:///{folder}/optuna.db", direction="maximize"
    )
    study.tell(
        study.ask({"optimizer.lr": optuna.distributions.FloatDistribution(1e-4, 4e-3, log=True)}), 0.25
    )
    study.ask()
    result = run_entry_point("train.py", "-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2", *TINY_RUN)
    assert "trial 1 was cut short by an earlier crash" in result.stdout + result.stderr
    found = results(run_entry_point)
    assert [t["state"] for t in found["trials"]] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert sorted(p.name for p in folder.iterdir() if p.name.isdigit()) == ["2"]  # only the new trial ran

    # Continued again: a sampler seeded as the last process's drew its trials' parameters again.
    run_entry_point("train.py", "-m", "hparams_search=optuna", "hydra.sweeper.n_trials=3", *TINY_RUN)
    trials = results(run_entry_point)["trials"]
    assert [t["number"] for t in trials] == [0, 1, 2, 3] and trials[3]["params"] != trials[2]["params"]


def test_a_study_whose_trials_log_no_optimized_metric_ends_at_the_first(run_entry_point):
    """Every trial would end so, and a failed trial is replaced only when a crash cut it
    short: the study stops with one line instead of running trials without a result."""
    result = run_entry_point(
        "train.py",
        "-m",
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=3",
        "optimized_metric=val/acc_bset",
        *TINY_RUN,
        check=False,
    )
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert result.returncode == 2
    assert len(errors) == 1 and "trial 0 ended without optimized_metric=val/acc_bset" in errors[0], errors
    assert sorted(p.name for p in study_folder(run_entry_point).iterdir() if p.name.isdigit()) == ["0"]


def test_failed_trials_count_and_a_study_without_a_result_ends_with_one_line(tmp_path, caplog):
    import optuna

    from hydra_plugins.navit_optuna_sweeper.optuna_sweeper import OptunaSweeper, trials_run

    study = optuna.create_study(direction="maximize")
    study.tell(study.ask(), state=optuna.trial.TrialState.FAIL)
    study.ask()  # left running by a crash: failed, run again, not counted
    OptunaSweeper._fail_interrupted(study)
    assert trials_run(study) == 1
    sweeper = OptunaSweeper("shapes", None, "maximize", n_trials=1, n_jobs=1, seed=0, params={})
    with pytest.raises(SystemExit) as ended:
        sweeper._write_results(study, tmp_path)
    assert ended.value.code == 1
    assert "error: none of the 2 trials of study 'shapes' completed" in caplog.text
    study.tell(study.ask(), 0.5)  # one completes: the best, and the failures counted beside it
    with caplog.at_level(logging.INFO):
        sweeper._write_results(study, tmp_path)
    assert (
        "best 0.5000 with {}" in caplog.text
        and "(2 of 3 trials failed or were cut short: see their folders' train.log)" in caplog.text
    )


def test_a_sweep_of_a_setting_beside_the_search_is_refused_with_one_line(run_entry_point):
    result = run_entry_point("train.py", "-m", "hparams_search=optuna", "seed=1,2", *TINY_RUN, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output
    assert (
        "error: hparams_search=optuna searches hydra.sweeper.params: give the other settings fixed" in output
    )


def test_a_study_goes_on_under_its_ranking_and_names_other_settings(caplog):
    """Continued with another objective (and a direction Optuna would not take), the trials of
    both were ranked together: refused once a trial has completed. Another fixed setting (a
    resume of the trials' runs) is named, not refused."""
    import optuna
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.navit_optuna_sweeper.optuna_sweeper import OptunaSweeper

    def sweeper(direction: str, metric: str) -> OptunaSweeper:
        made = OptunaSweeper(
            "shapes", None, direction, n_trials=1, n_jobs=1, seed=0, params={"seed": "range(0, 9)"}
        )
        made.config = OmegaConf.create({"optimized_metric": metric})
        return made

    def fixed(*overrides: str) -> list:
        return OverridesParser.create().parse_overrides(list(overrides))

    caplog.set_level(logging.INFO)
    study = optuna.create_study(direction="maximize")
    sweeper("maximize", "val/loss")._refuse_other_settings(study, fixed("data.rows=4"))  # none completed:
    first = sweeper("maximize", "val/acc_best")  # a mistake mended
    first._refuse_other_settings(study, fixed("data.rows=4"))
    study.tell(study.ask(), 0.5)
    with pytest.raises(SystemExit) as ended:
        sweeper("minimize", "val/loss")._refuse_other_settings(study, fixed("data.rows=4"))
    assert ended.value.code == 2
    assert (
        "ranks trials by direction=maximize (now minimize), optimized_metric=val/acc_best (now val/loss)"
        in (caplog.text)
    )
    first._refuse_other_settings(study, fixed("data.rows=4", "ckpt_path=last"))
    assert "its trials so far ran with other ckpt_path" in caplog.text


@pytest.mark.parametrize(
    "launch",
    [
        {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "RANK": "0"},
        {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"},
    ],
    ids=["torchrun", "srun"],
)
def test_a_study_under_several_launched_processes_is_refused(monkeypatch, caplog, launch):
    """Under srun (no WORLD_SIZE) every task ran a study of its own against one database."""
    from hydra_plugins.navit_optuna_sweeper.optuna_sweeper import OptunaSweeper

    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    sweeper = OptunaSweeper("shapes", None, "maximize", n_trials=1, n_jobs=1, seed=0, params={})
    with pytest.raises(SystemExit) as ended:
        sweeper.sweep([])
    assert ended.value.code == 2 and "error: hparams_search runs as one process" in caplog.text


def test_a_float_range_keeps_its_last_step():
    """range(0, 1, step=0.3) came out as [0, 0.6]: 0.9, computed as 0.8999999999999999, was off
    the steps to Optuna."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.navit_optuna_sweeper.optuna_sweeper import distribution

    (override,) = OverridesParser.create().parse_overrides(["data.token_drop_rate=range(0,1,step=0.3)"])
    space = distribution(override)
    assert (space.low, space.high, space.step) == (0, 0.9, 0.3)


def test_a_searched_setting_given_a_value_is_refused(caplog):
    """optimizer.lr=1e-3 beside a search of optimizer.lr: each trial trained at its own draw."""
    from hydra_plugins.navit_optuna_sweeper.optuna_sweeper import OptunaSweeper

    params = {"optimizer.lr": "tag(log, interval(1e-4, 1e-3))"}
    sweeper = OptunaSweeper("shapes", None, "maximize", n_trials=1, n_jobs=1, seed=0, params=params)
    with pytest.raises(SystemExit) as ended:
        sweeper.sweep(["optimizer.lr=1e-3", "seed=3"])
    assert ended.value.code == 2 and "error: optimizer.lr given and searched by hparams_search" in caplog.text


def test_a_searched_setting_given_no_search_space_is_refused_with_one_line(caplog):
    """hydra.sweeper.params={optimizer.lr:1e-3}: a traceback, the setting named twice."""
    from hydra_plugins.navit_optuna_sweeper.optuna_sweeper import OptunaSweeper

    sweeper = OptunaSweeper(
        "shapes", None, "maximize", n_trials=1, n_jobs=1, seed=0, params={"optimizer.lr": 1e-3}
    )
    with pytest.raises(SystemExit) as ended:
        sweeper.sweep(["seed=3"])
    assert ended.value.code == 2
    assert (
        "error: hydra.sweeper.params.optimizer.lr=0.001 is not a search space: use interval(a, b)"
        in caplog.text
    )


def test_a_second_study_in_a_studys_folder_is_refused(tmp_path, caplog):
    """Two studies in one pinned hydra.sweep.dir: the second wrote its trials into the
    first one's numbered folders, and over its results file."""
    from hydra_plugins.navit_optuna_sweeper.optuna_sweeper import claim_folder

    claim_folder(tmp_path, "shapes")
    claim_folder(tmp_path, "shapes")  # the same study, continued
    with pytest.raises(SystemExit) as ended:
        claim_folder(tmp_path, "other")
    assert ended.value.code == 2
    assert f"error: hydra.sweep.dir={tmp_path} holds the trials of study 'shapes'" in caplog.text


def test_a_study_another_process_runs_is_refused(tmp_path, caplog):
    """The same command started twice: the second failed the first one's running trial as a
    crash's, and the first ended in a traceback when it told its result."""
    import fcntl

    from omegaconf import OmegaConf

    from hydra_plugins.navit_optuna_sweeper.optuna_sweeper import OptunaSweeper

    sweeper = OptunaSweeper("shapes", None, "maximize", n_trials=1, n_jobs=1, seed=0, params={})
    sweeper.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with open(tmp_path / ".study.lock", "w") as held:  # as the first process holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit) as ended:
            sweeper.sweep([])
    assert ended.value.code == 2 and f"error: another process runs a study in {tmp_path}: wait" in caplog.text
    assert not (tmp_path / "optuna.db").exists()
