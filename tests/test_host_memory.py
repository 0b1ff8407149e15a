"""KeepFreedHostMemory: on a CPU, a large tensor freed and allocated again comes back from
the heap, without faulting its pages in again."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from navit_lightning.utils import callbacks
from navit_lightning.utils.callbacks import KeepFreedHostMemory
from navit_lightning.utils.host_memory import glibc

# In a fresh process: the setting is the process's own, and would outlive the test here.
COUNT_FAULTS = """
import resource, sys, types, torch
from navit_lightning.utils.callbacks import KeepFreedHostMemory

def faults_of_four_allocations():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

for device in ("cuda", "cpu"):  # where the model runs (no GPU is touched)
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device(device)))
    KeepFreedHostMemory().setup(trainer, None, "fit")
    faults_of_four_allocations()  # a first one faults its pages in, in any case
    print(faults_of_four_allocations())
"""

PAGES_OF_64_MIB = (64 << 20) // os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not glibc(), reason="the setting is glibc's (mallopt)")
def test_freed_host_memory_is_reused_only_where_the_model_runs_on_the_cpu():
    result = subprocess.run([sys.executable, "-c", COUNT_FAULTS], capture_output=True, text=True, check=True)
    on_cuda, on_cpu = map(int, result.stdout.split())
    if on_cuda < PAGES_OF_64_MIB:
        pytest.skip(f"{on_cuda} page faults without the setting: this host maps huge pages anyway")
    # Without it: each 64 MiB tensor mapped afresh, all its pages faulted in again.
    assert on_cuda >= 4 * PAGES_OF_64_MIB * 0.9, result.stdout
    assert on_cpu < PAGES_OF_64_MIB / 10, result.stdout


@pytest.mark.parametrize(("device", "kept"), [("cpu", True), ("cuda", False)])
def test_freed_host_memory_is_kept_only_for_a_model_on_the_cpu(monkeypatch, device, kept):
    """Which runs get the setting, checked on any host (the test above skips where huge pages
    hide it): a run on a GPU would keep its peak host memory, for no faster step."""
    calls = []
    monkeypatch.setattr(callbacks, "keep_freed_memory", lambda: calls.append(device))
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)))
    KeepFreedHostMemory().setup(trainer, None, "fit")
    assert calls == ([device] if kept else [])
