"""The tile engine: Adam in a tile-local Kronecker basis, on the local shards of (DTensor) parameters.

For a tile G_T of a 2-D weight with bases B0 (rows) and B1 (columns):
    Ĝ = B0ᵀ G_T B1,   m̂ ← β1 m̂ + (1-β1) Ĝ,   v̂ ← β2 v̂ + (1-β2) Ĝ²,   U_T = B0 (m̂ / (√v̂ + ε)) B1ᵀ,
with decoupled weight decay in the original basis. OrthoAdam's bases are fixed and regenerated from a seed
(``optim/orthoadam.py``); SOAP's are eigenbases of per-tile factors (``optim/soap.py``). This package holds what
both share, one concern per module (``optim/README.md`` walks through them):

  settings the ``[optimizer]`` keys of the engine, OrthoAdam and SOAP (defaults, help; registered into [optimizer] on import)
  options  ``EngineOptions``: the settings and the tile-size policy (which edge each axis asks for)
  shards   DTensor shard arithmetic: the global indices each rank holds along an axis
  plan     the global tile grid of one parameter (``plan_param``): rotated axes, tile edges, the alignment
           check against every shard, the local segments; ``TileAlignmentError``
  state    optimizer state beside the shards (DTensors with the parameter's mesh and placements)
  kernels  tile gather / scatter and the batched per-tile rotation
  adam     Adam's element-wise math, eager (the reference) and compiled
  base     ``TileAdamBase``: the optimizer skeleton, the non-finite guard and the checkpoint checks

The grid is global, so the tile holding element (i, j) does not depend on the mesh: each rank works only on
the tiles inside its shard, with no communication, and gets the same numbers at any world size whose shards
fall on tile edges. ``tile_size = 0`` (the default) makes every axis one tile, as the papers run OrthoAdam and
SOAP; ``tile_size > 0`` is the shard-local tile variant.
"""
