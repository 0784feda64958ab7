"""Reading data loaders in tests."""

import torch


def step_rows(loaders, steps: int) -> list[torch.Tensor]:
    """Per step: the rows of all ranks (rank order, micro-batch order) concatenated, inputs + last label."""
    its = [iter(dl) for dl in loaders]
    out = []
    for _ in range(steps):
        rows = []
        for dl, it in zip(loaders, its):
            ds = dl.dataset
            for _ in range(ds.micro_batches_per_step):
                x, y = next(it)
                assert x.shape == y.shape == (ds.micro_batch_size, ds.seq_len) and x.dtype == torch.int64
                assert torch.equal(x[:, 1:], y[:, :-1])
                rows.append(torch.cat([x, y[:, -1:]], dim=1))
        out.append(torch.cat(rows))
    return out
