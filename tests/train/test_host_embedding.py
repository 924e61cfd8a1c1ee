"""The frozen input embedding table in host memory: when it may move, and on a GPU the same step from there."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from tiletune.train.host_embedding import embedding_on_host, embedding_to_device, embedding_to_host, why_not_on_host

gpu = pytest.mark.gpu


def _model(tie=False, device="cpu"):
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_why_the_table_cannot_move():
    assert "tied to the lm_head" in why_not_on_host(_model(tie=True))
    assert "not a GPU" in why_not_on_host(_model())
    model = _model()
    model.get_input_embeddings().weight.requires_grad_(True)
    assert "train" in why_not_on_host(model)
    with pytest.raises(ValueError, match="cannot keep the input embeddings on the host"):
        embedding_to_host(model)


@gpu
def test_on_the_gpu_the_step_is_the_same_and_the_table_stays_on_the_host():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model = _model(device="cuda")
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
    table = model.get_input_embeddings().weight
    assert embedding_on_host(model) and table.device.type == "cpu" and table.is_pinned()
    assert torch.cuda.memory_allocated() <= before - table.numel() * table.element_size()
    model.to("cuda")  # what the Trainer does: the table stays where it is
    assert model.get_input_embeddings().weight.device.type == "cpu"
    loss, grads = step()
    torch.testing.assert_close(loss, reference[0], rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[1][name], rtol=0, atol=0, msg=name)
    embedding_to_device(model)  # for generation: back where it was, forward and moves as stock
    assert not embedding_on_host(model) and model.get_input_embeddings().weight.device.type == "cuda"
    assert "forward" not in model.get_input_embeddings().__dict__
    torch.testing.assert_close(step()[0], reference[0], rtol=0, atol=0)
