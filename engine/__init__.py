"""The in-process PyTorch engine that plugins share (the local and fsdp backends, the local sampler,
the distill advantage, the reward-model reward): no hooks, and no plugin imports."""
