"""A tiny float64 ``pre_ln`` model and a learnable batch stream, for training an optimizer beside a reference."""

import torch

from outlier_titan.config.job_config import Model as ModelConfig
from outlier_titan.models.init import Initializer
from outlier_titan.models.registry import model_args


def tiny_model() -> torch.nn.Module:
    """2 layers x 32, vocabulary 128, untied head, initialised from seed 0, in float64."""
    spec, args = model_args(ModelConfig(name="pre_ln", flavor="debug", n_layers=2, dim=32, n_heads=2,
                                        ffn_hidden=64, tie_embeddings=False), 128, 16)
    model = spec.build(args)
    model.init_weights(Initializer(0, "cpu"))
    return model.to(torch.float64)


def learnable_batches(n: int = 30) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of 4 x 16 tokens whose targets are a fixed map of the inputs, so the loss falls."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, 128, (4, 16), generator=g)
        out.append((x, (3 * x + 1) % 128))
    return out


def train_losses(model: torch.nn.Module, opt, batches) -> list[float]:
    """The loss of every step of training ``model`` with ``opt`` on ``batches``."""
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
