"""grpo-reward-math-verify: a grpo-core reward that checks final answers with Math-Verify.

The plugin is :class:`grpo_reward_math_verify.reward.MathVerifyReward` (entry point
``reward.math_verify``). The top level stays light (no grpo-core, no math-verify) so the worker
process, ``python -m grpo_reward_math_verify.worker``, starts without importing torch.
"""

__version__ = "0.1.0"
