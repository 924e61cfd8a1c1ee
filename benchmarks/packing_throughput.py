"""Non-padding tokens per second of training steps: stock padded batches against `neat_packing`, stock and with kernels.

LLaMA-Factory's alpaca_en_demo (1000 examples), llama3 template, cutoff_len 2048, batch 4: the same
examples batched as `tiletune train` batches them, unpacked (padded to the longest in the batch) and with
`neat_packing: true` (packed into sequences of at most cutoff_len, each batch one row without padding).
A third mode, `neat_packing` with tiletune's kernels (`--kernels`, default the fastest set plus attention,
whose varlen kernel runs the packed sequences where stock SDPA gets a block-diagonal mask), patches the same model
last. The model is a random-init preset set up as the config says (LoRA, gradient checkpointing, bf16), built
once and trained in every mode; batches are drawn in one seeded order, warm-up steps dropped, every step
timed with the device synchronised. The tokenizer is the demo model's (examples/tiny-llama: a 632-token
BPE with the Llama-3 special tokens; no download), so sequences are longer than Llama-3's tokenizer makes them.

    python benchmarks/packing_throughput.py --out DIR                                     # GPU, llama3-8b
    python benchmarks/packing_throughput.py --preset tiny --cutoff-len 256 --steps 3      # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from tiletune.bench.worker import build_model, variant_kernels
from tiletune.config import load_config
from tiletune.data.collator import data_collator
from tiletune.data.processing import build_splits
from tiletune.data.templates import get_template
from tiletune.env import run_stamp
from tiletune.patch import apply_kernels, parse_kernel_spec
from tiletune.patch.warmup import compile_ahead
from tiletune.train.model import autocast, compute_dtype, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
FASTEST_PACKED = "rms_norm+rope+swiglu+linear_cross_entropy+lora_linear+attention"  # the fastest set + varlen attention
GIB = 2**30


def batches(cfg, seed: int):
    """The training batches of cfg's data, as the Trainer's collator makes them, in a seeded order."""
    tokenizer = load_tokenizer(cfg)
    template = get_template(cfg.template, tokenizer, cfg.stage, cfg.default_system)
    template.fix_tokenizer(tokenizer)
    splits = build_splits(cfg, tokenizer, template)
    loader = torch.utils.data.DataLoader(splits.train, batch_size=cfg.train_arg("per_device_train_batch_size"),
                                         shuffle=True, generator=torch.Generator().manual_seed(seed),
                                         collate_fn=data_collator(cfg, tokenizer))  # fmt: skip
    return loader, splits.stats


def non_padding_tokens(batch: dict) -> int:
    """Tokens that are not padding: the attention mask's ones, or every token of a padding-free batch."""
    return int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()


def run_mode(model, optimizer, loader, device: torch.device, dtype: torch.dtype, warmup: int, steps: int | None) -> dict:
    """Train on the loader's batches; tokens, seconds and peak memory of the steps after the warm-up."""
    tokens = positions = timed = 0
    seconds = 0.0
    for index, batch in enumerate(loader):
        if steps is not None and index >= warmup + steps:
            break
        if index == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast(device, dtype):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if index >= warmup:
            seconds += time.perf_counter() - start
            tokens += non_padding_tokens(batch)
            positions += batch["input_ids"].numel()
            timed += 1
    peak = torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else float("nan")
    return {"steps": timed, "tokens": tokens, "padding": 1 - tokens / max(positions, 1), "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else float("nan"), "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--config", default=str(REPO / "examples/bench/llama3_8b_lora.yaml"))
    parser.add_argument("--dataset-dir", default=str(REPO.parent / "shared/compat/llamafactory/data"))
    parser.add_argument("--tokenizer", default=str(REPO / "examples/tiny-llama"))
    parser.add_argument("--cutoff-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, help="timed steps per mode (default: the rest of the epoch)")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation, e.g. flash_attention_2 (varlen)")
    parser.add_argument("--kernels", default=FASTEST_PACKED,
                        help="kernels of the third mode, neat_packing patched, as a bench variant names them (all, or "
                             "ops joined by +; '' skips the mode)")
    parser.add_argument("--out", help="folder for packing_throughput.json")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    common = [f"model_name_or_path={args.tokenizer}", "dataset=alpaca_en_demo", f"dataset_dir={args.dataset_dir}",
              "template=llama3", f"cutoff_len={args.cutoff_len}", f"per_device_train_batch_size={args.batch}",
              *([] if device.type == "cuda" else ["bf16=false"])]  # fmt: skip
    modes = {"unpacked": [], "neat_packing": ["neat_packing=true"]}
    if args.kernels:
        modes["neat_packing+kernels"] = modes["neat_packing"]
    cfgs = {mode: load_config(args.config, common + extra) for mode, extra in modes.items()}
    torch.manual_seed(0)
    model, _ = build_model(cfgs["unpacked"], args.preset, "baseline", device)
    model.get_base_model().set_attn_implementation(args.attn)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rows = {}
    for mode, cfg in cfgs.items():
        report = None
        if mode.endswith("+kernels"):  # last: the same model and optimizer state, patched
            spec = parse_kernel_spec(variant_kernels(args.kernels))
            compile_ahead(model, spec, compute_dtype(cfg))
            report = apply_kernels(model, spec)
        loader, stats = batches(cfg, seed=0)
        rows[mode] = {**stats, "batches": len(loader),
                      **run_mode(model, optimizer, loader, device, compute_dtype(cfg), args.warmup, args.steps)}  # fmt: skip
        if report is not None:  # the calls that did not run a kernel (e.g. attention left to SDPA), with the reason
            rows[mode]["runtime_fallbacks"] = report.runtime_fallbacks()
    speedups = {mode: row["tokens_per_s"] / rows["unpacked"]["tokens_per_s"] for mode, row in rows.items() if mode != "unpacked"}
    print(f"| {args.preset}, {args.attn}, batch {args.batch}, cutoff_len {args.cutoff_len} | examples | rows | batches | "
          "timed steps | padding | non-padding tokens/s | peak GiB |\n|---|---|---|---|---|---|---|---|")
    for mode, row in rows.items():
        print(f"| {mode} | {row['train_examples']} | {row.get('train_sequences', row['train_examples'])} | "
              f"{row['batches']} | {row['steps']} | {row['padding']:.1%} | {row['tokens_per_s']:,.0f} | {row['peak_gib']:.1f} |")
    for mode, speedup in speedups.items():
        print(f"{mode} / unpacked: {speedup:.2f}x")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        result = {"preset": args.preset, "attn": args.attn, "batch": args.batch, "cutoff_len": args.cutoff_len,
                  "kernels": args.kernels, "modes": rows, "speedup": speedups, "environment": run_stamp()}  # fmt: skip
        Path(args.out, "packing_throughput.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
