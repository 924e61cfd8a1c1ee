"""One benchmark variant in its own process: build the model, apply the variant, time training steps.

Run by `tiletune bench` as `python -m tiletune.bench.worker JSON`; prints one line `BENCH_RESULT {...}`.
A step is forward + backward + optimizer step on a fixed batch of random tokens (the same seed in
every variant; a preference stage's step is its trainer's, bench/preference.py), timed with the device synchronised; warm-up steps are dropped, and peak memory is
counted from the end of the warm-up.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from tiletune.bench import preference, unsloth
from tiletune.config import TuneConfig, load_config
from tiletune.errors import UserError
from tiletune.train.model import autocast, compute_dtype, prepare_for_training
from tiletune.train.preference import sequences

RESULT_PREFIX = "BENCH_RESULT "


def split_variant(variant: str) -> tuple[str, list[str]]:
    """`NAME[:key=value...]` -> (NAME, overrides): a variant may change config keys, e.g. `all:gradient_checkpointing=auto`."""
    name, *overrides = variant.split(":")
    return name, overrides


# the stock model, patched by Liger-Kernel, on bitsandbytes' 4-bit Linears, with LLaMA-Factory's preference log-probs,
# patched by Liger-Kernel with its fused linear preference loss (bench/preference.py), Unsloth's (bench/unsloth.py)
PEER_VARIANTS = ("baseline", "liger", "bnb", "llamafactory", preference.LIGER_FUSED, unsloth.NAME)


def variant_kernels(variant: str):
    """The `kernels:` spec a variant name stands for (None for the stock model and the peers')."""
    if variant in PEER_VARIANTS:
        return None
    if variant == "all":
        return "all"
    # the op alone (or ops joined by +), each at its default implementation or the one after `=`
    return {op: impl or True for op, _, impl in (part.partition("=") for part in variant.split("+"))}


def liger_patch(model_config, variant: str = "liger") -> str:
    """The name of Liger-Kernel's patch function for this model's family (from its family record)."""
    from tiletune.families import family_of

    family = family_of(model_config)
    if family is None or family.liger is None:
        raise UserError(f"bench variant {variant!r}: no Liger-Kernel patch known for model_type {model_config.model_type!r}")
    return family.liger


def build_model(cfg: TuneConfig, preset: str | None, variant: str, device: torch.device, seed: int = 0,
                layers: int | None = None):
    """The model for one variant: a random-init preset or `model_name_or_path`, set up to train.

    With quantization_bit, a preset is built quantized one tensor at a time on the device (tiletune's
    QuantLinear); the `bnb` variant then moves the same packed weights into bitsandbytes' Linear4bit (the peft
    + bitsandbytes QLoRA a user would run instead).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiletune.train.model import load_model, load_tokenizer
    from tiletune.train.presets import preset_config, preset_model

    model_config = preset_config(preset) if preset else AutoConfig.from_pretrained(cfg.model_name_or_path)  # for Liger
    if variant in ("liger", preference.LIGER_FUSED):
        import liger_kernel.transformers as liger

        getattr(liger, liger_patch(model_config, variant))()  # patches the model classes: before building
    if variant == "bnb" and not cfg.quantization_bit:
        raise UserError("bench variant 'bnb' is peft + bitsandbytes QLoRA: give it quantization_bit=4 (bnb:quantization_bit=4)")
    if preset:
        model = preset_model(cfg, preset, device, layers, seed)
    elif cfg.quantization_bit:
        model = load_model(cfg, load_tokenizer(cfg), trainable=False).train()
    else:
        model = AutoModelForCausalLM.from_pretrained(cfg.model_name_or_path, dtype=compute_dtype(cfg)).to(device)
    if variant == "bnb":
        bitsandbytes_linears(model)
    model = prepare_for_training(cfg, model)
    spec = variant_kernels(variant)
    report = None
    if spec is not None:
        from tiletune.patch import apply_kernels, parse_kernel_spec
        from tiletune.patch.warmup import compile_ahead

        spec = parse_kernel_spec(spec)
        compile_ahead(model, spec, compute_dtype(cfg))
        report = apply_kernels(model, spec)
    return model, report


def bitsandbytes_linears(model: torch.nn.Module) -> None:
    """Replace every QuantLinear of `model` by bitsandbytes' Linear4bit holding the same packed bytes and quant
    state (tiletune's 4-bit format is bitsandbytes'; int8 has no such counterpart here)."""
    import bitsandbytes as bnb

    from tiletune.kernels.quant_linear import QuantLinear
    from tiletune.quant import to_bnb

    for name, module in list(model.named_modules()):
        if not isinstance(module, QuantLinear):
            continue
        q = module.quantized
        if q.kind == "int8":
            raise UserError("bench variant 'bnb' runs 4-bit weights (quantization_bit=4), not int8")
        tensors = to_bnb(q, "w")
        layer = bnb.nn.Linear4bit(q.shape[1], q.shape[0], bias=module.bias is not None, compute_dtype=q.dtype,
                                  quant_type=q.kind, device=q.data.device)
        layer.weight = bnb.nn.Params4bit.from_prequantized(tensors.pop("w"), {k[2:]: v for k, v in tensors.items()},
                                                           requires_grad=False, device=q.data.device)
        layer.bias = module.bias
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)


def step_flops(model_config, trainable_linear: int, tokens: int, seq: int, recomputed: float,
               forward_only_tokens: int = 0) -> float:  # fmt: skip
    """Floating-point operations of one training step, counted from the model's shape (`tokens` trained, and
    `forward_only_tokens` run forward without gradient: a preference step's reference).

    Matmuls: 2 per weight per token forward, the same again for the input gradient, 2 per trainable
    weight per token for weight gradients, and the decoder's forward once more for the `recomputed`
    share of layers (1 under checkpointing; selective layers recompute no matmul and count 0).
    Causal attention: 2·S·d per token per layer forward (QKᵀ and AV, half the square), 2x that backward.
    """
    c = model_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q_dim, kv_dim = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    per_layer = c.hidden_size * (2 * q_dim + 2 * kv_dim) + 3 * c.hidden_size * c.intermediate_size
    decoder, head = c.num_hidden_layers * per_layer, c.hidden_size * c.vocab_size
    attention = c.num_hidden_layers * 2 * seq * q_dim  # forward, per token
    forward = 2 * (decoder + head) + attention
    backward = 2 * (decoder + head) + 2 * attention + 2 * trainable_linear
    recompute = recomputed * (2 * decoder + attention)
    return float(tokens) * (forward + backward + recompute) + float(forward_only_tokens) * forward


def run(job: dict) -> dict:
    """Time `job['steps']` training steps of one variant after `job['warmup']`; returns the measurements."""
    name, variant_overrides = split_variant(job["variant"])
    cfg = load_config(job["config"], [*job.get("overrides", []), *variant_overrides])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(job["seed"])
    batch, seq = job["batch"], job["seq"]
    if name == unsloth.NAME:
        model, report = unsloth.unsloth_model(cfg, job.get("preset"), job.get("layers"), job["seed"], seq, device), None
    else:
        model, report = build_model(cfg, job.get("preset"), name, device, job["seed"], job.get("layers"))
    plan = None
    if cfg.checkpointing == "auto":
        from tiletune.train.preference import recompute_probe
        from tiletune.train.recompute import plan_recomputation

        rows, probe_loss = recompute_probe(cfg, batch)
        plan = plan_recomputation(model, rows, seq, compute_dtype(cfg), cfg.gradient_checkpointing_budget,
                                  cfg.use_reentrant_gc, cfg.gradient_checkpointing_offload, probe_loss,
                                  host_budget_gib=cfg.gradient_checkpointing_host_budget)
    dtype = compute_dtype(cfg)
    model.train()
    if cfg.stage in preference.STAGES:
        forward_backward = preference.preference_step(cfg, model, name, batch, seq, job["seed"], lambda: autocast(device, dtype))
        trained, forward_only = sequences(cfg)
    else:
        generator = torch.Generator().manual_seed(job["seed"])
        input_ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator).to(device)
        trained, forward_only = 1, 0

        def forward_backward() -> torch.Tensor:
            with autocast(device, dtype):
                loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            return loss

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")

    def train_step() -> torch.Tensor:
        loss = forward_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    times, host_times, losses = [], [], []
    for step in range(job["warmup"] + job["steps"]):
        if step == job["warmup"] and device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        _sync(device)
        start = time.perf_counter()
        loss = train_step()
        queued = time.perf_counter() - start
        _sync(device)
        elapsed = time.perf_counter() - start
        losses.append(loss.item())
        if step >= job["warmup"]:
            times.append(elapsed)
            host_times.append(queued)
    peak_allocated, peak_reserved = _peak_memory(device)

    trainable_linear = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.requires_grad
    )
    base_config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    result = {
        "variant": job["variant"],
        "step_times": times,
        # seconds until each timed step's Python returned, before the closing synchronise: near step_times when the
        # host sets the pace (or waits for the GPU inside the step), well below it when the GPU does
        "step_host_times": host_times,
        "losses": losses,
        "tokens_per_step": trained * batch * seq,
        "flops_per_step": step_flops(base_config, trainable_linear, trained * batch * seq, seq, _recomputed_share(cfg, plan),
                                     forward_only * batch * seq),
        "patched": report.to_dict() if report is not None else None,
        "recompute": plan.to_dict() if plan is not None else None,
        "peak_allocated_gib": peak_allocated,
        "peak_reserved_gib": peak_reserved,
    }
    if job.get("profile") and device.type == "cuda":  # two more steps, after the timed ones and the memory reading
        from tiletune.bench.profile import memory_peak, profile_step

        result["profile"] = {**profile_step(train_step), "memory": memory_peak(train_step)}
    return result


def _peak_memory(device: torch.device) -> tuple[float, float]:
    """(allocated, reserved) peak GiB since the end of the warm-up (the process's peak RSS on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
    from tiletune.train.callbacks import peak_memory_gib

    return peak_memory_gib(), peak_memory_gib()


def _recomputed_share(cfg: TuneConfig, plan) -> float:
    if plan is not None:
        return (plan.counts["recompute"] + plan.counts["recompute_device"]) / len(plan.treatments)
    return 0.0 if cfg.checkpointing == "off" else 1.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_matmul_peak(size: int = 8192, repeats: int = 20) -> float:
    """bf16 matmul TFLOP/s on this GPU (median of `repeats` products after warm-up); 0 without a GPU."""
    if not torch.cuda.is_available():
        return 0.0
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    timings = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        timings.append(start.elapsed_time(end) / 1000)
    timings.sort()
    return 2 * size**3 / timings[len(timings) // 2] / 1e12


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    if split_variant(job["variant"])[0] == unsloth.NAME:  # nothing above imported transformers or peft yet
        unsloth.preload()
    if job.get("variant") == "matmul_peak":
        print(RESULT_PREFIX + json.dumps({"matmul_peak_tflops": measure_matmul_peak()}), flush=True)
    else:
        print(RESULT_PREFIX + json.dumps(run(job)), flush=True)
