"""The peer of bench/gpu.py's native rows: transformers' LlamaForCausalLM (SDPA) of the same shape
in a plain loop, as a user without the framework would write it: fp32 weights, bf16 autocast,
fused AdamW, grad clip 1.0, random tokens; eager or `torch.compile(model)`.

    python bench/gpu_peer.py --json out.json --dim 2048 --layers 16 --heads 32 --kv-heads 8 \\
        --hidden 8192 --vocab 128256 --seq 2048 --batch 8 --steps 10 [--compile] [--device cuda]

Writes the step times (from one step's end to the next, the loss read each step as the
framework's loop does), the first loss and the peak memory torch's allocator saw."""
import argparse
import json
import time

import torch


def build(args):
    """The model (fp32, on the device, tied as Llama 3.2 1B), what runs it and the optimizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.dim, intermediate_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                         max_position_embeddings=args.seq, rope_theta=500000.0, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    with torch.device(args.device):
        model = LlamaForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    return model, (torch.compile(model) if args.compile else model), optimizer


def train(args) -> dict:
    model, run, optimizer = build(args)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)

    def step() -> float:
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = run(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    losses, times = [], []
    start = time.perf_counter()
    for _ in range(args.steps):
        losses.append(step())
        now = time.perf_counter()
        times.append(now - start)
        start = now
    cuda = args.device == "cuda"
    return {"step_times_s": times, "losses": losses,
            "params": sum(p.numel() for p in model.parameters()),
            "max_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "max_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    for name in ("dim", "layers", "heads", "kv-heads", "hidden", "vocab", "seq", "batch", "steps"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    with open(args.json, "w") as f:
        json.dump(train(args), f)


if __name__ == "__main__":
    main()
