"""The study layer: sweeps of training runs (plan, run locally or on Slurm, status, collect) and their fits."""
