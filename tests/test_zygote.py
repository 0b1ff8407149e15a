"""A run forked by tests/zygote.py sees what `python script` sees, and ends as it does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from navit_lightning.utils.shutdown import descendants
from tests.conftest import run_whole

SCRIPT = """
import __main__, atexit, json, multiprocessing.process, os, signal, sys, threading, time
how = sys.argv[1]
atexit.register(lambda: print("atexit ran", flush=True))
# a non-daemon thread: the interpreter's exit waits for it
threading.Thread(target=lambda: (time.sleep(0.2), print("thread ended", flush=True))).start()
print(json.dumps({
    "argv": sys.argv, "orig_argv": sys.orig_argv[1:], "path0": sys.path[0], "cwd": os.getcwd(),
    "original_dir": multiprocessing.process.ORIGINAL_DIR, "env": os.environ.get("ZYGOTE_TEST"),
    "main": [__main__.__file__, __main__.__spec__, __name__], "stdin": sys.stdin.read(),
    "parent": multiprocessing.parent_process() is None,
}))
print("to stderr", file=sys.stderr)
if how == "exit":
    sys.exit(3)
if how == "raise":
    raise ValueError("raised on purpose")
if how == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
"""


@pytest.mark.parametrize("how", ["end", "exit", "raise", "signal"])
def test_a_forked_run_is_the_scripts_own_process(run_server, tmp_path, how):
    script = tmp_path / "scripts" / "script.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    (tmp_path / "cwd").mkdir()
    env = {**os.environ, "ZYGOTE_TEST": "yes"}
    command = [sys.executable, str(script), how]
    options = {"cwd": tmp_path / "cwd", "env": env, "timeout": 60}
    forked = run_server.run(command, **options)
    fresh = run_whole(command, stdin=subprocess.DEVNULL, **options)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    said = json.loads(forked.stdout.splitlines()[0])
    assert said["argv"] == said["orig_argv"] == [str(script), how]
    assert said["path0"] == str(script.parent)
    assert said["cwd"] == said["original_dir"] == str(tmp_path / "cwd")
    assert said["env"] == "yes" and said["stdin"] == "" and said["parent"]
    assert said["main"] == [str(script), None, "__main__"]
    expected_code = {"end": 0, "exit": 3, "raise": 1, "signal": -signal.SIGTERM}[how]
    assert forked.returncode == expected_code
    ended = how != "signal"
    assert ("thread ended" in forked.stdout) == ended and ("atexit ran" in forked.stdout) == ended
    assert ("ValueError: raised on purpose" in forked.stderr) == (how == "raise")


def test_a_run_past_its_timeout_is_killed_and_the_next_run_gets_a_new_server(run_server, tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import os, sys, time\nprint(os.getpid(), flush=True)\ntime.sleep(int(sys.argv[1]))\n")
    command = [sys.executable, str(script)]
    with pytest.raises(subprocess.TimeoutExpired):
        run_server.run([*command, "600"], cwd=tmp_path, env=dict(os.environ), timeout=3)
    # the killed run never printed its pid back: its server, gone with it, names no process
    assert not [pid for pid in descendants(os.getpid()) if running_script(pid, script)]
    again = run_server.run([*command, "0"], cwd=tmp_path, env=dict(os.environ), timeout=60)
    assert again.returncode == 0 and again.stdout.strip().isdigit()


def running_script(pid: int, script) -> bool:
    try:
        return str(script) in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    except OSError:
        return False
