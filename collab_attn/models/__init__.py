"""Hugging Face integration: model families, collaborative config and model classes registered with the Auto
classes, conversion of pretrained checkpoints (one surgery for every method), calibration and importance hooks."""
