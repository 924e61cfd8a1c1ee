"""Trainer callbacks: `trainer_log.jsonl` (one line per logging step), a progress bar with loss and tokens/s, and
the clean stop on SIGINT/SIGTERM."""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import TrainerCallback

LOG_NAME = "trainer_log.jsonl"


def peak_memory_gib() -> float:
    """Peak accelerator memory allocated by torch, or the process's peak RSS on CPU, in GiB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class _Throughput:
    """Tokens per second between two calls, from the Trainer's count of non-padding input tokens."""

    def __init__(self):
        self.time, self.tokens = time.perf_counter(), 0

    def update(self, tokens_seen: int) -> float:
        now = time.perf_counter()
        rate = (tokens_seen - self.tokens) / max(now - self.time, 1e-9)
        self.time, self.tokens = now, tokens_seen
        return rate


LOGGED = ("loss", "eval_loss", "learning_rate", "grad_norm", "eval_accuracy")
LOGGED_GROUPS = ("rewards/", "logps/", "kl")  # the preference stages' (TRL's) metrics, train and eval_


class JsonlLogCallback(TrainerCallback):
    """Appends step, loss, learning rate, epoch, elapsed, tokens/s and peak memory to trainer_log.jsonl, and the
    preference stages' rewards, log-probs, KL and pairwise accuracy as LLaMA-Factory's log has them."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOG_NAME
        self.start = time.perf_counter()
        self.throughput = _Throughput()

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if state.global_step and self.path.is_file():  # resumed: keep the log up to the checkpoint
            lines = self.path.read_text().splitlines()
            kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= state.global_step]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.start = time.perf_counter() - (json.loads(kept[-1])["elapsed"] if kept else 0.0)
        self.throughput = _Throughput()
        self.throughput.tokens = state.num_input_tokens_seen

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, "total_steps": state.max_steps}
        for key, value in logs.items():
            if key in LOGGED or key.removeprefix("eval_").startswith(LOGGED_GROUPS):
                record[key] = round(float(value), 6)
        if len(record) == 2:  # a summary line (train_runtime ...), not a step
            return
        record["epoch"] = round(state.epoch or 0.0, 4)
        record["elapsed"] = round(time.perf_counter() - self.start, 2)
        if "loss" in record:
            record["tokens_per_sec"] = round(self.throughput.update(state.num_input_tokens_seen), 1)
        record["peak_memory_gib"] = round(peak_memory_gib(), 3)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")


class ProgressCallback(TrainerCallback):
    """A live bar: step / total, loss and tokens/s (replaces transformers' plain bar)."""

    def __init__(self):
        self.bar = None
        self.throughput = _Throughput()

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", dynamic_ncols=True)
            self.throughput.tokens = state.num_input_tokens_seen

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs and "loss" in logs:
            rate = self.throughput.update(state.num_input_tokens_seen)
            self.bar.set_postfix(loss=f"{logs['loss']:.4f}", tok_s=f"{rate:,.0f}")

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class StopOnSignal(TrainerCallback):
    """The first SIGINT or SIGTERM finishes the optimizer step, saves a checkpoint and ends training; the same
    signal again exits at once (checkpoints already in place stay complete: they are written aside and renamed).
    The other signal only repeats the notice: under torchrun, Ctrl-C reaches the workers both directly and as
    the SIGTERM torchrun forwards. Several processes stop after the same step, the first one signalled decides."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: str | None = None  # the first signal this process got
        self.stopped = False  # training ended after a step because of one (here or in another process)
        self.previous: dict = {}

    def __enter__(self):
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.received == name:
            print(f"tiletune: {name} again: stopping now; the checkpoints already written are intact",
                  file=sys.stderr, flush=True)  # fmt: skip
            os._exit(128 + signum)
        self.received = self.received or name
        print(f"tiletune: {name}: finishing this optimizer step, then saving a checkpoint "
              f"(send {self.received} again to stop at once)", file=sys.stderr, flush=True)  # fmt: skip

    def on_step_end(self, args, state, control, **kwargs):
        if self._stop_now(args):
            self.stopped = control.should_save = control.should_training_stop = True

    def _stop_now(self, args) -> bool:
        """Whether this process, or any other process of the run, has been signalled."""
        if args.world_size == 1:
            return self.received is not None
        flag = torch.tensor(float(self.received is not None), device=args.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())
