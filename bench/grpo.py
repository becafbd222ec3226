"""GRPO: the framework (objective=grpo, recipe=grpo_hf) against TRL's GRPOTrainer (use_vllm=False,
transformers' generate), on the same random Hugging Face Llama, the same prompts, group size,
completion length, sampling (temperature 1, top-p 1, no top-k), reward function, prompts per step,
micro-batches, AdamW, lr, grad clip and beta=0 (no reference model); full fine-tuning, fp32, CPU;
the sides alternating in each repeat; the median of steps 2.. of each run.

    .venv/bin/python bench/grpo.py [--repeats 2] [--steps 8] [--rows full1,dp2] [--max-new-tokens 64] \\
        [--hidden 256 --layers 4]
    .venv/bin/python bench/grpo.py --profile [--threads 2]   # the generation loops in one process, cProfile'd
    .venv/bin/python bench/grpo.py --staleness 1 [--rows full1,dp2]   # the framework at max_staleness=1 against 0

Reports per row: s/step, the rollout's share of the step (generation and scoring: the framework's
summary.json rollout_s, TRL's _generate_and_score_completions timed by wrapping it), completion
tokens generated per second of rollout (the framework's TensorBoard completions/mean_length x
completions; TRL's completions counted as they come out of _generate_single_turn) and the framework
/ TRL ratio of the repeats' means. TRL is the dev extra's reference (trl>=1.16). With --staleness K
the other side is the framework itself at objective.max_staleness=K (its generating weights K
updates old, swapped in and out, and the sampling correction's extra forward), not TRL."""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sides import run_side, step_ends, wait_for_quiet  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS = 256, 4, 8, 4  # intermediate: hidden x 43 / 16 (688)
PROMPTS, GROUP, MICRO = 8, 8, 2  # prompts per step, completions per prompt, prompts per micro-batch
LR = 1e-5
REWARD = '''def share(prompt, completion, answer):
    """The share of lowercase letters in the completion (a random model starts near 0.1)."""
    return sum(c.islower() for c in completion) / max(len(completion), 1)


def trl_share(prompts, completions, answer=None, **kwargs):
    """The same, with TRL's signature."""
    return [float(share(p, c, a)) for p, c, a in zip(prompts, completions, answer or [None] * len(prompts))]
'''


def make_model_and_data(root: Path, hidden: int = HIDDEN, layers: int = LAYERS) -> dict:
    """A random Llama (hidden 256 and 4 layers by default, GQA 8/4 heads, untied, the byte
    tokenizer's 256 ids), 64 prompts of 37-44 bytes prepared for the framework (and kept as JSONL
    for TRL), the reward file."""
    from tests.hf_models import make_hf_model

    model = make_hf_model("llama", str(root / "llama"), hidden_size=hidden, intermediate_size=hidden * 43 // 16,
                          num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                          rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=False)
    return make_data(root, model)


def make_data(root: Path, model: str) -> dict:
    """The prompts, prepared with `model`'s tokenizer, and the reward file (bench/gpu.py brings
    its own model)."""
    from framework.prepare import main as prepare

    records = [{"prompt": f"Question {i}: what is {i % 17} plus {(3 * i) % 11}? Answer:" + " " * (i % 5),
                "answer": str(i % 17 + (3 * i) % 11)} for i in range(64)]
    jsonl = root / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert prepare([str(jsonl), "--tokenizer", model, "--out", str(root / "prompts"), "--prompt-field", "prompt",
                    "--answer-field", "answer"]) == 0
    reward = root / "reward.py"
    reward.write_text(REWARD)
    return {"model": model, "prompts": str(root / "prompts"), "jsonl": str(jsonl), "reward": str(reward),
            "longest": max(len(r["prompt"].encode()) for r in records)}


def framework_cmd(row: str, data: dict, steps: int, new: int, out: Path, staleness: int = 0) -> list:
    overrides = ["recipe=grpo_hf", f"model.path={data['model']}", f"data.path={data['prompts']}", "adapter=none",
                 "mesh=2x1" if row == "dp2" else "mesh=1x1", "parallel.dp_strategy=replicate", "plan=none",
                 "reward=file", f"reward.file={data['reward']}", "reward.function=share",
                 f"objective.group_size={GROUP}", f"objective.max_new_tokens={new}", "objective.temperature=1.0",
                 "objective.top_p=1.0", "objective.beta=0.0", "objective.loss_type=grpo",
                 "objective.scale_rewards=group", f"data.global_batch_size={PROMPTS}", f"data.micro_batch_size={MICRO}",
                 f"data.dataset.seq_len={data['longest'] + new}", f"optim.lr={LR}", "optim.weight_decay=0.0",
                 "optim.betas=[0.9,0.99]", "trainer.mixed_precision=null", f"trainer.max_steps={steps}",
                 "trainer.warmup_steps=0", "trainer.lr_decay=constant", "trainer.grad_clip=1.0",
                 "trainer.log_every=1", "trainer.eval_every=null", "trainer.progress_bar=false",
                 "trainer.compile=none", "checkpoint.every=null", f"objective.max_staleness={staleness}",
                 f"hydra.run.dir={out}"]
    return [sys.executable, "-m", "framework.train", *overrides]


def peer_cmd(row: str, data: dict, steps: int, new: int, out: Path) -> list:
    args = [__file__, "--peer", row, "--model", data["model"], "--jsonl", data["jsonl"], "--reward", data["reward"],
            "--steps", str(steps), "--max-new-tokens", str(new), "--out", str(out)]
    if row == "dp2":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", "29519", *args]
    return [sys.executable, *args]


def run_peer(args) -> None:
    """One side of a row: TRL's GRPOTrainer. Per optimizer step it generates PROMPTS x GROUP
    completions at once (generation_batch_size = per_device_train_batch_size x processes x
    steps_per_generation, steps_per_generation = gradient_accumulation_steps) and learns from them
    in micro-batches of MICRO prompts' completions, as the framework does."""
    import importlib.util

    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("bench_reward", args.reward)
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    records = [json.loads(line) for line in Path(args.jsonl).read_text().splitlines()]
    dataset = Dataset.from_list(records)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_device = MICRO * GROUP  # completions per micro-batch
    accumulation = PROMPTS * GROUP // (per_device * world)

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    on_gpu = torch.cuda.is_available()  # bench/gpu.py: the GPU, bf16 autocast as the framework's side there
    config = GRPOConfig(
        output_dir=args.out, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        num_generations=GROUP, max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, loss_type="grpo", scale_rewards="group", learning_rate=LR, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.99, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, optim="adamw_torch_fused",
        max_steps=args.steps, logging_steps=1, save_strategy="no", report_to=[], use_cpu=not on_gpu, bf16=on_gpu,
        dataloader_num_workers=0, seed=0, disable_tqdm=True, log_completions=False, use_vllm=False,
        gradient_checkpointing=False, ddp_backend="gloo" if world > 1 else None)  # (TRL's default: on)
    steps = step_ends()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward.trl_share], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[steps])
    rollout_s, generate_s, tokens = [], [], []
    score, single_turn = trainer._generate_and_score_completions, trainer._generate_single_turn

    def timed_score(*a, **k):
        start = time.perf_counter()
        out = score(*a, **k)
        rollout_s.append(time.perf_counter() - start)
        return out

    def timed_single_turn(*a, **k):
        start = time.perf_counter()
        completion_ids, logprobs = single_turn(*a, **k)
        generate_s.append(time.perf_counter() - start)
        tokens.append(sum(len(ids) for ids in completion_ids))
        return completion_ids, logprobs

    trainer._generate_and_score_completions, trainer._generate_single_turn = timed_score, timed_single_turn
    trainer.train()
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(args.out, f"peer_rank{rank}.json").write_text(json.dumps({
        "step_times_s": steps.times(), "rollout_s": rollout_s, "generate_s": generate_s,
        "tokens": tokens}))


def framework_lengths(out: Path) -> list:
    """Each step's completions/mean_length (over every DP replica) from the run's TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return [e.value for e in events.Scalars("completions/mean_length")]


def measured(side: str, out: Path, world: int) -> dict:
    """The run's median step (steps 2..), rollout seconds and completion tokens per rollout second
    (global tokens over rank 0's rollout time: the ranks roll out side by side)."""
    if side in ("framework", "stale"):
        summary = json.loads((out / "summary.json").read_text())
        steps, rollout = summary["step_times_s"], summary["rollout_s"]
        tokens = [length * PROMPTS * GROUP for length in framework_lengths(out)]
    else:
        ranks = [json.loads((out / f"peer_rank{r}.json").read_text()) for r in range(world)]
        steps, rollout = ranks[0]["step_times_s"], ranks[0]["rollout_s"]
        tokens = [sum(r["tokens"][i] for r in ranks) for i in range(len(rollout))]
    step, roll = statistics.median(steps[1:]), statistics.median(rollout[1:])
    return {"step_s": step, "rollout_s": roll, "share": roll / step,
            "tokens_per_s": statistics.median(t / r for t, r in zip(tokens[1:], rollout[1:])),
            "mean_length": statistics.mean(tokens[1:]) / (PROMPTS * GROUP)}


def profile(data: dict, new: int, quiet_wait: float, threads: int) -> None:
    """The generation loops on one model and one step's prompts, in this process (`threads`), in
    turn for 5 rounds (medians), then each cProfile'd once:
    - framework: GroupRelativePolicy.rollout's call, generate_groups on the PROMPTS prompts side
      by side (PROMPTS x GROUP rows, left-padded, each prompt's own generator);
    - framework, a prompt at a time: generate_groups once per prompt (PROMPTS calls of GROUP rows;
      the rollout before 2026-12-04);
    - TRL: transformers' generate on the PROMPTS x GROUP left-padded rows, as GRPOTrainer's
      _generate_single_turn calls it (TRL's sampling settings: top_k 0, top_p 1)."""
    import cProfile
    import pstats

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from framework.checkpoint.weights import load_base
    from framework.models.decode import generate_groups
    from framework.models.hf import HFTransformer
    from framework.models.lifecycle import allocate

    torch.set_num_threads(threads)
    records = [json.loads(line) for line in Path(data["jsonl"]).read_text().splitlines()][:PROMPTS]
    tokenizer = AutoTokenizer.from_pretrained(data["model"])
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in records]
    ours = HFTransformer(data["model"])
    allocate(ours, "cpu", 0)
    load_base(ours, None, ours.hf_path)
    ours.eval()
    theirs = AutoModelForCausalLM.from_pretrained(data["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
    config = GenerationConfig(max_new_tokens=new, do_sample=True, pad_token_id=0, bos_token_id=1, eos_token_id=[0],
                              temperature=1.0, top_p=1.0, top_k=0, disable_compile=True)

    def framework_rollout():
        generators = [torch.Generator().manual_seed(i) for i in range(PROMPTS)]
        _, lengths = generate_groups(ours, prompts, GROUP, new, 1.0, 1.0, generators, {0}, 0)
        return int(lengths.sum())

    def framework_per_prompt():
        counts = 0
        for i, prompt in enumerate(prompts):
            _, lengths = generate_groups(ours, [prompt], GROUP, new, 1.0, 1.0, [torch.Generator().manual_seed(i)],
                                         {0}, 0)
            counts += int(lengths.sum())
        return counts

    def trl_rollout():
        rows = [p for p in prompts for _ in range(GROUP)]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            out = theirs.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:]
        stopped = (out == 0).int()
        return int(torch.where(stopped.any(1), stopped.argmax(1) + 1, out.shape[1]).sum())

    loops = {f"framework (1 generate_groups call of {PROMPTS} x {GROUP} rows)": framework_rollout,
             f"framework, a prompt at a time ({PROMPTS} calls of {GROUP} rows)": framework_per_prompt,
             f"TRL (transformers generate, {PROMPTS * GROUP} rows)": trl_rollout}
    for fn in loops.values():
        fn()  # warm up
    print(f"host idle before: {wait_for_quiet(quiet_wait):.0%}")
    times = {name: [] for name in loops}
    counts = {name: [] for name in loops}
    for _ in range(5):
        for name, fn in loops.items():
            start = time.perf_counter()
            counts[name].append(fn())
            times[name].append(time.perf_counter() - start)
    for name in loops:
        t, n = statistics.median(times[name]), statistics.median(counts[name])
        print(f"{name}: {t:.3f} s (runs {', '.join(f'{x:.2f}' for x in times[name])}) for {n:.0f} tokens, "
              f"{n / t:.0f} tokens/s")
    for name, fn in loops.items():
        print(f"\n== cProfile: {name}")
        profiler = cProfile.Profile()
        profiler.runcall(fn)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", default="full1,dp2")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="the model's width (default 256)")
    parser.add_argument("--layers", type=int, default=LAYERS, help="the model's blocks (default 4)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--staleness", type=int, default=0,
                        help="compare the framework at objective.max_staleness=K with itself at 0, not with TRL")
    parser.add_argument("--threads", type=int, default=2, help="--profile's torch threads")
    parser.add_argument("--quiet-wait", type=float, default=300.0,
                        help="seconds to wait before each run for the shared host to be >= 70%% idle")
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--jsonl", help=argparse.SUPPRESS)
    parser.add_argument("--reward", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        return run_peer(args)
    root = Path(tempfile.mkdtemp(prefix="bench_grpo_"))
    data = make_model_and_data(root, args.hidden, args.layers)
    if args.profile:
        return profile(data, args.max_new_tokens, args.quiet_wait, args.threads)
    rows = args.rows.split(",")
    other, other_name = ("stale", f"max_staleness={args.staleness}") if args.staleness else ("peer", "TRL")
    results = {row: {"framework": [], other: []} for row in rows}
    for repeat in range(args.repeats):
        for row in rows:
            sides = ["framework", other] if repeat % 2 == 0 else [other, "framework"]
            for side in sides:
                out = root / f"{row}_{side}_{repeat}"
                command = peer_cmd(row, data, args.steps, args.max_new_tokens, out) if side == "peer" else \
                    framework_cmd(row, data, args.steps, args.max_new_tokens, out,
                                  args.staleness if side == "stale" else 0)
                idle = wait_for_quiet(args.quiet_wait)
                ran = run_side(command)
                m = {**measured(side, out, 2 if row == "dp2" else 1), "idle_before": idle, **ran}
                results[row][side].append(m)
                print(f"repeat {repeat} {row:5s} {side:9s} {m['step_s']:.3f} s/step, rollout {m['rollout_s']:.3f} s "
                      f"({m['share']:.0%}), {m['tokens_per_s']:.0f} completion tokens/s, mean length "
                      f"{m['mean_length']:.1f}, peak RSS {m['peak_rss'] / 2**20:.0f} MiB; host idle before {idle:.0%}, "
                      f"others' CPU during {m['others_cpu']:.0%}",
                      flush=True)
    o = other_name
    print(f"\n| row | framework s/step | {o} s/step | framework / {o} | rollout share (framework, {o}) | "
          f"completion tokens/s (framework; {o}) | tokens/s framework / {o} | peak RSS MiB (framework, {o}) | "
          "others' CPU, most |\n|---|---|---|---|---|---|---|---|---|")
    for row, sides in results.items():
        f, p = sides["framework"], sides[other]
        mean = lambda rs, key: statistics.mean(r[key] for r in rs)  # noqa: E731
        listed = lambda rs, key, form: ", ".join(format(r[key], form) for r in rs)  # noqa: E731
        print(f"| {row} | {listed(f, 'step_s', '.3f')} | {listed(p, 'step_s', '.3f')} | "
              f"{mean(f, 'step_s') / mean(p, 'step_s'):.2f} | {mean(f, 'share'):.0%}, {mean(p, 'share'):.0%} | "
              f"{listed(f, 'tokens_per_s', '.0f')}; {listed(p, 'tokens_per_s', '.0f')} | "
              f"{mean(f, 'tokens_per_s') / mean(p, 'tokens_per_s'):.2f} | "
              f"{max(r['peak_rss'] for r in f) / 2**20:.0f}, {max(r['peak_rss'] for r in p) / 2**20:.0f} | "
              f"{max(r['others_cpu'] for r in f + p):.0%} |")
    (root / "grpo.json").write_text(json.dumps(results, indent=1))
    print(f"\n(raw: {root / 'grpo.json'})")


if __name__ == "__main__":
    main()
