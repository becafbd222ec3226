"""Rank start-up in milliseconds instead of seconds: a zygote imports torch and the framework
once, and every self-launched rank is a fork of it.

Importing torch and DTensor costs about 5 s of CPU per process; four ranks on two cores spent
most of a short run's wall time importing. The elastic agent still starts, watches, signals and
restarts each rank as a command (so it sees every rank's exit code and error file); that command
is this module's light client, which hands its stdio, environment and arguments to the zygote,
relays the agent's signals to the forked rank, and exits as the rank did (same code, or killed
by the same signal). A rank kills itself when its client disappears, and a client dies with the
agent, so nothing outlives the agent. Stdlib only: the client must start fast.

Launches may share one zygote: FRAMEWORK_ZYGOTE_SOCKET names a running one (the test suite
starts one per session, and its commands' ranks are all forks of it).

    server: python -m framework.launch.zygote --serve SOCKET PRELOADED_MODULE LAUNCHER_PID
    client: python -m framework.launch.zygote SOCKET MODULE [ARGS...]
"""
import atexit
import json
import os
import runpy
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Dict, Tuple

_HEADER = struct.Struct("!Q")
_RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = conn.recv(size)
        if not chunk:
            raise ConnectionError("zygote peer closed the connection")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


_running: Dict[str, Tuple[subprocess.Popen, str]] = {}


def zygote_socket(preload: str = "framework.launch.worker") -> str:
    """The socket of this process's zygote for `preload`, started on first use and stopped at exit
    (for the ranks' preload, FRAMEWORK_ZYGOTE_SOCKET's where set). It is a fresh interpreter (not a
    fork of the caller, whose threads or OpenMP may not survive a fork) with the caller's
    environment, so starting it early overlaps its imports with the caller's."""
    if preload == "framework.launch.worker" and os.environ.get("FRAMEWORK_ZYGOTE_SOCKET"):
        return os.environ["FRAMEWORK_ZYGOTE_SOCKET"]
    running = _running.get(preload)
    if running is None or running[0].poll() is not None:
        sock_dir = tempfile.mkdtemp(prefix="framework-zygote-")
        path = os.path.join(sock_dir, "zygote.sock")
        # One OpenMP thread in the zygote: it never computes, and a fork must not inherit a
        # thread pool; each rank sets its own count (framework.launch.threads).
        # A session of its own: a terminal's Ctrl-C is the launcher's to act on, and must not
        # reach the zygote while its interpreter still starts (before it can ignore signals).
        server = subprocess.Popen([sys.executable, "-m", __name__, "--serve", path, preload, str(os.getpid())],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        running = _running[preload] = server, path

        def stop() -> None:
            server.kill()
            server.wait()
            shutil.rmtree(sock_dir, ignore_errors=True)

        atexit.register(stop)
    return running[1]


# ---- server -------------------------------------------------------------------------------

def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent-pid check in serve() still ends the server


def _run_rank(conn: socket.socket, stdio: list, request: dict, zygote: int) -> None:
    """In the forked child: become the rank the client asked for, run it, exit with its status.
    A rank is the leader of its own session, as torchrun's are: a terminal's Ctrl-C reaches the
    launcher alone, whose agent signals each rank once (framework.training.interrupt). Out of the
    launcher's process group, it dies with the zygote, as the zygote dies with the launcher."""
    os.setsid()
    _die_with_parent()
    if os.getppid() != zygote:  # it died before the line above
        os._exit(1)
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
        os.close(fd)
    for sig in _RELAYED + (signal.SIGCHLD,):
        signal.signal(sig, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])

    def die_with_client() -> None:
        conn.recv(1)  # returns only when the client is gone
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die_with_client, daemon=True).start()
    sys.argv = [request["module"], *request["args"]]
    code = 0
    try:
        # The preload imported the module itself; runpy runs a fresh copy as __main__ (its imports
        # stay cached) and warns when the imported one is still registered.
        sys.modules.pop(request["module"], None)
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()  # as the interpreter's own exit would (the command's, and those of its imports)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fork_rank(listener: socket.socket, conn: socket.socket, ranks: Dict[int, socket.socket]) -> None:
    header, stdio, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    request = json.loads(_recv_exactly(conn, _HEADER.unpack(header)[0]))
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in ranks.values():
            other.close()
        _run_rank(conn, stdio, request, zygote)
    for fd in stdio:
        os.close(fd)
    ranks[pid] = conn
    conn.sendall(f"{pid}\n".encode())


def serve(path: str, preload: str, launcher: str) -> None:
    """Fork ranks for clients until the launcher (pid `launcher`) is gone."""
    from framework import imports_done

    _die_with_parent()
    parent = int(launcher)
    if os.getppid() != parent:  # the launcher died while this interpreter started
        os._exit(1)
    # Stopped only with the launcher: a SIGTERM or SIGHUP is the launcher's to act on (its ranks
    # end their step and save first).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    imports_done()  # its ranks, forked from it, handle signals themselves (framework.training.interrupt)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(256)  # clients may connect (and wait) while the preload is importing
    __import__(preload)
    ranks: Dict[int, socket.socket] = {}
    while os.getppid() == parent:
        if select.select([listener], [], [], 0.05)[0]:
            conn, _ = listener.accept()
            try:
                _fork_rank(listener, conn, ranks)
            except OSError:  # the client died before being served
                conn.close()
        while ranks:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = ranks.pop(pid)
            reply = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.WEXITSTATUS(status)}
            try:
                conn.sendall(json.dumps(reply).encode())
            except OSError:
                pass  # the client is gone (killed): the rank went with it, nobody to tell
            conn.close()


# ---- client -------------------------------------------------------------------------------

def restart_note() -> str:
    """`; restarting every rank (1 of 3)` when the elastic agent restarts the ranks after this
    attempt fails (launcher.max_restarts), else ""."""
    done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    most = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    return f"; restarting every rank ({done + 1} of {most})" if done < most else ""


def _connect(path: str, timeout_s: float = 120.0) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except FileNotFoundError:  # not bound yet (refused would mean the zygote died)
            conn.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def run_client(path: str, module: str, args: list) -> None:
    agent = os.getppid()
    _die_with_parent()  # a shared zygote outlives the agent; its rank must not
    if os.getppid() != agent:
        os._exit(1)
    conn = _connect(path)
    request = json.dumps({"module": module, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [_HEADER.pack(len(request))], [0, 1, 2])
    conn.sendall(request)
    reader = conn.makefile("rb")
    pid = int(reader.readline())
    relayed = []

    def relay(number: int, _frame) -> None:
        relayed.append(number)
        try:
            os.kill(pid, number)
        except ProcessLookupError:  # the rank ended and was reaped already: its status is on its way
            pass

    for sig in _RELAYED:
        signal.signal(sig, relay)
    reply = json.loads(reader.read() or b'{"signal": 9}')  # no reply: the zygote itself died
    if "signal" in reply:
        note = restart_note()
        if note and not relayed and "RANK" in os.environ:  # a kill from outside, not the agent's stop
            print(f"rank {os.environ['RANK']} was killed by signal {signal.Signals(reply['signal']).name}{note}",
                  file=sys.stderr, flush=True)
        if reply["signal"] in _RELAYED:
            signal.signal(reply["signal"], signal.SIG_DFL)  # (SIGKILL has no handler to reset)
        os.kill(os.getpid(), reply["signal"])
    sys.exit(reply["exit"])


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(*sys.argv[2:5])
    else:
        run_client(sys.argv[1], sys.argv[2], sys.argv[3:])
