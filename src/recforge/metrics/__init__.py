"""Evaluation metrics."""

from recforge.metrics.ctr import CTRMetrics
from recforge.metrics.ranking import TIE_POLICIES, RankingMetrics, ranks_from_counts

__all__ = ["TIE_POLICIES", "CTRMetrics", "RankingMetrics", "ranks_from_counts"]
