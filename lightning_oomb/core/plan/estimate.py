"""The plan of one ``PlanConfig``: its memory lines and its time, collectives and host transfers included."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..model_shape import ModelShape
from .collectives import step_collectives
from .config import PlanConfig
from .host_transfers import (
    host_add_seconds, host_gather_bytes, host_gather_seconds, streamed_bytes_by_chunk, streamed_seconds,
)
from .memory import memory_lines
from .report import Plan
from .timing import step_time


def estimate_step(
    shape: ModelShape, config: PlanConfig, gpu_memory: int, host_memory: int, machine: str
) -> Plan:
    """The plan of ``config`` for ``shape`` on a machine of ``gpu_memory`` and ``host_memory`` bytes, as it is:
    nothing placed or searched."""
    gpu, host = memory_lines(shape, config)
    time = step_time(shape, config)
    collectives = step_collectives(shape, config)
    streamed_in, streamed_out = streamed_bytes_by_chunk(shape, config)
    time = dataclasses.replace(time, host_add_s=host_add_seconds(shape, config),
                               host_gather_s=host_gather_seconds(
                                   shape, config, time.compute_s * (1 - time.stage_1_flops / time.total_flops)),
                               host_gather_bytes=host_gather_bytes(shape, config),
                               stream_s=streamed_seconds(streamed_in, streamed_out, np.array(time.chunk_busy_s)),
                               stream_bytes=float(streamed_in.sum()),
                               all_reduce_s=sum(x.seconds for x in collectives
                                                if x.kind == "all-reduce" and not x.activations),
                               sharding_s=sum(x.seconds for x in collectives if x.kind != "all-reduce"),
                               tensor_parallel_s=sum(x.seconds for x in collectives if x.activations))
    return Plan(shape, config, gpu, host, time, gpu_memory, host_memory, machine)
