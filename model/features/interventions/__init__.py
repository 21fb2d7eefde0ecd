"""Interventions (edits of the residual stream and of single heads for a request's own rows): their plan and
prefix-cache keys as a per-row feature (feature.py); the edits' math is model/interventions.py and model/edits.py."""

from model.features.interventions.feature import Interventions

__all__ = ["Interventions"]
