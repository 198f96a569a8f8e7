"""Vision Transformer training pipeline."""

__version__ = "0.1.0"  # the package version (pyproject.toml reads it from here)
