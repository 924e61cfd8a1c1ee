"""The custom ops generated from each op's Signature: schema, fake kernels, autograd and torch.compile agree
with the real ops (torch.library.opcheck), and a signature whose fake is wrong is caught."""

import pytest
import torch

from tiletune.kernels import registry
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.quant_linear import weight_args
from tiletune.quant import quantize


def rand(*shape, grad: bool = True):
    return torch.randn(*shape, dtype=torch.float32, requires_grad=grad)


def _moe_inputs():
    return (rand(7, 16), torch.tensor([[0, 2], [1, 2], [2, 0], [0, 1], [2, 1], [1, 0], [0, 2]]), rand(7, 2),
            rand(3, 24, 16, grad=False), rand(3, 16, 12, grad=False))


# Small CPU inputs per op (the reference implementation runs), awkward sizes included.
CASES = {
    "rms_norm": lambda: (rand(5, 16), rand(16), 1e-5, 0.0),
    "rms_norm (Gemma's offset)": lambda: (rand(2, 3, 16), rand(16), 1e-6, 1.0),
    "swiglu": lambda: (rand(7, 24), rand(7, 24)),
    "geglu": lambda: (rand(2, 5, 24), rand(2, 5, 24)),
    "rope": lambda: (rand(2, 3, 4, 16), rand(2, 3, 2, 16), rand(2, 3, 16, grad=False), rand(2, 3, 16, grad=False), False),
    "rope (Llama 4's pairs)": lambda: (rand(2, 3, 4, 16), rand(2, 3, 2, 16), rand(2, 3, 8, grad=False), rand(2, 3, 8, grad=False),
                                       True),
    "linear": lambda: (rand(5, 16), rand(8, 16), rand(8)),
    "linear (frozen, no bias)": lambda: (rand(3, 5, 16), rand(8, 16, grad=False), None),
    "lora_linear": lambda: (rand(5, 16), rand(8, 16, grad=False), None, rand(4, 16), rand(8, 4), 2.0),
    "linear_cross_entropy": lambda: (rand(5, 16), rand(32, 16), torch.tensor([1, 2, -100, 3, 4]), 4.0, True, 0.0),
    "linear_cross_entropy (soft-capped)": lambda: (rand(5, 16), rand(32, 16), torch.tensor([1, -100, 2, 3, 4]), 4.0, True, 30.0),
    "linear_logprobs": lambda: (rand(5, 16), rand(32, 16), torch.tensor([1, 2, -100, 3, 4]), 0.0),
    "linear_logprobs (soft-capped, frozen weight)": lambda: (rand(5, 16), rand(32, 16, grad=False), torch.tensor([1, -100, 2, 3, 4]), 30.0),
    "moe_experts": lambda: (*_moe_inputs(), True, True),
    "moe_experts (input kept, gate_up rows computed again)": lambda: (*_moe_inputs(), False, True),
    "attention": lambda: (rand(1, 4, 5, 16), rand(1, 2, 5, 16), rand(1, 2, 5, 16), 0.25, None),
    "attention (packed sequences)": lambda: (rand(1, 4, 7, 16), rand(1, 2, 7, 16), rand(1, 2, 7, 16), 0.25,
                                             torch.tensor([0, 2, 3, 7], dtype=torch.int32)),
    "quant_linear": lambda: (rand(3, 5, 64), *weight_args(quantize(rand(16, 64, grad=False), "nf4")), rand(16, grad=False)),
    "quant_linear (int8, no bias)": lambda: (rand(5, 64), *weight_args(quantize(rand(16, 64, grad=False), "int8")), None),
    "quant_lora_linear": lambda: (rand(2, 5, 128), *weight_args(quantize(rand(24, 128, grad=False), "nf4")), None,
                                  rand(4, 128), rand(24, 4), 2.0),
    "quant_lora_linear (fp4 unnested, bias)": lambda: (rand(5, 64), *weight_args(quantize(rand(8, 64, grad=False), "fp4", double=False)),
                                                       rand(8, grad=False), rand(3, 64), rand(8, 3), 0.5),
}


@pytest.mark.parametrize("case", CASES)
def test_generated_custom_op_passes_opcheck(case):
    registry.load_ops()
    op = getattr(torch.ops.tiletune, case.split()[0]).default
    results = torch.library.opcheck(op, (*CASES[case](), "reference", False))
    assert set(results.values()) == {"SUCCESS"}


def test_every_defined_op_has_a_case():
    assert {case.split()[0] for case in CASES} >= set(registry.OPS)


def test_a_signature_with_a_wrong_fake_fails_opcheck():
    registry.define(registry.Op("wrong_fake_double"))
    registry.add(registry.Impl("wrong_fake_double", "reference", lambda x: 2 * x, lambda dy, x: 2 * dy))
    try:
        make_custom_op(Signature(
            "wrong_fake_double", "Tensor x", "Tensor", backward_inputs="Tensor x", backward_outputs="Tensor",
            fake=lambda x: x.new_empty(x.shape[0] + 1),  # one row too many
            backward_fake=lambda dy, x: torch.empty_like(x), save=lambda inputs, outputs, needs: inputs,
            judged_on=lambda grads, saved: saved, grad_of=(0,)))
        with pytest.raises(Exception, match="(?i)shape|size|fake"):
            torch.library.opcheck(torch.ops.tiletune.wrong_fake_double.default, (rand(3, 4), "reference", False))
    finally:
        registry._ops.pop("wrong_fake_double")
        registry._impls.pop("wrong_fake_double")
