import itertools

import pytest
import torch

from navit_lightning.utils.schedules import warmup_cosine


def rates_over(total_steps: int, steps: int, state: dict | None = None) -> tuple[list[float], dict]:
    """The rates of `steps` optimizer steps of a warmup_cosine over `total_steps`, started afresh
    or from a saved (optimizer, schedule) state, and the state after them."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    schedule = warmup_cosine(optimizer, total_steps, warmup_steps=2)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates, {"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()}


def test_warm_up_then_cosine_to_the_floor():
    rates, _ = rates_over(20, 21)
    assert rates[:2] == pytest.approx([0.5e-3, 1e-3])
    assert rates[2] == rates[1]  # the cosine starts at the base rate
    assert all(later < earlier for earlier, later in itertools.pairwise(rates[2:]))
    assert rates[20] == pytest.approx(1e-5)  # min_lr_ratio x base
    # past the total (an epoch packed into more batches than Lightning estimated) it stays there
    assert rates_over(20, 26)[0][20:] == pytest.approx([1e-5] * 6)


def test_a_resumed_run_goes_on_along_its_own_schedule():
    whole, _ = rates_over(20, 20)
    _, saved = rates_over(20, 8)
    assert rates_over(20, 12, saved)[0] == whole[8:]  # the same run: the same rates, to the bit

    finished, at_floor = rates_over(20, 20)
    longer, _ = rates_over(40, 20, at_floor)
    # from its first step on, the longer run follows the cosine over 40 steps at step 20
    assert longer == pytest.approx(rates_over(40, 40)[0][20:])
    assert finished[-1] < 2e-5 < 5e-4 < longer[0]


@pytest.mark.parametrize(
    ("total", "warmup", "peak"),
    [(1797, 300, 299), (1797, 100, 99), (200, 100, 99), (199, 100, 98), (50, 100, 24)],
)
def test_the_warm_up_is_taken_as_given_up_to_half_the_run(total, warmup, peak):
    """It was cut to a tenth of any run: 200, 300 and 400 steps of the default run's 1,797
    all peaked at step 178 (three of the Optuna search's five values). Capped at half the run,
    it grows with the run, without a jump where the run outgrows it."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    factor = warmup_cosine(optimizer, total, warmup_steps=warmup).lr_lambdas[0]
    rates = [factor(step) for step in range(total)]
    assert rates.index(max(rates)) == peak and max(rates) == 1.0


def test_a_run_of_unknown_length_warms_up_then_keeps_its_rate():
    """trainer.max_epochs=-1 (ended by max_time or early stopping): Lightning's total is
    infinite, half of it NaN, and the warm-up was one step."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    factor = warmup_cosine(optimizer, float("inf"), warmup_steps=100).lr_lambdas[0]
    rates = [factor(step) for step in range(1000)]
    assert rates[:100] == pytest.approx([(step + 1) / 100 for step in range(100)])
    assert rates[100:] == [1.0] * 900
