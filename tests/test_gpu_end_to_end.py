"""On a CUDA GPU: bf16 train_step (Triton kernels and reference) against transformers' full-sequence bf16
training, with the tolerance set by how far that full-sequence bf16 run itself is from float32."""

import copy

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, Qwen2Config

import lightning_oomb
from tiny_models import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def grads(model):
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def two_layer_bf16_qwen2():
    """A random 2-layer Qwen2 (8 query heads of 64 sharing 2 KV heads) in bf16 on the GPU, training."""
    config = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    return AutoModelForCausalLM.from_config(config).cuda().to(torch.bfloat16).train()


def four_layer_fp32_qwen2_and_tokens() -> tuple[torch.nn.Module, torch.Tensor]:
    """A random 4-layer Qwen2 in float32 on the GPU (SDPA attention), training, and 3000 random tokens (1, 3000)."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda().float().train()
    return model, torch.randint(0, config.vocab_size, (1, 3000), device="cuda")


def test_bf16_train_step_within_full_sequence_bf16_error():
    model32, ids = four_layer_fp32_qwen2_and_tokens()

    model32(input_ids=ids, labels=ids).loss.backward()
    truth = grads(model32)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    model16.zero_grad(set_to_none=True)
    model16(input_ids=ids, labels=ids).loss.backward()
    plain = grads(model16)

    by_placement = {}
    # host: pinned pages streamed in segments of 1024 tokens; checkpointed layers recompute all but attention
    runs = [(a, o, False) for a in ("triton", "reference") for o in ("gpu", "host")] + [("triton", "gpu", True)]
    for attention, offload, checkpoint in runs:
        model16.zero_grad(set_to_none=True)
        lightning_oomb.train_step(model16, ids, chunk_size=512, page_size=128, attention=attention,
                                  offload=offload, segment_tokens=1024, checkpoint_layers=checkpoint)
        ours = by_placement[attention, offload, checkpoint] = grads(model16)
        for name in truth:
            plain_err, our_err = rel_err(plain[name], truth[name]), rel_err(ours[name], truth[name])
            assert our_err <= 2 * plain_err + 2e-3, (attention, offload, checkpoint, name, our_err, plain_err)
    # Host and GPU placement differ only in the order attention sums its key ranges.
    for name in truth:
        placement_err = rel_err(by_placement["triton", "host", False][name], by_placement["triton", "gpu", False][name])
        assert placement_err <= rel_err(plain[name], truth[name]) + 1e-3, (name, placement_err)


def test_bf16_mixed_train_step_within_full_sequence_bf16_mixed_error():
    """Under bf16 autocast (float32 weights, as Lightning's bf16-mixed) attention runs in bf16, as SDPA does
    there. The gradient against transformers' own autocast full-sequence run, each measured against float32
    without autocast."""
    model, ids = four_layer_fp32_qwen2_and_tokens()
    model(input_ids=ids, labels=ids).loss.backward()
    truth = grads(model)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
    plain = grads(model)
    for checkpoint in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lightning_oomb.train_step(model, ids, chunk_size=512, page_size=128, checkpoint_layers=checkpoint)
        ours = grads(model)
        for name in truth:
            plain_err, our_err = rel_err(plain[name], truth[name]), rel_err(ours[name], truth[name])
            assert our_err <= 2 * plain_err + 2e-3, (checkpoint, name, our_err, plain_err)


def test_step_that_cannot_fit_is_refused_before_allocating():
    from lightning_oomb.core.plan import PlanError

    config = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1 << 26)
    model = AutoModelForCausalLM.from_config(config).cuda().to(torch.bfloat16).train()
    ids = torch.zeros(1, 48 << 20, dtype=torch.long, device="cuda")  # 48M tokens: ~290 GB of pages
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with pytest.raises(PlanError, match="nothing was allocated"):
        lightning_oomb.train_step(model, ids, chunk_size=4096)
    assert torch.cuda.max_memory_allocated() - before < 1 << 30


def test_callback_refuses_a_pool_that_cannot_fit_at_fit_start():
    from lightning.pytorch import LightningModule, Trainer

    from lightning_oomb import OOMBStrategy, PagedKVCallback
    from lightning_oomb.core.plan import PlanError

    class Module(LightningModule):
        def __init__(self):
            super().__init__()
            config = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=2)
            self.model = AutoModelForCausalLM.from_config(config)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.1)

    trainer = Trainer(accelerator="gpu", devices=1, strategy=OOMBStrategy(), precision="bf16-true", max_steps=1,
                      logger=False, enable_checkpointing=False, callbacks=[PagedKVCallback(max_seq_len=48 << 20)])
    with pytest.raises(PlanError, match="nothing was allocated") as refused:
        trainer.fit(Module(), DataLoader([torch.zeros(64, dtype=torch.long)], batch_size=1))
    # the refusal's plan (and what it suggests) counts the state AdamW's first update will make
    assert "optimizer adamw" in str(refused.value) and "optimizer state (adamw" in str(refused.value)


_SPARSE = lightning_oomb.SparseConfig(budget_pages=2, sink_pages=1, local_pages=1)


@pytest.mark.parametrize("sparse, offload", [(None, "gpu"), (_SPARSE, "gpu"), (_SPARSE, "host")],
                         ids=["dense", "sparse", "sparse-host-pages"])
def test_host_waits_do_not_grow_with_the_number_of_chunks(sparse, offload):
    """A step may wait for the GPU a fixed number of times (labels per chunk, pages given back), never once per
    chunk: each such wait leaves the GPU idle while Python launches the next kernels. Sparse steps with every
    page on the host too (gathers of selected pages, additions into host gradient pages)."""
    import warnings
    from collections import Counter

    config = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(config).cuda().to(torch.bfloat16).train()

    def waits(n_chunks: int) -> list[str]:
        ids = torch.randint(0, config.vocab_size, (1, 256 * n_chunks), device="cuda")
        options = dict(chunk_size=256, page_size=64, sparse=sparse, offload=offload)
        lightning_oomb.train_step(model, ids, **options)  # compiles, warms
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                lightning_oomb.train_step(model, ids, **options)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]

    four, eight = Counter(waits(4)), Counter(waits(8))
    grown = {line: (four[line], n) for line, n in eight.items() if n > four[line]}
    assert not grown, f"lines that wait once per chunk (waits with 4 chunks, with 8): {grown}"


def test_served_loss_gradients_kept_on_the_host_or_recomputed_give_the_same_gradient(monkeypatch):
    """A served forward keeps each chunk's dL/dh from stage 1 for stage 2: on the GPU, or in pinned host
    memory where the planner puts them (here forced): bitwise the same gradient either way. Recomputed in
    stage 2 (no room to keep them): the same loss, and gradients within bf16 rounding of the output layer's
    float32 sums taken in the other chunk order (relative 1e-2; CPU float32 tests hold it to 1e-5)."""
    import dataclasses

    from lightning_oomb.core import schedule

    torch.manual_seed(0)
    model = two_layer_bf16_qwen2()
    ids = torch.randint(0, model.config.vocab_size, (1, 2048), device="cuda")
    chunks = lightning_oomb.ChunkConfig(chunk_size=512, page_size=128, keep_graphs=0)
    place = schedule.place_step
    results = {}
    for where in ("gpu", "host", "recomputed"):
        monkeypatch.setattr(schedule, "place_step", lambda *a, **k: dataclasses.replace(
            place(*a, **k), loss_grads=where))
        model.zero_grad(set_to_none=True)
        with lightning_oomb.serve(model, chunks):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results[where] = (loss.detach(), grads(model))
    assert torch.equal(results["host"][0], results["gpu"][0])
    assert torch.equal(results["recomputed"][0], results["gpu"][0])
    for name, grad in results["gpu"][1].items():
        assert torch.equal(results["host"][1][name], grad), name
        assert rel_err(results["recomputed"][1][name].float(), grad.float()) <= 1e-2, name


def test_sparse_gradient_pages_on_the_host_give_the_gpu_pages_bits(monkeypatch):
    """Sparse bf16 step with pages of 128 and chunks on page borders (on an H200: the warp-specialised page
    kernels): every layer's gradient pages pinned on the host, where each chunk's share is staged and added
    from the GPU until stage 2 moves them into dead K/V pages, gives bitwise the gradient of all pages on the
    GPU. The K/V pages stay on the GPU (offload="host" would move them too: test_host_kv.py)."""
    import dataclasses

    from lightning_oomb.core import schedule
    from lightning_oomb.core.schedule import cached_pool

    place_step = schedule.place_step
    monkeypatch.setattr(schedule, "place_step",
                        lambda *args, **kwargs: dataclasses.replace(place_step(*args, **kwargs), host_kv_layers=0))
    torch.manual_seed(0)
    model = two_layer_bf16_qwen2()
    ids = torch.randint(0, model.config.vocab_size, (1, 2048), device="cuda")
    # Per query tile in both (offload="host" would select per chunk): the same step, its pages elsewhere.
    sparse = lightning_oomb.SparseConfig(budget_pages=4, sink_pages=1, local_pages=1, per_query_tile=True)
    results = {}
    for offload in ("gpu", "host"):
        model.zero_grad(set_to_none=True)
        # No kept graphs on either side (all-GPU pages would keep more than the last): the output layer's
        # float32 gradient sum then runs in the same order too.
        loss = lightning_oomb.train_step(model, ids, chunk_size=512, page_size=128, sparse=sparse, offload=offload,
                                         grad_dtype=torch.bfloat16, keep_graphs=0, keep_attention=0)
        pool = cached_pool(model)
        assert pool.host_grad_layers == (2 if offload == "host" else 0)
        # Stage 2 moved both host layers into dead K/V pages before chunk [512, 1024): copies from the host and
        # additions into GPU slots take part too.
        assert pool.host_grads_moved == ([(0, 1024), (1, 1024)] if offload == "host" else [])
        results[offload] = (loss, grads(model))
    assert torch.equal(results["host"][0], results["gpu"][0])
    for name, grad in results["gpu"][1].items():
        assert torch.equal(results["host"][1][name], grad), name


def test_attention_outputs_kept_on_the_host_give_the_same_bits(monkeypatch):
    """Sparse bf16 step, chunks on page borders: the first 3 of 4 chunks' attention outputs go to pinned host
    memory on a side stream in stage 1 and come back one layer ahead in stage 2: the loss and gradient of
    recomputing them, bitwise, and the buffer is pinned once for both steps."""
    import dataclasses

    from lightning_oomb.core import schedule
    from lightning_oomb.core.schedule import cached_pool

    torch.manual_seed(0)
    model = two_layer_bf16_qwen2()
    ids = torch.randint(0, model.config.vocab_size, (1, 2048), device="cuda")
    sparse = lightning_oomb.SparseConfig(budget_pages=4, sink_pages=1, local_pages=1)
    place = schedule.place_step
    results = []
    for on_host in (0, 3, 3):
        monkeypatch.setattr(schedule, "place_step", lambda *a, **k: dataclasses.replace(
            place(*a, **k), kept_chunks=0, graph_chunks=0, host_kept_chunks=on_host))
        model.zero_grad(set_to_none=True)
        loss = lightning_oomb.train_step(model, ids, chunk_size=512, page_size=128, sparse=sparse)
        results.append((loss, grads(model), cached_pool(model)._host_kept))
    assert results[1][2] is results[2][2] and results[1][2].out.is_pinned()
    for loss, got, _ in results[1:]:
        assert torch.equal(loss, results[0][0])
        for name, grad in results[0][1].items():
            assert torch.equal(got[name], grad), name
