"""What the loaders' forkserver runs at its start, which preloads this module
(workers.WORKER_MODULES); no other process imports it.

The server ignores workers.JOB_SIGNALS, as Python's resource tracker does SIGTERM. A
scheduler's stop or requeue signal (scancel, a preemption, SLURM's --signal=USR1@90) reaches
every process of the job: the server died at once, and torch's loader workers end when their
parent does, so the rank's next batch failed before the ranks could stop together and save
last.ckpt. The server still ends with the process that started it (its pipe to that process
closes). The processes it forks inherit the setting from their start, which closes the
window before a loader worker's own (workers.loader_worker_init); a pool's workers take
SIGTERM again (workers.pool_worker_init).
"""

from navit_lightning.data.workers import ignore_job_signals

ignore_job_signals()
