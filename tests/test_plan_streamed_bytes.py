"""The planner's bytes for a dense step with its pages streamed from host memory
(``plan.host_transfers.streamed_bytes_by_chunk``) equal what ``core.offload.Streamer`` counts moving, byte for
byte, on the CPU: global layers, and global ones beside sliding-window layers (which keep their pages on the
device: only the others stream), packed documents, chunks that pages and segments do not divide, layer
checkpointing on and off, attention outputs kept from stage 1, the loss in stage 1."""

import dataclasses

import numpy as np
import pytest
import torch

from lightning_oomb.core.config import ChunkConfig
from lightning_oomb.core.model_shape import ModelShape
from lightning_oomb.core.placement import Placement
from lightning_oomb.core.plan.config import Pages, PlanConfig
from lightning_oomb.core.plan.host_transfers import streamed_bytes_by_chunk, streamed_seconds
from lightning_oomb.core.schedule import ChunkedSequence, new_pool
from tiny_models import VOCAB, tiny_model

CASES = {
    # family, window, tokens, chunk, page, segment, document length, layer checkpointing, chunks whose
    # attention outputs stage 1 keeps in host memory, loss in stage 1 (a served step)
    "global": ("qwen2", None, 45, 6, 4, 12, None, False, 0, False),
    "global, checkpointed": ("qwen2", None, 40, 8, 4, 8, None, True, 0, False),
    "global, kept outputs": ("qwen2", None, 40, 8, 4, 8, None, False, 2, False),
    "global, loss in stage 1": ("qwen2", None, 40, 8, 4, 8, None, False, 0, True),
    "window": ("gemma3_text", 6, 40, 8, 4, 16, None, False, 0, False),
    "window, pages across chunks": ("gemma3_text", 7, 43, 6, 4, 8, None, True, 0, False),
    "every layer windowed": ("mistral", 6, 40, 8, 4, 16, None, False, 0, False),
    "documents": ("qwen2", None, 44, 8, 4, 8, 10, False, 0, False),
}


@pytest.mark.parametrize("case", CASES)
def test_planned_streamed_bytes_equal_the_streamers(case):
    family, window, tokens, chunk, page, segment, document_length, checkpoint, host_kept, stage_1_loss = CASES[case]
    # Gemma 3: a local layer, then a global one (the last layer global, as the planner takes it).
    layers = {"layer_types": ["sliding_attention", "full_attention"]} if family == "gemma3_text" else {}
    model = tiny_model(family, **({"sliding_window": window} if window else {}), **layers)
    ids = torch.randint(0, VOCAB, (1, tokens))
    position_ids = None
    if document_length:
        position_ids = (torch.arange(tokens) % document_length)[None]
    config = ChunkConfig(chunk_size=chunk, page_size=page, offload="host", segment_tokens=segment,
                         attention="reference", checkpoint_layers=checkpoint)
    pools = {}

    def provide(spec, pages, with_grads, placement):  # the step's own spec, its pages streamed
        pools.setdefault("pool", new_pool(spec, pages, page, torch.device("cpu"), with_grads,
                                          Placement("host", segment, 1)))
        return pools["pool"]

    seq = ChunkedSequence(model, ids, config=config, pools=provide, position_ids=position_ids,
                          stage_1_loss=stage_1_loss)
    # A CPU placement keeps no attention outputs (its memory is the host's); asked for here as a GPU's would be.
    seq.placement = dataclasses.replace(seq.placement, host_kept_chunks=host_kept)
    seq.fill()
    seq.backward()
    pool = pools["pool"]
    assert pool.window_layers == ([0] if family == "gemma3_text" else [0, 1] if window else [])
    stats = pool.streamer.take_stats()

    shape = ModelShape.resolve(model)
    plan_config = PlanConfig(tokens, config, precision="32-true", pages=Pages(streamed=True),
                             document_length=document_length, host_kept_chunks=host_kept, stage_1_loss=stage_1_loss)
    h2d, d2h = streamed_bytes_by_chunk(shape, plan_config)
    assert (h2d.sum(), d2h.sum()) == (stats.h2d_bytes, stats.d2h_bytes)


def test_streamed_time_is_what_outlasts_each_chunks_compute():
    """A chunk's copies at STREAM_GBPS overlap its compute; only the excess adds. No streaming, no bytes."""
    shape = ModelShape.resolve("qwen2.5-7b")
    chunk = ChunkConfig(chunk_size=4096, offload="host")
    streamed = PlanConfig(131072, chunk, pages=Pages(streamed=True))
    h2d, d2h = streamed_bytes_by_chunk(shape, streamed)
    assert len(h2d) == 32 and h2d[0] < h2d[-1]  # later chunks stream a longer past
    busy = np.zeros(32)
    assert streamed_seconds(h2d, d2h, busy) == pytest.approx(float((h2d / 53e9).sum()))
    assert streamed_seconds(h2d, d2h, busy + 1e3) == 0.0
    on_gpu = PlanConfig(131072, chunk)
    assert streamed_bytes_by_chunk(shape, on_gpu)[0].sum() == 0.0
