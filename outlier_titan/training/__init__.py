"""The training run's parts above models, optimizers and parallelism: the dry-run planner, the divergence guard and
the step's helpers; the set-up order and the loop are ``outlier_titan.trainer``."""
