"""LLaMA-Factory's optimizer keys, each on a maintained implementation.

- `loraplus_lr_ratio`: LoRA+ by peft's `create_loraplus_optimizer` (the B matrices learn at learning_rate x ratio,
  LoRA's embedding adapters at `loraplus_lr_embedding`);
- `use_galore` / `use_apollo`: transformers' Trainer optimizers (`galore_adamw`, `apollo_adamw`, ... from the
  galore-torch / apollo-torch packages), the LLaMA-Factory sub-keys handed over as `optim_args` and
  `optim_target_modules` (`all`: every Linear that `lora_target: all` would take);
- `use_muon`: torch's `torch.optim.Muon` on the hidden weight matrices and AdamW on the rest (embeddings, the
  output head, norms, biases), as LLaMA-Factory splits them, with its learning-rate scaling (Moonshot's: AdamW's
  learning rate and weight decay carry over).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tiletune.config import LOW_RANK_OPTIMS, TuneConfig

log = logging.getLogger("tiletune")


@dataclass(frozen=True)
class LowRank:
    """GaLore or APOLLO: the switch, the keys naming its target layers and layer-wise steps, and the Trainer's
    `optim_args` name for each LLaMA-Factory sub-key."""

    switch: str
    target: str
    layerwise: str
    optim_args: dict[str, str]


LOW_RANK = (
    LowRank("use_galore", "galore_target", "galore_layerwise",
            {"rank": "galore_rank", "update_proj_gap": "galore_update_interval", "scale": "galore_scale",
             "proj_type": "galore_proj_type"}),
    LowRank("use_apollo", "apollo_target", "apollo_layerwise",
            {"rank": "apollo_rank", "update_proj_gap": "apollo_update_interval", "scale": "apollo_scale",
             "proj": "apollo_proj", "proj_type": "apollo_proj_type", "scale_type": "apollo_scale_type"}),
)  # fmt: skip


def trainer_keys(cfg: TuneConfig, model) -> dict:
    """The Trainer keys `use_galore` / `use_apollo` set (`optim`, `optim_args`, `optim_target_modules`); {} otherwise.

    Trainer keys the config sets itself win: its `optim_args` come after the sub-keys', its
    `optim_target_modules` replace the target key's layers.
    """
    from tiletune.train.model import target_modules

    method = next((m for m in LOW_RANK if getattr(cfg, m.switch)), None)
    if method is None:
        return {}
    optim = LOW_RANK_OPTIMS[method.switch][cfg.train_arg("optim")] + ("_layerwise" if getattr(cfg, method.layerwise) else "")
    args = ",".join(f"{name}={getattr(cfg, key)}" for name, key in method.optim_args.items())
    targets = cfg.train_arg("optim_target_modules") or target_modules(model, method.target, getattr(cfg, method.target))
    log.info("%s: optim=%s on %s, optim_args %s", method.switch, optim, targets, args)
    return {"optim": optim, "optim_args": ",".join(filter(None, [args, cfg.train_arg("optim_args")])),
            "optim_target_modules": targets}


def build_optimizer(cfg: TuneConfig, model, args) -> torch.optim.Optimizer | None:
    """The optimizer `loraplus_lr_ratio` or `use_muon` asks for; None leaves it to the Trainer (GaLore and APOLLO
    are the Trainer's own, chosen by `trainer_keys`)."""
    if cfg.loraplus_lr_ratio is not None:
        return _loraplus(cfg, model, args)
    if cfg.use_muon:
        return _muon(model, args)
    return None


def _loraplus(cfg: TuneConfig, model, args) -> torch.optim.Optimizer:
    from peft.optimizers import create_loraplus_optimizer
    from transformers import Trainer

    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    kwargs.pop("lr", None)
    log.info("LoRA+: lora_B learns at %g (learning_rate x %g), lora_A at %g", args.learning_rate * cfg.loraplus_lr_ratio,
             cfg.loraplus_lr_ratio, args.learning_rate)  # fmt: skip
    return create_loraplus_optimizer(model, optimizer_cls, lr=args.learning_rate, loraplus_lr_ratio=cfg.loraplus_lr_ratio,
                                     loraplus_lr_embedding=cfg.loraplus_lr_embedding,
                                     loraplus_weight_decay=args.weight_decay, **kwargs)  # fmt: skip


def _muon(model, args) -> torch.optim.Optimizer:
    embeddings = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    trained = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in trained if p.ndim == 2 and id(p) not in embeddings]
    matrix_ids = {id(p) for p in matrices}
    others = [p for p in trained if id(p) not in matrix_ids]
    log.info("use_muon: Muon on %d weight matrices, AdamW on %d other tensors", len(matrices), len(others))
    return MuonWithAdamW(matrices, others, lr=args.learning_rate, weight_decay=args.weight_decay,
                         betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)  # fmt: skip


class MuonWithAdamW(torch.optim.Optimizer):
    """torch's Muon on `matrices` and AdamW on `others`, stepped as one optimizer.

    Its param_groups are the two optimizers' own dicts, so the Trainer's scheduler sets both learning rates;
    its state_dict holds both optimizers' states.
    """

    def __init__(self, matrices, others, lr: float, weight_decay: float, betas: tuple[float, float], eps: float):
        parts = [(torch.optim.Muon, matrices, {"adjust_lr_fn": "match_rms_adamw"}),
                 (torch.optim.AdamW, others, {"betas": betas, "eps": eps})]  # fmt: skip
        self.parts = [cls(params, lr=lr, weight_decay=weight_decay, **kw) for cls, params, kw in parts if params]
        super().__init__([group for part in self.parts for group in part.param_groups], {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def state_dict(self) -> dict:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state_dict: dict) -> None:
        for part, state in zip(self.parts, state_dict["parts"], strict=True):
            part.load_state_dict(state)
