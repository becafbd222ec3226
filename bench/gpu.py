"""Issue 64's one prepared GPU measurement: every row (bench/gpu_rows.py) in turn, each a process
of its own under its own timeout and the whole under one budget, then one markdown table of
s/step, tokens/s, MFU (of the H200's 989 TFLOP/s dense bf16) and peak memory per row, with the
date, torch's version and the commit in its header.

    bench/gpu.sh                                  # on the H200 (installs the carried wheels first)
    .venv/bin/python bench/gpu.py --smoke         # here: every row on the CPU, tiny shapes

Writes gpu_table.md, gpu_rows.json (each row's raw figures: the framework's summary.json, the
peer's, GRPO's) and gpu_logs.txt (each row's output's end) to $OUT (else --out). A failed row
prints its error's last lines and the table goes on; a row that no longer fits the budget is
skipped, saying so."""
import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_rows import GPU, SMOKE, Row, Skip, rows, step_s  # noqa: E402

GIB = 2 ** 30


class GpuMemory:
    """The device's used memory, polled by NVML while a row runs (the CUDA context included): one
    figure for every row, whatever its process reports. Nothing where NVML is absent (the CPU)."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML library or no GPU: the smoke run
            self.nvml = self.handle = None

    def name(self) -> str:
        if self.handle is None:
            return "no GPU (CPU)"
        name = self.nvml.nvmlDeviceGetName(self.handle)
        return name.decode() if isinstance(name, bytes) else name

    def peak_while(self, wait):
        """Runs wait(); returns its result and the peak used bytes seen meanwhile (None: no NVML)."""
        if self.handle is None:
            return wait(), None
        peak, done = [0], threading.Event()

        def poll():
            while not done.wait(0.2):
                peak[0] = max(peak[0], self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        try:
            return wait(), peak[0]
        finally:
            done.set()
            thread.join()


def run_row(row: Row, deadline: float, work: Path, memory: GpuMemory) -> dict:
    """Runs the row in a session of its own (its timeout kills the whole group: a launcher's
    ranks too); returns its figures or why it has none."""
    left = deadline - time.monotonic()
    if left < row.estimate_s:
        return {"status": "skipped", "why": f"{left:.0f} s of the budget left, the row needs about {row.estimate_s} s"}
    out = work / row.name.replace(" ", "_")
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        cmd = row.command(out)
    except Skip as skip:
        return {"status": "skipped", "why": str(skip)}
    except Exception as error:  # preparing its data or model failed: the next rows still run
        return {"status": "failed", "why": f"preparing: {type(error).__name__}: {error}", "wall_s": 0.0}
    timeout = min(row.cap_s, deadline - time.monotonic())
    log = out / "output.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)

        def wait():
            try:
                return process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return None

        code, gpu_peak = memory.peak_while(wait)
    result = {"wall_s": time.monotonic() - start, "gpu_peak_bytes": gpu_peak, "command": cmd,
              "log_tail": log.read_text(errors="replace").splitlines()[-40:]}
    if code is None:
        return {**result, "status": "failed", "why": f"timed out after {timeout:.0f} s"}
    if code != 0:
        return {**result, "status": "failed", "why": f"exit status {code}"}
    try:
        return {**result, "status": "ok", "raw": row.read(out)}
    except Exception as error:
        return {**result, "status": "failed", "why": f"reading its result: {type(error).__name__}: {error}"}


def reported_memory(raw: dict) -> tuple:
    """(allocated, reserved) peak GiB the row's own process reported: the peer's allocator
    figures, or summary.json's device_memory (max active and reserved, the largest over ranks);
    None where it reports none (a CPU, or a framework from before those figures)."""
    if "max_reserved_bytes" in raw:
        return tuple(raw[key] / GIB if raw[key] is not None else None
                     for key in ("max_allocated_bytes", "max_reserved_bytes"))
    peaks = (raw.get("device_memory") or {}).get("max_over_ranks", {})
    return peaks.get("max_active_gib"), peaks.get("max_reserved_gib")


def figures(row: Row, result: dict, peak_flops) -> dict:
    """The table's numbers of one row that ran."""
    raw = result["raw"]
    if row.kind == "grpo":
        return {"step_s": raw["step_s"], "tokens_per_s": raw["tokens_per_s"],
                "note": f"rollout {raw['rollout_s']:.2f} s ({raw['share']:.0%} of the step); tokens/s: completion "
                        f"tokens per rollout second; mean length {raw['mean_length']:.0f}"}
    step = step_s(raw["step_times_s"])
    tokens_per_s = row.tokens / step
    allocated, reserved = reported_memory(raw)
    return {"step_s": step, "first_step_s": raw["step_times_s"][0], "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * row.flops_per_token / peak_flops if peak_flops else None,
            "allocated_gib": allocated, "reserved_gib": reserved,
            "note": f"first loss {raw['losses'][0]:.2f}" + (f" ({row.note})" if row.note else "")}


def one_line(text: str, limit: int = 240) -> str:
    """A message as a table cell: one line, no column bars, at most `limit` characters."""
    text = " ".join(text.replace("|", "/").split())
    return text if len(text) <= limit else text[:limit] + "..."


def cell(value, form: str) -> str:
    return "-" if value is None else format(value, form)


def table(rows_run: list, header: str) -> str:
    lines = [header, "", "| row | s/step | first step s | tokens/s | MFU | peak alloc / reserved GiB (torch) | "
             "GPU peak GiB (NVML) | wall s | notes |", "|---|---|---|---|---|---|---|---|---|"]
    for row, result in rows_run:
        f = result.get("figures", {})
        memory = f"{cell(f.get('allocated_gib'), '.1f')} / {cell(f.get('reserved_gib'), '.1f')}"
        gpu = result.get("gpu_peak_bytes")
        note = f.get("note", "") if result["status"] == "ok" else f"{result['status']}: {one_line(result['why'])}"
        lines.append(f"| {row.name} | {cell(f.get('step_s'), '.4f')} | {cell(f.get('first_step_s'), '.1f')} | "
                     f"{cell(f.get('tokens_per_s'), ',.0f')} | {cell(f.get('mfu'), '.1%')} | {memory} | "
                     f"{cell(gpu / GIB if gpu else None, '.1f')} | {cell(result.get('wall_s'), '.0f')} | {note} |")
    return "\n".join(lines + [""] + ratios({row.name: r.get("figures", {}) for row, r in rows_run}))


RATIOS = [("native eager", "peer eager", "step_s", "framework / transformers, eager step"),
          ("native compiled", "peer compiled", "step_s", "framework / transformers, compiled step (goal <= 0.8)"),
          ("native eager", "peer eager", "reserved_gib", "framework / transformers, eager peak reserved"),
          ("native compiled", "peer compiled", "reserved_gib",
           "framework / transformers, compiled peak reserved (goal <= 0.6)"),
          ("lm_bench doc masking", "lm_bench causal", "step_s", "document masking / causal step (goal <= 1.1)"),
          ("grpo framework", "grpo TRL", "step_s", "GRPO framework / TRL step (goal <= 0.7)"),
          ("grpo framework", "grpo TRL", "tokens_per_s", "GRPO rollout tokens/s, framework / TRL (goal >= 3)"),
          ("native compiled", "native compiled whole logits", "step_s", "loss by chunks (default) / whole logits, step"),
          ("native compiled", "native compiled whole logits", "reserved_gib",
           "loss by chunks (default) / whole logits, peak reserved"),
          ("native compiled float8", "native compiled", "tokens_per_s", "float8 / bf16 tokens/s (goal >= 1.25)")]


def ratios(by_name: dict) -> list:
    lines = []
    for a, b, key, label in RATIOS:
        x, y = by_name.get(a, {}).get(key), by_name.get(b, {}).get(key)
        if x and y:
            lines.append(f"- {label}: {x / y:.2f}")
    return lines


def commit() -> str:
    """The commit measured: git's here; on the device (no .git travels) the one bench/gpu_wheels.sh
    wrote beside the wheels."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        marker = ROOT / ".whl" / "COMMIT"
        return marker.read_text().strip() if marker.exists() else "unknown"


def header(smoke: bool, memory: GpuMemory, budget: float) -> str:
    import torch
    import transformers

    what = "smoke run (CPU, tiny shapes: the figures mean nothing)" if smoke else "H200 run"
    return (f"GPU table, {what}: {datetime.date.today()}, {memory.name()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, commit {commit()}, budget {budget:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="every row on the CPU with tiny shapes")
    parser.add_argument("--budget", type=float, help="seconds for all rows (default: 310 on the GPU)")
    parser.add_argument("--rows", help="comma-separated row names to run (default: all)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="where the table goes (default: $OUT)")
    args = parser.parse_args()
    scale = SMOKE if args.smoke else GPU
    budget = args.budget or scale.budget_s
    deadline = time.monotonic() + budget
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_out_"))
    out.mkdir(parents=True, exist_ok=True)
    memory = GpuMemory()
    head = header(args.smoke, memory, budget)
    print(head, flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_bench_") as work:  # the models and data: gigabytes on the GPU run
        chosen = rows(scale, Path(work))
        if args.rows:
            chosen = [row for row in chosen if row.name in args.rows.split(",")]
        done = []
        for row in chosen:
            result = run_row(row, deadline, Path(work), memory)
            if result["status"] == "ok":
                result["figures"] = figures(row, result, scale.peak_flops)
            done.append((row, result))
            report(row, result)
            write(out, done, head)  # after every row: a call cut short still brings back the rows it ran
    print("\n" + table(done, head), flush=True)
    print(f"(written to {out})")


def write(out: Path, done: list, head: str) -> None:
    """gpu_table.md, gpu_rows.json and gpu_logs.txt (three files: the device brings back eight)."""
    (out / "gpu_table.md").write_text(table(done, head) + "\n")
    (out / "gpu_rows.json").write_text(json.dumps({row.name: result for row, result in done}, indent=1, default=str))
    (out / "gpu_logs.txt").write_text("".join(f"== {row.name}: {result['status']}\n" + "\n".join(result.get(
        "log_tail", [])) + "\n" for row, result in done))


def report(row: Row, result: dict) -> None:
    """One line as each row ends; a failure's last output lines."""
    if result["status"] == "ok":
        f = result["figures"]
        print(f"{row.name}: {f['step_s']:.4f} s/step, {f['tokens_per_s']:,.0f} tokens/s, {f['note']} "
              f"({result['wall_s']:.0f} s)", flush=True)
        return
    print(f"{row.name}: {result['status']}: {result['why']}", flush=True)
    for line in result.get("log_tail", [])[-15:]:
        print(f"    {line}", flush=True)


if __name__ == "__main__":
    main()
