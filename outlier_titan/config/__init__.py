from outlier_titan.config.job_config import JobConfig
from outlier_titan.config.manager import parse_args, to_toml
from outlier_titan.errors import ConfigError

__all__ = ["JobConfig", "ConfigError", "parse_args", "to_toml"]
