"""trainer_log.jsonl: what a step's record holds, the preference stages' metrics included."""

import json
from types import SimpleNamespace

from tiletune.train.callbacks import LOG_NAME, JsonlLogCallback


def test_a_step_record_keeps_the_loss_and_the_preference_metrics_and_drops_the_rest(tmp_path):
    callback = JsonlLogCallback(tmp_path)
    state = SimpleNamespace(is_world_process_zero=True, global_step=3, max_steps=8, epoch=0.5, num_input_tokens_seen=0)
    logs = {"loss": 0.69, "learning_rate": 1e-4, "rewards/chosen": 0.12, "rewards/accuracies": 0.75,
            "rewards/margins": 0.3, "logps/rejected": -41.5, "kl": 0.01, "eval_rewards/accuracies": 1.0,
            "eval_accuracy": 0.9, "train_runtime": 12.0, "nll_loss_unrelated": 3.0}
    callback.on_log(None, state, None, logs=logs)
    record = json.loads((tmp_path / LOG_NAME).read_text())
    assert {k: record[k] for k in logs if k in record} == {k: v for k, v in logs.items()
                                                           if k not in ("train_runtime", "nll_loss_unrelated")}
    assert record["step"] == 3 and "peak_memory_gib" in record
