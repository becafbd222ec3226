"""How far below a peer's step any implementation of the same arithmetic could go: the share of
transformers' compiled training step (bench/peers.py's random 34M Llama, 8 x 256 tokens, fp32,
`torch.compile` of the whole model as Trainer's torch_compile=True, grad clip 1.0, fused AdamW)
spent in the matmuls and the attention kernel. Any framework training the same model on the same
tokens calls the same GEMMs and SDPA kernels (the framework's profile: the same `aten::mm` calls,
bench/README.md); only the rest (elementwise work, the optimizer, the loop) is anyone's to take,
so framework / peer cannot go below that share.

    .venv/bin/python bench/step_floor.py [--steps 5] [--threads 2]
"""
import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from peers import BATCH, HIDDEN, LAYERS, SEQ, VOCAB

# the same arithmetic whoever runs it: the GEMMs (forward and both backward products) and the
# fused attention kernel and its backward
FIXED = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
         "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=1376, num_hidden_layers=LAYERS, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=VOCAB, max_position_embeddings=SEQ * 2,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    model = torch.compile(LlamaForCausalLM(config).train())
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))

    def step() -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):  # compiles, then settles
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    events = {e.key: e for e in prof.key_averages()}
    fixed = {name: events[name].self_cpu_time_total / 1e6 / args.steps for name in FIXED if name in events}
    total = sum(e.self_cpu_time_total for e in events.values()) / 1e6 / args.steps
    step_s = statistics.median(times)
    print(f"step {step_s:.3f} s (median of {args.steps}, unprofiled); profiled: {total:.3f} s of ops a step")
    for name, seconds in fixed.items():
        print(f"  {name}: {seconds:.3f} s a step ({events[name].count // args.steps} calls)")
    rest = sorted((e for name, e in events.items() if name not in FIXED), key=lambda e: -e.self_cpu_time_total)
    print("the rest, the largest first:")
    for e in rest[:8]:
        print(f"  {e.key}: {e.self_cpu_time_total / 1e6 / args.steps:.3f} s a step ({e.count // args.steps} calls)")
    floor = sum(fixed.values())
    print(f"matmuls and attention: {floor:.3f} s a step, {floor / total:.2f} of the profiled ops: no implementation "
          f"of this step runs below {floor / total:.2f} of it")


if __name__ == "__main__":
    main()
