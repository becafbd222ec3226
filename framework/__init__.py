"""Declarative DP x TP training on PyTorch's DeviceMesh, driven by Hydra configs."""
import os
import sys


def _interrupted_before_handling(kind, value, traceback, _default=sys.excepthook) -> None:
    """Ctrl-C while a command still imports (before framework.cli.command_status handles it):
    the same one line and exit status (130), not Python's traceback. It exits at once: shutting
    the interpreter down with imports half done (torch's) could abort with a fatal error, and
    nothing has been written yet; the ranks' zygote, if started, dies with this process."""
    if issubclass(kind, KeyboardInterrupt):
        print("interrupted by SIGINT", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)
    _default(kind, value, traceback)


def imports_done() -> None:
    """The command handles Ctrl-C itself from here on (framework.cli.command_status; the zygote
    ignores it): Python's own hook again, so a later exit runs its atexit handlers."""
    if sys.excepthook is _interrupted_before_handling:
        sys.excepthook = sys.__excepthook__


if sys.argv[:1] == ["-m"]:  # `python -m framework.<command>` (argv[0] is "-m" while Python finds the module)
    sys.excepthook = _interrupted_before_handling
