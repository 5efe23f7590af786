"""grpo-core: plugin-based GRPO-family reinforcement learning for language models."""

from grpo_core.hookspecs import hookimpl
from grpo_core.loss import LossInputs, LossOutput, call_loss
from grpo_core.plugins_manager import PluginError, make_plugin, option
from grpo_core.types import Completion, EnvStep, Episode, Prompt, Sample, SamplingParams, Turn

__version__ = "0.1.0"

__all__ = [
    "Completion",
    "EnvStep",
    "Episode",
    "LossInputs",
    "LossOutput",
    "PluginError",
    "Prompt",
    "Sample",
    "SamplingParams",
    "Turn",
    "call_loss",
    "hookimpl",
    "make_plugin",
    "option",
]
