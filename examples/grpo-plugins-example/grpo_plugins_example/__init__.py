"""grpo-plugins-example: a reward (``brevity``) and a loss (``w_reinforce``) for grpo-core.

Each plugin lives in its own module and is registered by an entry point in pyproject.toml;
nothing is imported here, so listing the plugins imports only the one asked for.
"""

__version__ = "0.1.0"
