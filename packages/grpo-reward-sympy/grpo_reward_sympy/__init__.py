"""grpo-reward-sympy: a grpo-core reward that checks final answers by symbolic equivalence.

The plugin is :class:`grpo_reward_sympy.reward.SympyReward` (entry point ``reward.sympy``).
This package's top level stays light (no grpo-core, no sympy) so the sympy worker process,
``python -m grpo_reward_sympy.worker``, starts without importing torch.
"""

__version__ = "0.1.0"
