"""Expert parallelism (EP) over ``torch.distributed``: dispatch and combine all-to-alls around
sonic's local expert computation."""

from sonic.distributed.eplb import (ExpertLoad, Placement, plan_placement, reduce_replica_grads,
                                   sum_over_replicas)
from sonic.distributed.experts import ep_moe_experts
from sonic.distributed.moe import ExpertParallelMoE
from sonic.distributed.plan import MAX_CHUNKS, DispatchChunk, DispatchPlan, plan_dispatch
from sonic.distributed.token_rounding import ep_token_rounding_routing

__all__ = ["MAX_CHUNKS", "DispatchChunk", "DispatchPlan", "ExpertLoad", "ExpertParallelMoE",
           "Placement", "ep_moe_experts", "ep_token_rounding_routing", "plan_dispatch",
           "plan_placement", "reduce_replica_grads", "sum_over_replicas"]
