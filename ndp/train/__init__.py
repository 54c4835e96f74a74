"""Training: config parsing (flags, YAML, env), data path, loop, checkpoints, presets, demo."""
from .config import TrainConfig, parse_config
from .loop import TrainResult, train

__all__ = ["TrainConfig", "parse_config", "train", "TrainResult"]
