"""`tiletune chat`: talk to the base or fine-tuned model in the terminal, in the config's chat template.

Each line read is a user message; the answer streams as it is generated. The conversation is kept:
the prompt is every earlier turn plus the new message, encoded with the template and ending at the
assistant header (the oldest turns are dropped when it grows past `cutoff_len`). `clear` forgets the
conversation, `exit` (or end of input) ends the chat. Generation follows the config's generation keys
(`do_sample`, `temperature`, `top_p`, `top_k`, `max_new_tokens`, `repetition_penalty`, ...).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable

import torch

from tiletune.config import TuneConfig
from tiletune.data.templates import ASSISTANT, USER, Template

EXIT_COMMANDS = ("exit", "quit")
CLEAR_COMMAND = "clear"
HELP = "type a message; `clear` starts a new conversation, `exit` ends the chat"


class ChatSession:
    """A model, its tokenizer and template, and the conversation so far."""

    def __init__(self, cfg: TuneConfig, model, tokenizer, template: Template):
        from tiletune.train.predict import generation_config

        self.cfg, self.model, self.tokenizer, self.template = cfg, model, tokenizer, template
        self.gen_config = generation_config(cfg, tokenizer, template)
        self.history: list[dict[str, str]] = []
        self._error: Exception | None = None

    def prompt_ids(self, message: str) -> list[int]:
        """The earlier turns and `message`, encoded up to the assistant header, oldest turns dropped to fit."""
        turns = self.history + [{"role": USER, "content": message}, {"role": ASSISTANT, "content": ""}]
        while True:
            pairs = self.template.encode_pairs(
                self.tokenizer, turns, system=self.cfg.default_system or "", enable_thinking=self.cfg.enable_thinking
            )
            ids = [token for prompt, answer in pairs[:-1] for token in prompt + answer] + pairs[-1][0]
            if len(ids) <= self.cfg.cutoff_len or len(turns) == 2:
                return ids
            turns = turns[2:]

    def inputs(self, message: str) -> dict[str, torch.Tensor]:
        """input_ids and attention_mask of the prompt for `message`, on the model's device."""
        input_ids = torch.tensor([self.prompt_ids(message)], device=next(self.model.parameters()).device)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}

    @torch.no_grad()
    def warm_up(self) -> None:
        """A generation of two tokens nobody sees (a prompt and a decoding step): the kernels' run-time fallbacks
        are logged at their first call, now, instead of inside the first answer."""
        two_tokens = copy.deepcopy(self.gen_config)
        two_tokens.max_new_tokens = two_tokens.min_new_tokens = 2
        self.model.generate(**self.inputs("hello"), generation_config=two_tokens)

    def reply(self, message: str) -> Iterable[str]:
        """Stream the answer to `message` piece by piece; the finished exchange joins the history."""
        from transformers import TextIteratorStreamer

        streamer = TextIteratorStreamer(
            self.tokenizer, skip_prompt=True, skip_special_tokens=self.cfg.skip_special_tokens
        )
        kwargs = dict(**self.inputs(message), generation_config=self.gen_config, streamer=streamer)
        self._error = None
        worker = threading.Thread(target=self._generate, kwargs=kwargs, daemon=True)
        worker.start()
        pieces = []
        for piece in streamer:
            pieces.append(piece)
            yield piece
        worker.join()
        if self._error is not None:
            raise self._error
        self.history += [{"role": USER, "content": message}, {"role": ASSISTANT, "content": "".join(pieces).strip()}]

    @torch.no_grad()
    def _generate(self, **kwargs) -> None:
        try:
            self.model.generate(**kwargs)
        except Exception as err:  # shown in the main thread, after the streamer ends
            self._error = err
            kwargs["streamer"].end()


def load_session(cfg: TuneConfig) -> tuple[ChatSession, str | None]:
    """The chat session for `cfg` (adapters in `adapter_name_or_path` merged, or over a quantized base one
    adapter unmerged so that the base stays quantized; the `kernels:` selection patched in and warmed up), and
    the kernel summary (None without kernels)."""
    from tiletune.data.templates import get_template
    from tiletune.train.model import load_model, load_tokenizer

    tokenizer = load_tokenizer(cfg)
    template = get_template(cfg.template, tokenizer, cfg.stage, cfg.default_system)
    template.fix_tokenizer(tokenizer)
    device_map = "auto" if torch.cuda.is_available() else None
    model = load_model(cfg, tokenizer, trainable=False, device_map=device_map, keep_quantized=True)
    model.config.use_cache = True
    session = ChatSession(cfg, model, tokenizer, template)
    if cfg.kernels is None:
        return session, None
    from tiletune.patch import apply_kernels

    report = apply_kernels(model, cfg.kernels)
    session.warm_up()
    return session, report.summary()


def run_chat(session: ChatSession, lines: Iterable[str], write: Callable[[str], None]) -> None:
    """The chat loop: a user message per line of `lines`, the streamed answer through `write`; Ctrl-C ends it."""
    write(f"{HELP}\n\nUser: ")
    try:
        for line in lines:
            message = line.strip()
            if message.lower() in EXIT_COMMANDS:
                break
            if message.lower() == CLEAR_COMMAND:
                session.history.clear()
                write("(conversation cleared)\n")
            elif message:
                write("Assistant: ")
                for piece in session.reply(message):
                    write(piece)
                write("\n")
            write("\nUser: ")
    except KeyboardInterrupt:
        pass
    write("\n")
