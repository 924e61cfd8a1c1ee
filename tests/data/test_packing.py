"""Supervised packing (`packing`, `neat_packing`): the knapsack, the packed rows, the collators, and the
loss of packed batches against the same examples unpacked on a tiny random Llama."""

import dataclasses
import itertools
import json
import random

import pytest
import torch

from tiletune.config import build_config
from tiletune.data.collator import PackedCollator
from tiletune.data.processing import IGNORE_INDEX, build_splits, greedy_knapsack, pack_supervised
from tiletune.data.templates import get_template
from tiletune.errors import UserError

P = IGNORE_INDEX


def test_knapsack_fills_each_bin_with_the_longest_item_that_fits():
    assert greedy_knapsack([5, 3, 7, 2, 8, 3], 10) == [[4, 3], [2, 5], [0, 1]]  # 8+2, 7+3, 5+3
    rng = random.Random(0)
    lengths = [rng.randint(1, 50) for _ in range(300)]
    bins = greedy_knapsack(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(300))
    for k, members in enumerate(bins):  # full: no later item fits in an earlier bin's room
        room = 64 - sum(lengths[i] for i in members)
        assert room >= 0 and all(lengths[i] > room for later in bins[k + 1 :] for i in later)
    with pytest.raises(ValueError, match="does not fit"):
        greedy_knapsack([3, 9], 8)


BATCH = {"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]], "labels": [[P, 2, 3], [4, 5], [P, P, 8, 9]]}


def rows_of(packed: dict[str, list]) -> list[dict]:
    """The packed columns as rows, as the collator gets them."""
    return [dict(zip(packed, values)) for values in zip(*packed.values())]


def test_packed_rows_restart_positions_and_mask_each_first_label():
    assert pack_supervised(BATCH, cutoff_len=6) == {
        "input_ids": [[6, 7, 8, 9, 4, 5], [1, 2, 3]],
        "attention_mask": [[1] * 6, [1] * 3],
        "labels": [[P, P, 8, 9, P, 5], [P, 2, 3]],
        "position_ids": [[0, 1, 2, 3, 0, 1], [0, 1, 2]],
    }


def test_collators_flatten_neat_batches_and_pad_plain_ones():
    rows = rows_of(pack_supervised(BATCH, cutoff_len=6))
    neat = PackedCollator(neat=True, pad_token_id=0)(rows)
    assert "attention_mask" not in neat and neat["use_cache"] is False
    assert neat["input_ids"].tolist() == [[6, 7, 8, 9, 4, 5, 1, 2, 3]]
    assert neat["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2]]
    assert neat["cu_seq_lens_q"].tolist() == [0, 4, 6, 9] and neat["max_length_q"] == 4
    plain = PackedCollator(neat=False, pad_token_id=0, pad_to_multiple_of=4)(rows)
    assert plain["input_ids"].tolist() == [[6, 7, 8, 9, 4, 5, 0, 0], [1, 2, 3, 0, 0, 0, 0, 0]]
    assert plain["attention_mask"].tolist() == [[1] * 6 + [0] * 2, [1] * 3 + [0] * 5]
    assert plain["labels"][1].tolist() == [P, 2, 3] + [P] * 5
    assert plain["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 0], [0, 1, 2, 0, 0, 0, 0, 0]]


# ---- loss: packed against unpacked --------------------------------------------------------------

LENGTHS = [11, 5, 17, 8, 3, 13, 9]


def tiny_model(attention: str):
    """A random-init float32 Llama of 2 layers, weights large enough that attention matters to the loss.

    use_cache stays on, as in an evaluation-only run: a packed batch must turn it off itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5,
                         attn_implementation=attention)  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.fixture(params=["sdpa", "eager"])
def tiny_llama(request):
    return tiny_model(request.param)


@pytest.fixture
def examples():
    """Ragged examples: some with a masked prompt, some (train_on_prompt) with a label on every token."""
    rng = torch.Generator().manual_seed(1)
    out = []
    for n, length in enumerate(LENGTHS):
        ids = torch.randint(1, 128, (length,), generator=rng).tolist()
        prompt = 0 if n % 2 else length // 2
        out.append({"input_ids": ids, "labels": [P] * prompt + ids[prompt:]})
    return out


def summed_loss(model, batch) -> torch.Tensor:
    """The summed token loss, as the Trainer's loss is before its division by the batch's label count."""
    return model(**batch, num_items_in_batch=1).loss


def unpacked_batch(examples) -> dict:
    longest = max(len(e["input_ids"]) for e in examples)
    pad = [longest - len(e["input_ids"]) for e in examples]
    return {"input_ids": torch.tensor([e["input_ids"] + [0] * p for e, p in zip(examples, pad)]),
            "attention_mask": torch.tensor([[1] * len(e["input_ids"]) + [0] * p for e, p in zip(examples, pad)]),
            "labels": torch.tensor([e["labels"] + [P] * p for e, p in zip(examples, pad)])}  # fmt: skip


def packed_batch(examples, neat: bool) -> dict:
    columns = {key: [e[key] for e in examples] for key in ("input_ids", "labels")}
    rows = rows_of(pack_supervised(columns, cutoff_len=24))
    assert len(rows) < len(examples)
    return PackedCollator(neat=neat, pad_token_id=0)(rows)


def test_neat_packing_loses_and_learns_exactly_as_unpacked(tiny_llama, examples):
    unpacked = summed_loss(tiny_llama, unpacked_batch(examples))
    want = torch.autograd.grad(unpacked, tiny_llama.model.embed_tokens.weight)[0]
    packed = summed_loss(tiny_llama, packed_batch(examples, neat=True))
    got = torch.autograd.grad(packed, tiny_llama.model.embed_tokens.weight)[0]
    torch.testing.assert_close(packed, unpacked, rtol=1e-5, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def test_packed_loss_needs_restarting_positions_and_masked_boundaries(tiny_llama, examples):
    unpacked = summed_loss(tiny_llama, unpacked_batch(examples)).item()
    contiguous = packed_batch(examples, neat=True)
    contiguous["position_ids"] = torch.arange(contiguous["input_ids"].shape[1])[None]
    unmasked = packed_batch(examples, neat=True)  # the examples' own first labels: predicted from the example before
    order = [i for members in greedy_knapsack([len(e["input_ids"]) for e in examples], 24) for i in members]
    unmasked["labels"] = torch.tensor([[label for i in order for label in examples[i]["labels"]]])
    assert (unmasked["labels"] != contiguous["labels"]).sum() == sum(e["labels"][0] != P for e in examples) > 0
    plain = packed_batch(examples, neat=False)  # LLaMA-Factory's plain packing: attends across examples
    for wrong in (contiguous, unmasked, plain):
        assert abs(summed_loss(tiny_llama, wrong).item() - unpacked) > 1e-3 * unpacked


@pytest.mark.parametrize("boundaries", [True, False], ids=["with-cu_seq_lens", "position-ids-only"])
def test_tiletune_attention_runs_packed_batches_as_unpacked(examples, monkeypatch, boundaries):
    """SDPA gets transformers' block-diagonal mask (from the position ids; the collator also passes the
    boundaries): tiletune's attention op runs every layer on the packed row with its cu_seqlens, and the loss
    and its gradients are the unpacked ones."""
    from tiletune.kernels import registry
    from tiletune.patch import apply_kernels, parse_kernel_spec

    model = tiny_model("sdpa")
    unpacked = summed_loss(model, unpacked_batch(examples))
    want = torch.autograd.grad(unpacked, model.model.embed_tokens.weight)[0]
    batch = packed_batch(examples, neat=True)
    if not boundaries:
        batch = {k: v for k, v in batch.items() if not k.startswith(("cu_seq_lens", "max_length"))}
    seen = []
    reference = registry.get("attention", "reference")
    monkeypatch.setitem(registry._impls["attention"], "reference", dataclasses.replace(
        reference, forward=lambda *args: seen.append(args[4]) or reference.forward(*args)))
    report = apply_kernels(model, parse_kernel_spec({"attention": "reference"}))
    try:
        packed = summed_loss(model, batch)
        got = torch.autograd.grad(packed, model.model.embed_tokens.weight)[0]
    finally:
        report.revert()
    starts = [0, *itertools.accumulate(len(e["input_ids"]) for e in examples)]  # any order: compare lengths
    assert len(seen) == 2 and all(cu is not None and cu.dtype == torch.int32 for cu in seen)
    assert sorted(torch.diff(seen[0]).tolist()) == sorted(torch.diff(torch.tensor(starts)).tolist())
    assert not [item for item in report.runtime_fallbacks() if item["op"] == "attention"]
    torch.testing.assert_close(packed, unpacked, rtol=1e-5, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def _attention_call(kwargs: dict, mask=None, batch: int = 1, seq: int = 9):
    """One call of the wrapped SDPA (tiletune's reference) as a Llama layer makes it: (output, fallback reasons)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tiletune.kernels import registry
    from tiletune.kernels.attention import _attention_function

    before = dict(registry.runtime_fallbacks)
    module = tiny_model("sdpa").model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, h, seq, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    out, _ = _attention_function(sdpa_attention_forward, "reference", False)(module, q, k, v, mask, scaling=0.25,
                                                                           **kwargs)
    reasons = {key[2] for key, n in registry.runtime_fallbacks.items() if key[0] == "attention" and n > before.get(key, 0)}
    return out, reasons, (q, k, v)


def _block_diagonal_sdpa(q, k, v, cu):
    """Float64 SDPA with the block-diagonal causal mask of the boundaries cu, (batch, seq, heads, d)."""
    seq = q.shape[2]
    segment = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu)))
    mask = (segment[:, None] == segment[None]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, scale=0.25, enable_gqa=True).transpose(1, 2)


def test_flash_attention_boundaries_reach_the_op():
    """Flash-attention's path: no mask, the boundaries as cu_seq_lens_q/k."""
    cu = torch.tensor([0, 1, 4, 5, 9], dtype=torch.int32)
    out, reasons, (q, k, v) = _attention_call({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(), "max_length_q": 4,
                                               "max_length_k": 4})
    assert reasons == set()
    torch.testing.assert_close(out, _block_diagonal_sdpa(q, k, v, cu.tolist()), rtol=1e-10, atol=1e-12)


def test_packing_tiletune_cannot_take_falls_back_and_says_why():
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    causal = torch.ones(1, 1, 9, 9, dtype=torch.bool).tril()  # LLaMA-Factory's plain packing: attends across
    for kwargs, mask, batch, reason in [
        ({"position_ids": positions}, causal, 1, "an attention mask"),
        ({"cu_seq_lens_q": cu, "cu_seq_lens_k": torch.tensor([0, 5, 9], dtype=torch.int32)}, None, 1, "packed sequences"),
        ({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, None, 2, "packed sequences"),
        ({"cu_seq_lens_q": cu[:2], "cu_seq_lens_k": cu[:2]}, None, 1, "packed sequences"),  # not covering the row
    ]:
        _, reasons, _ = _attention_call(kwargs, mask, batch)
        assert any(reason in r for r in reasons), (kwargs, reasons)
    _, reasons, _ = _attention_call({"position_ids": positions}, causal & _block_mask([0, 4, 9]))
    assert reasons == set()  # the same row with transformers' block-diagonal mask runs the op


def _block_mask(cu):
    segment = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu)))
    return (segment[:, None] == segment[None])[None, None]


# ---- the data pipeline and the config ------------------------------------------------------------


def test_build_splits_packs_the_encoded_examples_unchanged(tmp_path, demo_tokenizer, caplog):
    records = [{"instruction": f"say {w}", "input": "", "output": f"{w} " * (3 * n + 1)}
               for n, w in enumerate("abcdefghijklmnop")]  # fmt: skip
    records.append({"instruction": "long", "input": "", "output": "z " * 200})  # cut to cutoff_len, as unpacked
    (tmp_path / "t.json").write_text(json.dumps(records))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"t": {"file_name": "t.json"}}))
    raw = {"model_name_or_path": "m", "dataset": "t", "dataset_dir": str(tmp_path), "template": "llama3",
           "cutoff_len": 96, "do_train": True}  # fmt: skip
    template = get_template("llama3", demo_tokenizer, "sft")
    unpacked = build_splits(build_config(raw), demo_tokenizer, template)
    with caplog.at_level("INFO", logger="tiletune"):
        packed = build_splits(build_config({**raw, "neat_packing": True}), demo_tokenizer, template)
    n = len(records)
    assert packed.stats == {"train_examples": n, "train_sequences": len(packed.train)} and len(packed.train) < n
    assert f"train: packed {n} examples into {len(packed.train)} sequences of at most 96 tokens" in caplog.text
    assert max(len(ids) for ids in packed.train["input_ids"]) <= 96

    def split(row):  # the packed examples, by their position ids
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["position_ids"])]
        return [(tuple(row["input_ids"][a:b]), tuple(row["labels"][a:b])) for a, b in itertools.pairwise(starts)]

    got = sorted(example for row in packed.train for example in split(row))
    assert got == sorted((tuple(e["input_ids"]), (P, *e["labels"][1:])) for e in unpacked.train)


@pytest.mark.parametrize("keys, message", [({"stage": "pt"}, "neat_packing is for stage sft"),
                                           ({"packing": False}, "remove packing=false")])  # fmt: skip
def test_neat_packing_is_refused_where_it_cannot_apply(keys, message):
    with pytest.raises(UserError, match=message):
        build_config({"model_name_or_path": "m", "neat_packing": True, **keys})
