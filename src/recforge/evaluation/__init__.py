"""Evaluation protocols: what a task computes on its validation and test splits."""

from recforge.evaluation.ctr import CTREvaluation
from recforge.evaluation.full_ranking import FullRanking

__all__ = ["CTREvaluation", "FullRanking"]
