"""Expert parallelism (EP) over ``torch.distributed``: dispatch and combine all-to-alls around
sonic's local expert computation."""

from sonic.distributed.experts import DispatchPlan, ep_moe_experts, plan_dispatch
from sonic.distributed.moe import ExpertParallelMoE

__all__ = ["DispatchPlan", "ExpertParallelMoE", "ep_moe_experts", "plan_dispatch"]
