"""Tensor parallelism: the shard plan (which slice of each weight a rank holds), rank 0's model (`TPModel`,
`launch`) and the worker processes that follow it."""

from model.parallel.plan import ShardPlan, TPRank, allowed_sizes, parameter_bytes
from model.parallel.rank0 import TPModel, launch

__all__ = ["ShardPlan", "TPModel", "TPRank", "allowed_sizes", "launch", "parameter_bytes"]
