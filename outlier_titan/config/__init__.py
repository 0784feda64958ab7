from outlier_titan.config.job_config import JobConfig
from outlier_titan.config.manager import ConfigError, parse_args, to_toml

__all__ = ["JobConfig", "ConfigError", "parse_args", "to_toml"]
