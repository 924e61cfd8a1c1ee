"""Generation on the eval set (`do_predict` + `predict_with_generate`), as LLaMA-Factory writes it:
`generated_predictions.jsonl` (prompt, predict, label per line) and `predict_results.json` (scores)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tiletune.config import TuneConfig
from tiletune.data.templates import Template
from tiletune.train.metrics import score_predictions


def generation_config(cfg: TuneConfig, tokenizer, template: Template):
    """The GenerationConfig from the config's generation keys, stopping at the template's stop words."""
    from transformers import GenerationConfig

    sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k) if cfg.do_sample else {}
    return GenerationConfig(
        do_sample=cfg.do_sample,
        num_beams=cfg.num_beams,
        max_new_tokens=cfg.max_new_tokens,
        repetition_penalty=cfg.repetition_penalty,
        length_penalty=cfg.length_penalty,
        eos_token_id=template.stop_token_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        **sampling,
    )


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[list[int]], gen_config, batch_size: int) -> list[str]:
    """Decoded answers for token-id prompts, batched with left padding, longest prompts first."""
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    answers: list[str] = [""] * len(prompts)
    bar = tqdm(total=len(prompts), desc="predict", dynamic_ncols=True)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, index in enumerate(batch):
            ids = prompts[index]
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
        output = model.generate(
            input_ids=input_ids.to(device), attention_mask=attention.to(device), generation_config=gen_config
        )
        for row, index in enumerate(batch):
            answers[index] = tokenizer.decode(output[row, width:], skip_special_tokens=True).strip()
        bar.update(len(batch))
    bar.close()
    return answers


def run_predict(cfg: TuneConfig, model, tokenizer, template: Template, dataset, output_dir: Path) -> dict:
    """Generate for every example of `dataset`, write the two prediction files, return the scores."""
    model.eval()
    model.config.use_cache = True
    started = time.perf_counter()
    answers = generate_answers(
        model,
        tokenizer,
        dataset["input_ids"],
        generation_config(cfg, tokenizer, template),
        cfg.train_arg("per_device_eval_batch_size", 8),
    )
    references = dataset["reference"]
    with (output_dir / "generated_predictions.jsonl").open("w", encoding="utf-8") as handle:
        for prompt, answer, reference in zip(dataset["prompt_text"], answers, references):
            handle.write(json.dumps({"prompt": prompt, "predict": answer, "label": reference}, ensure_ascii=False) + "\n")
    results = score_predictions(answers, references)
    results["predict_samples"] = len(answers)
    results["predict_runtime"] = round(time.perf_counter() - started, 2)
    (output_dir / "predict_results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results
