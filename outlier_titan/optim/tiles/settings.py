"""The ``[optimizer]`` options of the tile optimizers, declared once (defaults, help, choices): the tile engine's,
shared by OrthoAdam and SOAP (``optim/tiles/``), then each optimizer's own. The config composes them into
``[optimizer]`` (each field's metadata naming its owner(s)); ``optim/builder.py`` registers the optimizers with
them. This module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from outlier_titan.config.job_config import add_option_group
from outlier_titan.options import OptionGroup, opt

BASES = ("haar", "hadamard", "haar_kron", "identity")


@dataclass
class TileOptions:
    """The tile engine's options (``optim/tiles/options.py`` ``EngineOptions`` reads them)."""

    tile_size: int = opt(0, "orthoadam/soap: 0 rotates every axis whole (one basis per axis up to max_precond_dim: "
                            "the published methods; a sharded axis then needs tiles). N > 0: the shard-local tile "
                            "variant, tiles of edge N on each parameter's global grid along the residual (never "
                            "sharded) axis, and at most N along the sharded axis.")
    shard_tile_size: int = opt(0, "orthoadam/soap: tile edge along the axis FSDP/TP shard (0: automatic, the "
                                  "largest power of two <= tile_size such that max_shards tiles divide the axis).")
    max_shards: int = opt(8, "orthoadam/soap: automatic shard_tile_size stays aligned for up to this many "
                             "(power-of-two) shards of an axis (FSDP x TP degree); numbers equal at every such layout.")
    tile_size_overrides: list = opt([], "orthoadam/soap: per-parameter tile edges, 'FQN_GLOB=SIZE' or "
                                        "'FQN_GLOB:AXIS=SIZE' (last match wins), e.g. 'layers.*.wo.weight:1=64'.")
    tile_alignment: str = opt("strict", "orthoadam/soap: a shard boundary off the tile grid fails at start-up "
                                        "(strict) or shrinks that tile and records it in the checkpoint (adapt).",
                              ("strict", "adapt"))
    max_precond_dim: int = opt(10000, "orthoadam/soap: an axis longer than this is not rotated.")
    vocab_axis: str = opt("tile", "orthoadam/soap: the vocabulary axis of tok_embeddings/output: rotated like "
                                  "the other axes (tile: whole or in tiles, as tile_size says; the published "
                                  "SOAP rotates it up to max_precond_dim) or not rotated (identity).",
                          ("tile", "identity"))
    one_d: str = opt("auto", "orthoadam/soap: 1-D parameters (gains, biases): as each method is published (auto: "
                             "OrthoAdam rotates them, as Algorithm 1 rotates every parameter; SOAP runs Adam on "
                             "them, as the published SOAP does), unrotated Adam (adamw), or rotated (rotate).",
                     ("auto", "adamw", "rotate"))


@dataclass
class OrthoAdamOptions:
    basis: str = opt("haar", "orthoadam: fixed bases: Haar (a random orthogonal matrix, as Kaul et al. sample "
                             "one per parameter), randomized Hadamard (cheaper; power-of-two axes or tiles), "
                             "Kronecker-factored Haar (haar_kron: cheaper, structured mixing), or identity "
                             "(= AdamW; tests and ablations).", BASES)


@dataclass
class SOAPOptions:
    precondition_frequency: int = opt(10, "soap: eigenbasis refresh period (steps); with tiles staggered over "
                                                "them (whole axes: every parameter at t % f == 0, as published).")
    shampoo_beta: float = opt(-1.0, "soap: EMA factor of the Shampoo factors (< 0: beta2).")
    refresh_stagger: bool = opt(True, "soap: spread refreshes over tiles (tile k when (t + k) % f == 0).")
    soap_factor_dtype: str = opt("float64", "soap: dtype of the L/R factors (float64 keeps small-eigenvalue "
                                            "directions above rounding noise; moments and bases stay fp32).",
                                 ("float64", "float32"))


def option_groups() -> list[OptionGroup]:
    """The tile engine's group once for each optimizer that uses it, then OrthoAdam's and SOAP's own."""
    return [OptionGroup("optimizer", "optimizer", "orthoadam", TileOptions),
            OptionGroup("optimizer", "optimizer", "soap", TileOptions),
            OptionGroup("optimizer", "optimizer", "orthoadam", OrthoAdamOptions),
            OptionGroup("optimizer", "optimizer", "soap", SOAPOptions)]


for _group in option_groups():
    add_option_group(_group)
