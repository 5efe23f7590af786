"""grpo-core: plugin-based GRPO-family reinforcement learning for language models."""

from grpo_core.api import run
from grpo_core.errors import PluginError
from grpo_core.hookspecs import hookimpl
from grpo_core.loss import LossInputs, LossOutput
from grpo_core.options import option
from grpo_core.plugins_manager import call_loss, make_plugin
from grpo_core.types import Completion, EnvStep, Episode, Prompt, PromptImages, Sample, SamplingParams, Turn

__version__ = "0.1.0"

__all__ = [
    "Completion",
    "EnvStep",
    "Episode",
    "LossInputs",
    "LossOutput",
    "PluginError",
    "Prompt",
    "PromptImages",
    "Sample",
    "SamplingParams",
    "Turn",
    "call_loss",
    "hookimpl",
    "make_plugin",
    "option",
    "run",
]
