"""Runs of train.py, eval.py and predict.py forked from a process that has imported their
libraries already. A run started as `python train.py` spends most of its CPU time on a small
data set importing Lightning and torch (~5 s of a ~14 s run); the suite starts hundreds of
them on 2 cores.

A forked run is the script's own run from its first line on: its own pid, argv, sys.path[0],
environment, working directory, stdin, stdout and stderr, its `__main__` (runpy), and the
interpreter's own exit (atexit, non-daemon threads, exit status, death by a signal). What it
shares with the server: the imports of Lightning, torch and Hydra (their import-time state;
the package's own modules it imports itself) and Python's string hash seed. The README's
commands, other ranks, and tests given `fresh_process=True` run as new processes;
NAVIT_TESTS_FORKED_RUNS=0 runs every test's run so."""

from __future__ import annotations

import contextlib
import json
import multiprocessing.process
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# Imported by every entry point before its first line of its own: what a run saves.
PRELOADED = ("lightning", "hydra", "omegaconf", "torch")
# requests and replies: one JSON object a message (a packet: never two read as one)
MESSAGE_BYTES = 1 << 16


class RunServer:
    """The pytest side: one server process, started at the first run, one run at a time."""

    def __init__(self) -> None:
        self.socket: socket.socket | None = None
        self.server: subprocess.Popen | None = None

    def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.server = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            cwd=Path(__file__).resolve().parents[1],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self.socket = ours
        assert json.loads(self.socket.recv(MESSAGE_BYTES)) == "ready"

    def run(self, command: list[str], *, cwd: Path, env: dict[str, str], timeout: float):
        """subprocess.run(command, capture_output=True, text=True, ...) for `command` =
        [sys.executable, script, *arguments]; a timeout kills the run and what it started."""
        # here, not at the top: the server imports the package's modules in each run alone
        from navit_lightning.utils.shutdown import descendants

        _, script, *arguments = command
        if self.socket is None:
            self.start()
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        request = {"script": script, "arguments": arguments, "cwd": str(cwd), "env": env}
        socket.send_fds(self.socket, [json.dumps(request).encode()], [out_write, err_write])
        os.close(out_write)
        os.close(err_write)
        pid = json.loads(self.socket.recv(MESSAGE_BYTES))
        deadline = time.monotonic() + timeout
        try:
            stdout, stderr = read_until_closed(out_read, err_read, deadline, command, timeout)
            self.socket.settimeout(max(deadline - time.monotonic(), 0.1))
            returncode = json.loads(self.socket.recv(MESSAGE_BYTES))
            self.socket.settimeout(None)
        except BaseException:
            for process in [pid, *descendants(pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process, signal.SIGKILL)
            self.close()  # its reply to this run would be read as the next one's: a new server
            raise
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)

    def close(self) -> None:
        if self.socket is None:
            return
        self.socket.close()
        self.socket = None
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()


def read_until_closed(
    out: int, err: int, deadline: float, command: list[str], timeout: float
) -> tuple[str, str]:
    """Everything written to the pipes `out` and `err` until every writer has closed them."""
    chunks: dict[int, list[bytes]] = {out: [], err: []}
    with selectors.DefaultSelector() as selector:
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)
        try:
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise subprocess.TimeoutExpired(command, timeout)
                for key, _ in selector.select(remaining):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
        finally:
            os.close(out)
            os.close(err)
    return tuple(b"".join(chunks[fd]).decode(errors="replace") for fd in (out, err))


def serve(connection: socket.socket) -> None:
    """The server: fork a run for each request, wait for it, reply with its exit status."""
    for module in PRELOADED:
        __import__(module)
    connection.sendall(json.dumps("ready").encode())
    while True:
        message, fds, _, _ = socket.recv_fds(connection, MESSAGE_BYTES, 2)
        if not message:
            return
        request = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            connection.close()
            become_the_run(request, *fds)
            return  # the interpreter ends as `python script` does, with the run's status
        for fd in fds:
            os.close(fd)
        connection.sendall(json.dumps(pid).encode())
        _, status = os.waitpid(pid, 0)
        try:
            # Popen.returncode's form: -N for death by signal N
            connection.sendall(json.dumps(os.waitstatus_to_exitcode(status)).encode())
        except BrokenPipeError:  # the run timed out: the test has closed this server
            return


def become_the_run(request: dict, stdout: int, stderr: int) -> None:
    """In the forked process: run the script as `python script arguments` would."""
    stdin = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    multiprocessing.process.ORIGINAL_DIR = os.getcwd()  # read at its import: the server's
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["script"]
    sys.argv = [script, *request["arguments"]]
    sys.orig_argv = [sys.executable, *sys.argv]
    sys.path[0] = str(Path(script).resolve().parent)
    try:
        runpy.run_path(script, run_name="__main__")
    except Exception as error:  # shown from the script's first frame on, as Python shows it
        traceback = error.__traceback__
        while traceback is not None and traceback.tb_frame.f_code.co_filename != script:
            traceback = traceback.tb_next
        error = error.with_traceback(traceback or error.__traceback__)
        sys.excepthook(type(error), error, error.__traceback__)
        sys.exit(1)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
