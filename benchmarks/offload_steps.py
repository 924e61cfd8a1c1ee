"""Activation offload on the reference step: step times, late fetches, and the CUDA runtime calls and copies of
one profiled step. `python benchmarks/offload_steps.py BUDGET_GIB` on a GPU (the fastest kernel set, LoRA q,v)."""
import sys, time, torch
from tiletune.bench.worker import build_model
from tiletune.config import load_config
from tiletune.train.model import autocast
from tiletune.train.recompute import plan_recomputation
from tiletune.patch import decoder_layers
budget = float(sys.argv[1])
cfg = load_config("examples/bench/llama3_8b_lora.yaml", ["gradient_checkpointing=auto", "gradient_checkpointing_offload=true", f"gradient_checkpointing_budget={budget}"])
dev = torch.device("cuda")
torch.manual_seed(0)
model, _ = build_model(cfg, "llama3-8b", "rms_norm+rope+swiglu+linear_cross_entropy+lora_linear", dev)
plan = plan_recomputation(model, 4, 2048, torch.bfloat16, budget, True, True)
print(plan.summary())
_, layers = decoder_layers(model)
off = next(l._gradient_checkpointing_func.func.__self__ for l in layers if getattr(l, "_gradient_checkpointing_func", None) is not None and hasattr(l._gradient_checkpointing_func, "func") and hasattr(l._gradient_checkpointing_func.func, "__self__"))
ids = torch.randint(0, 128256, (4, 2048), device=dev)
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
model.train()
def step():
    with autocast(dev, torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
for i in range(6):
    torch.cuda.synchronize(); late = off.late_fetches; t = time.perf_counter(); step(); torch.cuda.synchronize()
    print(f"step {i}: {time.perf_counter()-t:.3f} s, late fetches {off.late_fetches-late}, offloaded {off.bytes_offloaded/2**30:.2f} GiB")
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
rows = [e for e in prof.key_averages() if e.key.startswith("cuda") or e.key.startswith("cu")]
for e in sorted(rows, key=lambda e: -e.cpu_time_total)[:10]:
    print(f"{e.key:40s} calls {e.count:6d} cpu {e.cpu_time_total/1e3:8.1f} ms")
mem = [e for e in prof.key_averages() if "Memcpy" in e.key]
for e in mem: print(f"{e.key:40s} calls {e.count:6d} device {e.device_time_total/1e3:8.1f} ms")
