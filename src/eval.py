"""Evaluate a checkpoint on the test split: python src/eval.py ckpt_path=outputs/.../last.ckpt"""
import hydra
from omegaconf import DictConfig

from recforge.errors import UserInputError
from recforge.pipeline import evaluate


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def main(cfg: DictConfig) -> None:
    try:
        evaluate(cfg)
    except UserInputError as error:
        raise SystemExit(f"recforge: {error}") from None


if __name__ == "__main__":
    main()
