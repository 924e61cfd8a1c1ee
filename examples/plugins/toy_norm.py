"""A complete tiletune op in one file: `kernels: {toy_norm: reference, plugins: [toy_norm]}` (with this folder
on PYTHONPATH) puts it on every norm of a model whose family record lists its norms.

An op is: its PyTorch reference (forward and backward: the semantics), the custom op generated from its
Signature, and a Binding to a role (here "norm") with the forward it installs. A TileLang implementation
would be one more `add(Impl(...))` with `unavailable`/`unsupported` saying where it cannot run.
"""

import torch

from tiletune.kernels.binding import Binding
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.registry import Impl, Op, add, define


def reference_forward(x, weight, eps):
    """RMSNorm, x·w / sqrt(mean(x²) + eps), statistics in float32."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def reference_backward(dy, x, weight, eps):
    """(dx, dweight), in float32."""
    xf, dyf = x.float(), dy.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    normed, dnormed = xf * rstd, dyf * weight.float()
    dx = rstd * (dnormed - normed * (dnormed * normed).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dyf * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)


# torch.ops.tiletune.toy_norm(x, weight, eps, impl, strict) and its backward, with fakes and autograd
make_custom_op(Signature(
    "toy_norm", "Tensor x, Tensor weight, float eps", "Tensor",
    backward_inputs="Tensor x, Tensor weight, float eps", backward_outputs="(Tensor, Tensor)",
    fake=lambda x, weight, eps: torch.empty_like(x),
    backward_fake=lambda dy, x, weight, eps: (torch.empty_like(x), torch.empty_like(weight)),
    save=lambda inputs, outputs, needs: inputs,  # the backward's arguments after dy
    judged_on=lambda grads, saved: saved,  # the forward-shaped inputs an implementation is chosen by
    grad_of=(0, 1, None),  # x and weight get the backward's two results; eps none
))


def fit(site):
    """Why this norm cannot take the op (reported, the module left alone), or None."""
    return "x·(1 + w) norm: stock forward kept" if site.part.offset else None


def forward(site, impl, strict, current):
    """The forward installed on each norm module the binding takes."""
    def norm_forward(self, hidden_states):
        return torch.ops.tiletune.toy_norm(hidden_states, self.weight, self.variance_epsilon, impl, strict)
    return norm_forward


define(Op("toy_norm", (Binding("toy_norm", "norm", forward, fit),), opt_in=True))  # opt-in: `all` leaves it out
add(Impl("toy_norm", "reference", reference_forward, reference_backward, description="PyTorch", accumulation="float32"))
