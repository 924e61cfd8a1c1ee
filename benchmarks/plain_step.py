"""An independent timing of the reference training step, written without tiletune, to check `tiletune bench`.

Llama-3-8B shape (random init), batch x seq random tokens, bf16 autocast with bf16 base weights, peft LoRA
(fp32 adapters), gradient checkpointing, AdamW; optional Liger-Kernel. Prints the median step time and the
peak memory allocated after warm-up.

    python benchmarks/plain_step.py [--lora-target q_proj,v_proj] [--liger] [--reentrant]
"""

import argparse
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--lora-target", default="q_proj,v_proj")
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--seq", type=int, default=2048)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--liger", action="store_true")
parser.add_argument("--reentrant", action="store_true", help="re-entrant checkpointing (LLaMA-Factory's default)")
args = parser.parse_args()

if args.liger:
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama()
config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
model.config.use_cache = False
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": args.reentrant})
model.enable_input_require_grads()
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=args.lora_target.split(","), task_type="CAUSAL_LM"))
for param in model.parameters():
    if param.requires_grad:
        param.data = param.data.float()
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")
times = []
for step in range(args.warmup + args.steps):
    if step == args.warmup:
        torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    if step >= args.warmup:
        times.append(time.perf_counter() - start)
print(f"plain step: median {statistics.median(times):.3f} s (min {min(times):.3f}, max {max(times):.3f}), "
      f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB, liger={args.liger}, reentrant={args.reentrant}, "
      f"lora_target={args.lora_target}")
