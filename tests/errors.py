"""How far two computations are apart, and a record of it.

The suite's rule (tests/conftest.py): a bound on two differently-computed sides is at least 10x
the error measured here. `TOLERANCE_LOG=errors.jsonl make test` appends one line per comparison
(the test, the file:line that asked, the error; for torch.testing.assert_close also the share of
its tolerance used), so the measurement behind each bound can be repeated on any CPU.
"""
import json
import os
import sys
from typing import List

import torch


def relative_error(ours, theirs) -> float:
    """max |ours - theirs| / max |theirs|: one number for a tensor (logits, a gradient) or a scalar."""
    ours, theirs = torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(theirs, dtype=torch.float64)
    return record(float((ours - theirs).abs().max() / theirs.abs().max()))


def max_relative_error(values: List[float], reference: List[float]) -> float:
    """The worst step of a loss curve, each step relative to its own reference value."""
    assert len(values) == len(reference)
    return record(max(abs(v - r) / abs(r) for v, r in zip(values, reference)))


def record(error: float, **extra) -> float:
    """Append the error and the test line that asked for it to $TOLERANCE_LOG (when set)."""
    path = os.environ.get("TOLERANCE_LOG")
    if path:
        frame = sys._getframe(1)
        while frame.f_code.co_filename in (__file__, torch.testing._comparison.__file__) or \
                frame.f_code.co_filename.endswith("conftest.py"):
            frame = frame.f_back
        site = f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno}"
        with open(path, "a") as log:
            log.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "site": site,
                                  "error": error, **extra}) + "\n")
    return error


def recording_assert_close(assert_close):
    """torch.testing.assert_close that also records the relative error and the share of the
    tolerance (atol + rtol |expected|) the worst element used."""
    def wrapped(actual, expected, *args, rtol=None, atol=None, **kwargs):
        a, e = torch.as_tensor(actual).detach().double(), torch.as_tensor(expected).detach().double()
        if a.shape == e.shape and a.numel():
            r = 1.3e-6 if rtol is None else rtol
            t = 1e-5 if atol is None else atol
            diff = (a - e).abs()
            record(float(diff.max() / e.abs().max().clamp_min(1e-30)),
                   used=float((diff / (t + r * e.abs())).max()) if (r or t) else float(diff.max() > 0), rtol=r, atol=t)
        return assert_close(actual, expected, *args, rtol=rtol, atol=atol, **kwargs)
    return wrapped
