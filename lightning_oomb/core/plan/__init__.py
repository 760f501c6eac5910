"""Memory and time of a training step before it runs (docs/planner.md).

``plan(model, config)`` (a ``PlanConfig``: the step options as a ``ChunkConfig``, the run around them, and
the pages' placement) returns a ``Plan``: GPU and host memory by line in bytes, whether it fits, the
FLOP floor and a predicted step time, and what would make it fit. ``plan_placed`` places the pages as a
training step would; ``max_context`` finds the longest context that fits.
"""

from .assumptions import (
    ATTENTION_EFFICIENCY, COLLECTIVE_GBPS, CUDA_CONTEXT_BYTES, DEFAULT_MATMUL_TFLOPS, FIRST_STEP_RUNTIME_BYTES,
    HOST_GROWTH_BYTES, HOST_PROCESS_BYTES, KEPT_ATTENTION_SHARE, KEPT_GRAPHS_SHARE, LINEAR_EFFICIENCY,
    OFFLOAD_SEGMENT_TOKENS, OFFLOAD_STAGING_SHARE, PLACEMENT_HEADROOM_SHARE, TP_COLWISE, TP_ROWWISE,
)
from .config import LOSS_GRADS, OPTIMIZERS, SHARDINGS, Pages, PlanConfig, Sharding
from .report import ContextLimit, Plan, PlanError, Suggestion
from .search import max_context, plan, plan_placed, this_gpu_memory
from .timing import StepTime, step_time

__all__ = [
    "ATTENTION_EFFICIENCY", "COLLECTIVE_GBPS", "CUDA_CONTEXT_BYTES", "DEFAULT_MATMUL_TFLOPS",
    "FIRST_STEP_RUNTIME_BYTES", "HOST_GROWTH_BYTES", "HOST_PROCESS_BYTES", "KEPT_ATTENTION_SHARE",
    "KEPT_GRAPHS_SHARE", "LINEAR_EFFICIENCY", "LOSS_GRADS", "OFFLOAD_SEGMENT_TOKENS", "OFFLOAD_STAGING_SHARE",
    "OPTIMIZERS", "PLACEMENT_HEADROOM_SHARE", "SHARDINGS", "TP_COLWISE", "TP_ROWWISE", "ContextLimit", "Pages", "Plan",
    "PlanConfig", "PlanError", "Sharding", "StepTime", "Suggestion", "max_context", "plan", "plan_placed",
    "step_time", "this_gpu_memory",
]
