"""The frozen input embeddings and lm_head in host memory: when they may move, and on a GPU the same step from there."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from tiletune.patch import apply_kernels
from tiletune.train.host_tables import (embedding_on_host, embedding_to_host, head_on_host, head_to_host, tables_to_device,
                                        why_head_not_on_host, why_not_on_host)

gpu = pytest.mark.gpu


def _model(tie=False, device="cpu"):
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_why_a_table_cannot_move():
    assert "tied to the lm_head" in why_not_on_host(_model(tie=True))
    assert "tied to the input embeddings" in why_head_not_on_host(_model(tie=True))
    assert "not a GPU" in why_not_on_host(_model()) and "not a GPU" in why_head_not_on_host(_model())
    model = _model()
    model.get_input_embeddings().weight.requires_grad_(True)
    model.get_output_embeddings().weight.requires_grad_(True)
    assert "trained" in why_not_on_host(model) and "trained" in why_head_not_on_host(model)
    with pytest.raises(ValueError, match="cannot keep the input embeddings on the host"):
        embedding_to_host(model)
    with pytest.raises(ValueError, match="cannot keep the lm_head on the host"):
        head_to_host(model)
    model.get_output_embeddings().bias = torch.nn.Parameter(torch.zeros(512))
    assert "bias" in why_head_not_on_host(model)


@gpu
@pytest.mark.parametrize("fused_loss", [False, True], ids=["stock-logits", "linear_cross_entropy"])
def test_on_the_gpu_the_step_is_the_same_and_the_tables_stay_on_the_host(fused_loss):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model = _model(device="cuda")
    if fused_loss:
        apply_kernels(model, {"linear_cross_entropy": "chunked"})
    model.base_model.model.enable_input_require_grads()  # what gradient checkpointing with peft sets
    tokens = torch.randint(0, 512, (2, 48), device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    reference = step()
    before = torch.cuda.memory_allocated()
    embedding_to_host(model)
    head_to_host(model)
    tables = [model.get_input_embeddings().weight, model.get_output_embeddings().weight]
    assert embedding_on_host(model) and head_on_host(model)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in tables)
    assert torch.cuda.memory_allocated() <= before - sum(t.numel() * t.element_size() for t in tables)
    model.to("cuda")  # what the Trainer does: the tables stay where they are
    assert all(t.device.type == "cpu" for t in (model.get_input_embeddings().weight, model.get_output_embeddings().weight))
    # Stock logits take the whole copy the forward sent ahead: bit for bit. The fused loss reads the head in slices
    # from the host (its online normaliser sums in another order): float32 rounding on the loss, bf16's on gradients.
    for _ in range(2):  # the second step takes the copy its own forward sent, not a stale one
        loss, grads = step()
        torch.testing.assert_close(loss, reference[0], rtol=1e-5 if fused_loss else 0, atol=0)
        for name, grad in grads.items():
            if fused_loss:  # d hidden rounded to bf16 in another order: a relative error of bf16's size
                assert (grad - reference[1][name]).norm() <= 1e-2 * reference[1][name].norm(), name
            else:
                torch.testing.assert_close(grad, reference[1][name], rtol=0, atol=0, msg=name)
        assert "_tiletune_prefetched" not in model.get_output_embeddings().__dict__  # the loss took it, or none was sent
    tables_to_device(model)  # for generation: back where they were, forward and moves as stock
    assert not embedding_on_host(model) and not head_on_host(model)
    assert model.get_input_embeddings().weight.device.type == "cuda" and model.get_output_embeddings().weight.device.type == "cuda"
    assert "forward" not in model.get_input_embeddings().__dict__ and "forward" not in model.get_output_embeddings().__dict__
    torch.testing.assert_close(step()[0], reference[0], rtol=0, atol=0)
