"""The serving engine under load (``python -m benchmarks.serving_load``): see ``README.md``."""
