"""Vision Transformer training pipeline."""
