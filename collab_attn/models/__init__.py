"""Hugging Face integration: model families, collaborative config and model classes registered with the Auto
classes, conversion of pretrained checkpoints (one surgery for every method), head-importance hooks. What runs after a
conversion (calibration statistics, the fits to the original) is ``collab_attn.fitting``, which imports this package."""
