"""Preference stages: dpo (losses against TRL's and hand-written formulas), kto (with pref_ftx), rm; the log-probs from
tiletune's linear_logprobs equal TRL's fused head's; key checks; LLaMA-Factory's configs; the offline DPO demo."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from click.testing import CliRunner

from tiletune.cli import main
from tiletune.config import build_config

pytest.importorskip("trl")

RECORDS = [  # alpaca ranking: the chosen answer repeats the letters, the rejected one reverses them
    {"instruction": f"Repeat: {w}", "chosen": w, "rejected": " ".join(reversed(w.split()))}
    for w in ("a b c", "d e f g", "h i", "j k l m n", "o p q", "r s t u", "v w", "x y z")
]
VENDORED = Path(__file__).parent / "compat" / "examples"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def dpo_config(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    data.mkdir()
    (data / "pairs.json").write_text(json.dumps(RECORDS))
    feedback = [{"instruction": r["instruction"], "output": r[key], "good": key == "chosen"}
                for r in RECORDS for key in ("chosen", "rejected")]  # fmt: skip
    (data / "feedback.json").write_text(json.dumps(feedback))
    (data / "dataset_info.json").write_text(json.dumps({
        "pairs": {"file_name": "pairs.json", "ranking": True},
        "feedback": {"file_name": "feedback.json", "columns": {"kto_tag": "good"}},
    }))

    def make(**keys):
        raw = {"model_name_or_path": str(tiny_model_dir), "stage": "dpo", "do_train": True, "finetuning_type": "lora",
               "dataset": "pairs", "dataset_dir": str(data), "template": "llama3", "cutoff_len": 32,
               "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "learning_rate": 5e-3,
               "max_steps": 4, "logging_steps": 1, "save_steps": 100, "plot_loss": True, "report_to": "none",
               "disable_gradient_checkpointing": True, **keys}  # fmt: skip
        return build_config(raw, source="test")

    return make


def _trainer_and_batch(cfg, tmp_path):
    """The run's trainer (as `tiletune train` builds it) and a collated batch of 4 pairs."""
    from transformers import set_seed

    from tiletune.data.processing import build_splits
    from tiletune.data.templates import get_template
    from tiletune.train.model import load_model, load_tokenizer
    from tiletune.train.trainer import _make_trainer

    set_seed(0)
    tokenizer = load_tokenizer(cfg)
    template = get_template(cfg.template, tokenizer, cfg.stage)
    template.fix_tokenizer(tokenizer)
    splits = build_splits(cfg, tokenizer, template)
    model = load_model(cfg, tokenizer, trainable=True)
    with torch.no_grad():  # a LoRA that is not zero: policy and reference differ
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    trainer = _make_trainer(cfg, model, tokenizer, splits, tmp_path / "out")
    batch = trainer.data_collator([splits.train[i] for i in range(4)])
    model.eval()
    return trainer, batch


@pytest.mark.parametrize("keys", [{"pref_loss": "sigmoid"}, {"pref_loss": "orpo"}, {"pref_loss": "simpo"},
                                  {"stage": "kto", "dataset": "feedback", "kto_rejected_weight": 0.8}])
def test_preference_stages_train_and_log_rewards(dpo_config, keys):
    from tiletune.train.trainer import run_train

    cfg = dpo_config(**keys)
    run_train(cfg)
    history = json.loads((cfg.output_dir / "trainer_state.json").read_text())["log_history"]
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses))) and len(set(losses)) > 1
    logged = ("rewards/chosen", "rewards/rejected", "rewards/margins") + (("kl",) if cfg.stage == "kto" else ("rewards/accuracies",))
    assert all(key in history[0] for key in logged)
    assert (cfg.output_dir / "trainer_log.jsonl").is_file() and (cfg.output_dir / "training_loss.png").is_file()
    assert (cfg.output_dir / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("pref_loss", ["sigmoid", "hinge", "ipo"])
def test_llamafactory_formula_equals_trl_loss(dpo_config, tmp_path, pref_loss):
    """tiletune's own path (taken with pref_ftx or label smoothing) computes TRL's loss where both define it."""
    from trl import DPOTrainer

    trainer, batch = _trainer_and_batch(dpo_config(pref_loss=pref_loss), tmp_path)
    assert trainer.native
    with torch.no_grad():
        trl_loss = DPOTrainer._compute_loss(trainer, trainer.model, batch, return_outputs=False)
        ours = trainer._llamafactory_loss(trainer.model, batch)
    assert trl_loss.item() != pytest.approx(0.0) and ours.item() == pytest.approx(trl_loss.item(), rel=1e-5)


def _answer_logps(model, batch, average: bool):
    """Chosen and rejected answers' log-probs from the full logits, summed or averaged per token."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    token_logps = logits.log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["completion_mask"][:, 1:]
    logps = (token_logps * mask).sum(1) / (mask.sum(1) if average else 1)
    return logps.chunk(2)


@pytest.mark.parametrize("pref_loss", ["orpo", "simpo"])
def test_reference_free_losses_match_their_formulas(dpo_config, tmp_path, pref_loss):
    beta, gamma, ftx = 0.2, 0.7, 0.3
    keys = {"pref_beta": beta, "pref_ftx": ftx} | ({"simpo_gamma": gamma} if pref_loss == "simpo" else {})
    trainer, batch = _trainer_and_batch(dpo_config(pref_loss=pref_loss, **keys), tmp_path)
    with torch.no_grad():
        c, r = _answer_logps(trainer.model, batch, average=True)
        if pref_loss == "orpo":
            log_odds = (c - r) - (torch.log(1 - c.exp()) - torch.log(1 - r.exp()))
            expected = -c - beta * F.logsigmoid(log_odds)
        else:
            expected = -F.logsigmoid(beta * (c - r) - gamma)
        expected = (expected - ftx * c).mean()
        loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def _loss_and_lora_grads(trainer, batch):
    loss = trainer.compute_loss(trainer.model, batch)
    lora = [p for name, p in trainer.model.named_parameters() if "lora_" in name]
    return loss.detach(), torch.autograd.grad(loss, lora)


@pytest.mark.parametrize("keys", [{"pref_loss": "sigmoid"}, {"pref_loss": "simpo", "pref_ftx": 0.3},
                                  {"stage": "kto", "dataset": "feedback", "kto_rejected_weight": 0.8}])  # fmt: skip
def test_linear_logprobs_gives_trls_loss_and_lora_gradients(dpo_config, tmp_path, monkeypatch, keys):
    """`kernels: {linear_logprobs: chunked}`: policy, reference (and KTO's KL answers) through tiletune's op."""
    from tiletune.kernels import customop

    trl_loss, trl_grads = _loss_and_lora_grads(*_trainer_and_batch(dpo_config(**keys), tmp_path))
    calls = []
    select = customop.select
    monkeypatch.setattr(customop, "select", lambda op, *args: calls.append(op) or select(op, *args))
    trainer, batch = _trainer_and_batch(dpo_config(kernels={"linear_logprobs": "chunked"}, **keys), tmp_path)
    loss, grads = _loss_and_lora_grads(trainer, batch)
    assert calls.count("linear_logprobs") >= 2  # the forward and backward of (at least) the policy's call
    assert trl_loss.item() != pytest.approx(0.0) and loss.item() == pytest.approx(trl_loss.item(), rel=1e-6)
    for mine, theirs in zip(grads, trl_grads, strict=True):
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("keys", [{"pref_loss": "sigmoid"}, {"pref_loss": "simpo", "pref_ftx": 0.3},
                                  {"pref_loss": "sigmoid", "disable_gradient_checkpointing": False},
                                  {"pref_loss": "orpo", "kernels": {"linear_logprobs": "reference"}}])  # fmt: skip
def test_shared_prompt_gives_trls_loss_and_lora_gradients(dpo_config, tmp_path, keys):
    """`pref_shared_prompt: true`: every forward (policy and reference) runs one row per pair, and the loss and the
    LoRA gradients are those of TRL's two rows per pair."""
    from tiletune.kernels import registry

    trl_loss, trl_grads = _loss_and_lora_grads(*_trainer_and_batch(dpo_config(**keys), tmp_path))
    trainer, batch = _trainer_and_batch(dpo_config(pref_shared_prompt=True, **keys), tmp_path)
    rows = []
    embed = trainer.model.get_input_embeddings()
    handle = embed.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    loss, grads = _loss_and_lora_grads(trainer, batch)
    handle.remove()
    pairs = len(batch["input_ids"]) // 2
    assert rows and set(rows) == {pairs}, (rows, registry.runtime_fallbacks)  # no forward ran the pairs as two rows each
    assert trl_loss.item() != pytest.approx(0.0) and loss.item() == pytest.approx(trl_loss.item(), rel=1e-5)
    for mine, theirs in zip(grads, trl_grads, strict=True):
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-6)


def test_auto_recomputation_probes_the_rows_and_head_of_the_stage(dpo_config, tiny_model_dir):
    """`gradient_checkpointing: auto` plans a dpo step on its chosen and rejected rows through a log-prob head (no
    [tokens, vocab] logits: the LM head module never runs), kto on its answers, rm on both rows with the LM loss."""
    from transformers import AutoModelForCausalLM

    from tiletune.train.preference import recompute_probe

    rows, loss = recompute_probe(dpo_config(), 4)
    assert rows == 8 and loss is not None
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokens = torch.randint(0, model.config.vocab_size, (rows, 16), generator=torch.Generator().manual_seed(0))
    head_calls = []
    handle = model.get_output_embeddings().register_forward_hook(lambda *args: head_calls.append(1))
    value = loss(model, tokens)
    handle.remove()
    assert not head_calls and value.requires_grad
    assert value.item() == pytest.approx(model(input_ids=tokens, labels=tokens).loss.item(), rel=1e-5)
    assert recompute_probe(dpo_config(stage="kto", dataset="feedback"), 4)[0] == 4
    assert recompute_probe(dpo_config(stage="rm"), 4) == (8, None)
    assert recompute_probe(dpo_config(stage="sft", dataset="pairs"), 4) == (4, None)


def test_kto_sft_term_is_llamafactorys(dpo_config, tmp_path):
    """pref_ftx x the desirable answers' mean per-token NLL x batch / desirable answers (LLaMA-Factory's scaling)."""
    ftx, keys = 0.4, {"stage": "kto", "dataset": "feedback"}
    trainer, batch = _trainer_and_batch(dpo_config(**keys), tmp_path)
    with torch.no_grad():
        plain = trainer.compute_loss(trainer.model, batch)
    trainer, batch = _trainer_and_batch(dpo_config(pref_ftx=ftx, **keys), tmp_path)
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        token_logps = logits.float().log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        mask = batch["completion_mask"][:, 1:]
        average = (token_logps * mask).sum(1) / mask.sum(1)
        desirable = batch["label"].bool()
        assert 0 < desirable.sum() < len(desirable)
        expected = plain - ftx * average[desirable].mean() * len(desirable) / desirable.sum()
        assert trainer.compute_loss(trainer.model, batch).item() == pytest.approx(expected.item(), rel=1e-5)


def test_conservative_dpo_with_sft_term_matches_its_formula(dpo_config, tmp_path):
    """sigmoid with dpo_label_smoothing and pref_ftx, against the LoRA base (adapter disabled) as the reference."""
    beta, smoothing, ftx = 0.1, 0.2, 0.5
    trainer, batch = _trainer_and_batch(dpo_config(pref_beta=beta, dpo_label_smoothing=smoothing, pref_ftx=ftx), tmp_path)
    assert "ref" not in trainer.model.peft_config  # no copy of the adapter: the reference is the base
    with torch.no_grad():
        c, r = _answer_logps(trainer.model, batch, average=False)
        with trainer.model.disable_adapter():
            rc, rr = _answer_logps(trainer.model, batch, average=False)
        c_avg, _ = _answer_logps(trainer.model, batch, average=True)
        delta = beta * ((c - rc) - (r - rr))
        expected = (-(1 - smoothing) * F.logsigmoid(delta) - smoothing * F.logsigmoid(-delta) - ftx * c_avg).mean()
        loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize(
    "keys, expected",
    [
        ({"pref_loss": "orpo", "ref_model": "some/model"}, "ref_model is read only with a reference model"),
        ({"simpo_gamma": 0.3}, "simpo_gamma is read only with pref_loss=simpo"),
        ({"pref_loss": "hinge", "dpo_label_smoothing": 0.1}, "dpo_label_smoothing is read only with pref_loss=sigmoid"),
        ({"stage": "sft", "pref_beta": 0.2}, "pref_beta is read only with stage=dpo or kto"),
        ({"stage": "rm", "pref_ftx": 0.2}, "pref_ftx is read only with stage=dpo or kto"),
        ({"stage": "kto", "pref_loss": "orpo"}, "pref_loss is read only with stage=dpo"),
        ({"stage": "kto", "pref_shared_prompt": True}, "pref_shared_prompt is read only with stage=dpo"),
    ],
)
def test_wrong_key_combination_is_one_line_and_exit_2(tmp_path, tiny_model_dir, keys, expected):
    raw = {"model_name_or_path": str(tiny_model_dir), "stage": "dpo", "do_train": True, "dataset": "x",
           "template": "llama3", "output_dir": str(tmp_path / "out"), **keys}  # fmt: skip
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(main, ["train", str(path)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.stderr


def test_sft_refuses_a_ranking_dataset(dpo_config):
    from tiletune.errors import UserError
    from tiletune.train.trainer import run_train

    with pytest.raises(UserError, match="stage sft needs a dataset without ranking or kto_tag; the train data is a ranking dataset"):
        run_train(dpo_config(stage="sft"), dry_run=True)


@pytest.mark.parametrize("example, stage", [("qwen3_lora_dpo.yaml", "dpo"), ("qwen3_lora_kto.yaml", "kto"),
                                            ("qwen3_lora_reward.yaml", "rm")])
def test_llamafactory_preference_examples_dry_run(example, stage, compat_dir, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(compat_dir)  # dpo_en_demo and kto_en_demo are LLaMA-Factory's demo data
    result = CliRunner().invoke(main, ["train", str(VENDORED / "train_lora" / example),
                                       f"model_name_or_path={tiny_model_dir}", "max_samples=20", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "dry run: config, model and data are valid" in result.output and f"stage: {stage}" in result.output


def test_reward_model_trains_reports_accuracy_and_saves_the_value_head(dpo_config):
    from safetensors.torch import load_file

    from tiletune.train.trainer import run_train

    cfg = dpo_config(stage="rm", eval_dataset="pairs", do_eval=True, eval_strategy="steps", eval_steps=2,
                     learning_rate=1e-2, max_steps=6)  # fmt: skip
    metrics = run_train(cfg)
    history = json.loads((cfg.output_dir / "trainer_state.json").read_text())["log_history"]
    losses = [h["loss"] for h in history if "loss" in h]
    assert all(torch.isfinite(torch.tensor(losses))) and len(set(losses)) > 1
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and any("eval_accuracy" in h for h in history)
    head = load_file(cfg.output_dir / "value_head.safetensors")
    assert head["v_head.summary.weight"].shape == (1, 32) and head["v_head.summary.bias"].shape == (1,)
    assert (cfg.output_dir / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("reference", ["ref_model", "precompute_ref_log_probs"])
def test_full_fine_tuning_trains_against_a_reference(dpo_config, tiny_model_dir, reference):
    """A `ref_model` loaded frozen, or (no ref_model) the model's own log-probs computed once before training."""
    from tiletune.train.trainer import run_train

    keys = {"ref_model": str(tiny_model_dir)} if reference == "ref_model" else {"precompute_ref_log_probs": True}
    cfg = dpo_config(finetuning_type="full", learning_rate=1e-3, **keys)
    run_train(cfg)
    history = json.loads((cfg.output_dir / "trainer_state.json").read_text())["log_history"]
    assert history[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)  # the first step: policy = reference
    assert any(abs(h.get("rewards/margins", 0.0)) > 1e-4 for h in history[1:])


def test_demo_dpo_teaches_the_preference(tmp_path, monkeypatch, capsys):
    """examples/demo_dpo.yaml, shortened: the held-out preference accuracy it prints rises from the base's."""
    import re

    from tiletune.config import load_config
    from tiletune.train.trainer import run_train

    monkeypatch.chdir(EXAMPLES.parent)
    cfg = load_config(EXAMPLES / "demo_dpo.yaml", [f"output_dir={tmp_path / 'out'}", "max_steps=4", "plot_loss=false"])
    run_train(cfg)
    printed = re.search(r"held-out preference accuracy on (\d+) eval pairs: before training ([\d.]+) .*after training "
                        r"([\d.]+)", capsys.readouterr().out)  # fmt: skip
    assert printed, "no accuracy line"
    pairs, before, after = int(printed[1]), float(printed[2]), float(printed[3])
    assert pairs == 60 and before <= 0.6 and after >= 0.9
