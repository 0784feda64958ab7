from outlier_titan.checkpoint.manager import Checkpointer, list_checkpoints, load_model_for_eval, resolve_checkpoint_dir

__all__ = ["Checkpointer", "list_checkpoints", "load_model_for_eval", "resolve_checkpoint_dir"]
