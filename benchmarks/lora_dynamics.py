"""Which bf16 LoRA step follows float32 training from peft's init (B = 0): stock peft or lora_linear?

In the H200 ablation of 2026-12-03 every variant with `lora_linear` lost loss several times faster
over the first steps than stock peft (and Liger, which keeps peft's LoRA). The suspect is rounding:
under bf16 autocast peft rounds the base output x Wᵀ to bf16 and then adds the LoRA term s·(x Aᵀ) Bᵀ
in bf16, so while B is small (it starts at 0) the update is mostly below half a bf16 step of the
output and vanishes; lora_linear adds both in the float32 accumulator and rounds once.

This runs `--steps` AdamW steps (lr 1e-4, as `tiletune bench`) of the same model and batch: float32
compute on the same (bf16-valued) weights as the truth, stock peft in bf16, lora_linear's reference
(peft's rounding), lora_linear's TileLang wrappers over linear.torch_gemm (the kernel's arithmetic in
PyTorch: runs anywhere) and, on a GPU, the TileLang kernels themselves; it prints each loss curve and
its loss drop as a share of the truth's.

    python benchmarks/lora_dynamics.py [--preset llama3-8b --layers 2 --vocab 32000 --batch 2 --seq 256]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from tiletune.train.presets import preset_config
from tiletune.config import load_config
from tiletune.env import run_stamp
from tiletune.kernels import linear, lora_linear, registry
from tiletune.train.model import autocast, compute_dtype, prepare_for_training
from tiletune.patch import apply_kernels, parse_kernel_spec

CONFIG = "examples/bench/llama3_8b_lora.yaml"


def register_emulation() -> str:
    """Register lora_linear's TileLang wrappers over linear.torch_gemm (the kernel's float32 arithmetic in
    PyTorch) as an implementation; returns its name."""
    def on_torch_gemm(wrapper):
        def run(*inputs):
            kernel_gemm, linear.run_gemm = linear.run_gemm, linear.torch_gemm
            try:
                return wrapper(*inputs)
            finally:
                linear.run_gemm = kernel_gemm
        return run

    registry.add(registry.Impl("lora_linear", "torch_gemm", on_torch_gemm(lora_linear.tilelang_forward),
                               on_torch_gemm(lora_linear.tilelang_backward),
                               description="TileLang wrappers over linear.torch_gemm", accumulation="float32"))
    return "torch_gemm"


def losses(args, impl: str | None, truth: bool, device: torch.device) -> list[float]:
    """Loss of each of args.steps AdamW steps; `truth` computes in float32 without autocast."""
    cfg = load_config(CONFIG)
    shape = preset_config(args.preset)
    shape.num_hidden_layers, shape.vocab_size = args.layers, args.vocab
    torch.manual_seed(0)
    with device:  # as `tiletune bench` builds a preset
        model = prepare_for_training(cfg, AutoModelForCausalLM.from_config(shape, dtype=compute_dtype(cfg)))
    if truth:
        model.float()
    if impl is not None:
        apply_kernels(model, parse_kernel_spec({"lora_linear": impl, "strict": True}))
    batch = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    curve = []
    for _ in range(args.steps):
        with autocast(device, torch.float32 if truth else torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        curve.append(loss.item())
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runs = {"float32 (truth)": (None, True), "stock peft, bf16": (None, False),
            "lora_linear reference, bf16": ("reference", False),
            "lora_linear TileLang wrappers on torch_gemm, bf16": (register_emulation(), False)}
    if device.type == "cuda":
        runs["lora_linear TileLang, bf16"] = ("tilelang", False)
    curves = {name: losses(args, impl, truth, device) for name, (impl, truth) in runs.items()}
    truth = curves["float32 (truth)"]
    drop = truth[0] - truth[-1]
    stamp = run_stamp()
    print(f"{stamp['device']}, torch {stamp['torch']}, {stamp['date']}, commit {stamp['commit']}: {args.preset} shape, "
          f"{args.layers} layers, vocab {args.vocab}, batch {args.batch} x {args.seq}, LoRA r8 q_proj,v_proj\n")
    print("| run | " + " | ".join(f"loss {i + 1}" for i in range(args.steps)) + " | loss drop vs truth's |")
    print("|---" * (args.steps + 2) + "|")
    for name, curve in curves.items():
        print(f"| {name} | " + " | ".join(f"{x:.5f}" for x in curve) + f" | {(curve[0] - curve[-1]) / drop:.2f} |")


if __name__ == "__main__":
    main()
