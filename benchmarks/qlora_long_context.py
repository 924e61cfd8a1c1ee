"""The longest single sequence a QLoRA step trains within a GPU memory cap (Unsloth's long-context claim).

For each sequence length (longest last, or first with --longest-first) a process of its own builds the model (a
preset, random init, quantized on the GPU tensor by tensor) with every tiletune kernel and is capped at CAP GiB
(torch.cuda.set_per_process_memory_fraction, so going over is an out-of-memory error as on a card of that
size), activation checkpointing is planned within the cap (`gradient_checkpointing: auto` with offload
of the saved layer inputs to host memory), and one warm-up step and one timed step run on random tokens
(`--steps 1`: the timed step alone), batch 1. `--host-budget` sets the pinned host memory the offloaded inputs
may take (gradient_checkpointing_host_budget; a 70B at 90k tokens needs more than the default half of a 128 GiB
host). A length whose process dies (the kernel's out-of-memory killer, when pinned host memory runs out) is
recorded with its exit code and the next length still runs. Writes long_context.json (per length: fits or the
error, step seconds, peak GiB, the plan) and prints a table; the longest length that fits is the answer.

    python benchmarks/qlora_long_context.py --preset llama3-8b --cap 24 --seqs 32768,65536,98304 --out DIR
    python benchmarks/qlora_long_context.py --preset llama3-70b --cap 79 --seqs 90112,98304 --longest-first \
        --host-budget 100 --steps 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time

import torch

from tiletune.bench.worker import build_model
from tiletune.config import load_config
from tiletune.env import run_stamp
from tiletune.errors import UserError
from tiletune.train.model import autocast
from tiletune.train.recompute import plan_recomputation

GIB = 2**30


def one_length(model, seq: int, cap_gib: float, optimizer, host_gib: float | None, steps: int) -> dict:
    """Plan within the cap at `seq` tokens (the offloaded inputs within `host_gib` of pinned host memory), then
    `steps` steps (the last one timed: with 1, it includes the kernels' first compile at this length); peak memory
    of the last."""
    device = torch.device("cuda")
    vocab = model.get_base_model().config.vocab_size
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    torch.cuda.empty_cache()
    try:
        plan = plan_recomputation(model, 1, seq, torch.bfloat16, cap_gib, True, True, host_budget_gib=host_gib)
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            with autocast(device, torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return {"seq": seq, "fits": True, "step_s": times[-1], "peak_gib": torch.cuda.max_memory_allocated() / GIB,
                "loss": loss.item(), "plan": plan.summary()}
    except (torch.OutOfMemoryError, RuntimeError, UserError) as err:  # the planner's: nothing fits at this length
        return {"seq": seq, "fits": False, "error": str(err).splitlines()[0][:300]}
    finally:
        optimizer.zero_grad(set_to_none=True)


def measure(args, seq: int, queue) -> None:
    """In a process of its own: build the model quantized on the GPU with every kernel, cap the process at args.cap
    GiB, run `one_length` at `seq` tokens; put (its row, the kernels' report) on `queue`."""
    cfg = load_config(args.config, ["quantization_bit=4", "gradient_checkpointing=auto",
                                    "gradient_checkpointing_offload=true", f"gradient_checkpointing_budget={args.cap}"])
    torch.manual_seed(0)
    model, report = build_model(cfg, args.preset, "all", torch.device("cuda"))
    model.train()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap * GIB / total))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    queue.put((one_length(model, seq, args.cap, optimizer, args.host_budget, args.steps),
               report.to_dict()["ops"] if report else None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--config", default="examples/bench/llama3_8b_lora.yaml")
    parser.add_argument("--cap", type=float, default=24.0, help="GiB the process may allocate")
    parser.add_argument("--seqs", default="32768,65536,98304")
    parser.add_argument("--host-budget", type=float, default=None,
                        help="GiB of pinned host memory the offloaded inputs may take (default: half of what is free)")
    parser.add_argument("--steps", type=int, default=2, help="steps per length, the last timed (1: no warm-up)")
    parser.add_argument("--longest-first", action="store_true",
                        help="try the lengths longest first and stop at the first that fits (a 70B step at 90k "
                             "tokens takes minutes: one call cannot afford every length)")
    parser.add_argument("--out", default="benchmarks/results/qlora-long-context")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    result = {"preset": args.preset, "cap_gib": args.cap, "host_budget_gib": args.host_budget, "steps": args.steps,
              "rows": rows, "environment": run_stamp(), "kernels": None}
    context = multiprocessing.get_context("spawn")
    for seq in sorted((int(s) for s in args.seqs.split(",")), reverse=args.longest_first):
        # each length in a process of its own: a length that fails leaves no pinned buffers behind for the next, and
        # one the kernel's out-of-memory killer ends (host memory) is recorded instead of ending the run
        queue = context.Queue()
        worker = context.Process(target=measure, args=(args, seq, queue))
        worker.start()
        worker.join()
        if worker.exitcode == 0:
            row, result["kernels"] = queue.get(timeout=60)
        else:
            row = {"seq": seq, "fits": False,
                   "error": f"the process ended with exit code {worker.exitcode}" + (" (killed: host memory?)" if worker.exitcode == -9 else "")}
        rows.append(row)
        with open(os.path.join(args.out, "long_context.json"), "w") as handle:  # after each length: a timeout keeps the rest
            json.dump(result, handle, indent=1)
        if args.longest_first and row["fits"]:
            break
    print(f"| {args.preset} QLoRA, cap {args.cap:g} GiB | fits | step s | peak GiB |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['seq']:,} tokens | {'yes' if row['fits'] else 'no: ' + row['error'][:80]} | "
              f"{row.get('step_s', float('nan')):.2f} | {row.get('peak_gib', float('nan')):.1f} |")
    longest = max((r["seq"] for r in rows if r["fits"]), default=None)
    print(f"longest that fits: {longest} tokens ({result['environment']['device']}, commit {result['environment']['commit']})")


if __name__ == "__main__":
    main()
