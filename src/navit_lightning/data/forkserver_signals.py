"""What the loaders' forkserver runs at its start, which preloads this module
(workers.WORKER_MODULES); no other process imports it.

The server ignores SIGTERM, as Python's resource tracker does. A scheduler's stop (scancel, a
preemption, systemd, `timeout`) signals every process of the job: the server died at once,
and torch's loader workers end when their parent does, so the rank's next batch failed before
the ranks could stop together and save last.ckpt. The server still ends with the process
that started it (its pipe to that process closes). The processes it forks inherit the
setting from their start, which closes the window before a loader worker's own
(workers.loader_worker_init); a pool's workers take SIGTERM again (workers.pool_worker_init).
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
