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


def test_a_resumed_run_goes_on_along_its_own_schedule():
    whole, _ = rates_over(20, 20)
    _, saved = rates_over(20, 8)
    assert rates_over(20, 12, saved)[0] == whole[8:]  # the same run: the same rates, to the bit

    finished, at_floor = rates_over(20, 20)
    longer, _ = rates_over(40, 20, at_floor)
    # from its first step on, the longer run follows the cosine over 40 steps at step 20
    assert longer == pytest.approx(rates_over(40, 40)[0][20:])
    assert finished[-1] < 2e-5 < 5e-4 < longer[0]
