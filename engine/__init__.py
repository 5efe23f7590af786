"""The in-process PyTorch engine: what the local trainer and sampler run (decoding: :mod:`.decoding`)."""
