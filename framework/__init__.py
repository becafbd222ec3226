"""Declarative DP x TP training on PyTorch's DeviceMesh, driven by Hydra configs."""
import sys


def _interrupted_before_handling(kind, value, traceback, _default=sys.excepthook) -> None:
    """Ctrl-C while a command still imports (before framework.cli.command_status handles it):
    the same one line, not Python's traceback. Python still exits by SIGINT (130 in a shell)."""
    if issubclass(kind, KeyboardInterrupt):
        print("interrupted by SIGINT", file=sys.stderr)
    else:
        _default(kind, value, traceback)


if sys.argv[:1] == ["-m"]:  # `python -m framework.<command>` (argv[0] is "-m" while Python finds the module)
    sys.excepthook = _interrupted_before_handling
