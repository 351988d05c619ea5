"""Train a model: python src/train.py [group=option ...] [key=value ...] (see conf/train.yaml)."""
import hydra
from omegaconf import DictConfig

from recforge.errors import UserInputError
from recforge.pipeline import metric_value, train


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    try:
        metrics = train(cfg)
    except UserInputError as error:
        raise SystemExit(f"recforge: {error}") from None
    # Sweepers (Optuna) optimise the returned value.
    return metric_value(metrics, cfg.get("optimized_metric")) if cfg.get("train", True) else None


if __name__ == "__main__":
    main()
