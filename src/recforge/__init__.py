"""recforge: Hydra + Lightning experiments for recommender-systems research."""

__version__ = "0.1.0"
