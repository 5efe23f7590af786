"""Samplers that run apart from the trainer (plugin kind ``sampler``)."""
