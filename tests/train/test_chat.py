"""`tiletune chat`: stdin lines in, streamed answers out, history in the template, clear / exit."""

from pathlib import Path

from click.testing import CliRunner

from tiletune.cli import main
from tiletune.config import build_config

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "demo.yaml"
BASE = REPO / "examples" / "tiny-llama"
HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"


def chat(stdin: str, *args: str):
    return CliRunner().invoke(main, ["chat", str(DEMO), f"model_name_or_path={BASE}", *args], input=stdin)


def test_fine_tuned_adapter_answers_the_new_instruction(demo_adapter):
    result = chat("Reverse and uppercase: a b c\nexit\nnever read\n", f"adapter_name_or_path={demo_adapter}")
    assert result.exit_code == 0, result.output
    assert "Assistant: C B A\n" in result.output
    assert result.output.count("Assistant:") == 1


def test_kernels_option_patches_the_model(demo_adapter):
    result = chat("Reverse and uppercase: x y\n", f"adapter_name_or_path={demo_adapter}", "--kernels", "all")
    assert result.exit_code == 0, result.output
    assert "kernels (4 decoder layers" in result.stderr
    assert "Assistant: Y X\n" in result.stdout


def test_history_is_encoded_with_the_template_and_clear_forgets_it(tiny_model_dir):
    from tiletune.train.chat import load_session, run_chat

    cfg = build_config({"model_name_or_path": str(tiny_model_dir), "template": "llama3", "max_new_tokens": 3,
                        "do_sample": False, "cutoff_len": 64})  # fmt: skip
    session, summary = load_session(cfg)
    assert summary is None
    decode = session.tokenizer.decode
    first = decode(session.prompt_ids("hello"))
    assert first.startswith("<|begin_of_text|>") and first.endswith("hello<|eot_id|>" + HEADER)

    written = []
    run_chat(session, ["hello\n", "again\n"], written.append)
    assert len(session.history) == 4 and session.history[2] == {"role": "user", "content": "again"}
    follow_up = decode(session.prompt_ids("third"))
    assert follow_up.count(HEADER) == 3 and follow_up.endswith("third<|eot_id|>" + HEADER)

    long = " ".join(["word"] * 40)  # past cutoff_len with the history: the oldest turns go first
    assert decode(session.prompt_ids(long)).count(HEADER) < 3

    run_chat(session, ["clear\n", "exit\n", "not read\n"], written.append)
    assert session.history == [] and "(conversation cleared)" in "".join(written)


def test_kernel_fallback_warnings_come_before_the_chat_not_inside_an_answer(tiny_model_dir, monkeypatch, no_kernel_runs):
    """A fallback is logged at the first call that takes it: load_session makes those calls (one short generation,
    prefill and a decoding step), so its warnings come with the kernel summary, before the first prompt line."""
    import logging

    from tiletune.kernels import registry
    from tiletune.train.chat import load_session, run_chat

    monkeypatch.setattr(registry, "runtime_fallbacks", {})  # as in a fresh process: no reason said yet
    events = []
    handler = logging.Handler()
    handler.emit = lambda record: events.append(("warning", record.getMessage()))
    logging.getLogger("tiletune.kernels").addHandler(handler)
    try:
        cfg = build_config({"model_name_or_path": str(tiny_model_dir), "template": "llama3", "max_new_tokens": 3,
                            "do_sample": False, "kernels": "all"})  # fmt: skip
        session, _ = load_session(cfg)
        run_chat(session, ["hello\n", "again\n"], lambda text: events.append(("chat", text)))
    finally:
        logging.getLogger("tiletune.kernels").removeHandler(handler)
    first_chat = next(i for i, (kind, _) in enumerate(events) if kind == "chat")
    assert ("warning", "tiletune: rms_norm falls back from tilelang: no GPU here") in events[:first_chat]
    assert all(kind == "chat" for kind, _ in events[first_chat:]), events[first_chat:]
