"""OOMBModelParallelStrategy (FSDP2-sharded decoder layers) in real Lightning Trainers over 2 gloo processes on
the CPU: the gradient averaged over the ranks is transformers' full-sequence gradient of both ranks' sequences
together, and AdamW's weights are those of one process training on those batches (fp32, reference attention).

The two processes are started once for the module, as torchrun would start them (``LOCAL_RANK`` and the rendezvous
in the environment, so that Lightning launches nothing), and run every Trainer of the tests one after the other:
starting processes costs far more than these tiny steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import lightning_oomb
from lightning_oomb import OOMBModelParallelStrategy, OOMBStrategy, PagedKVCallback, SparseConfig
from lightning_oomb.lightning.cli import export_hf
from lightning_oomb.core.errors import SetupError
from lightning_oomb.lightning.model_parallel import check_tensor_parallel
from test_ddp import CHUNK, PAGE, TRAINER, RankRows, module_grads, sequences
from test_strategy import UserModule, weights
from tiny_models import (as_torchrun_rank, assert_adamw_updates_close, assert_grads_close, rel_err, spawn_ranks,
                         tiny_model)

WORLD = 2
ITEMS = sequences(6)  # rank 1's first batch has no valid label, the others uneven counts
TP = {"tensor_parallel_size": WORLD, "data_parallel_size": 1}
TP_SPARSE = SparseConfig(budget_pages=3, sink_pages=1, local_pages=1)
TP_ITEMS = [ITEMS[0], ITEMS[2]]  # one row per step under TP: rows with valid labels


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as one process holds it (gathered from its shards: a collective)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


# FSDP2's all-gathers and reduce-scatters so far in this process, by the torch.distributed function it calls.
CALLS = {"all_gather_single": 0, "reduce_scatter_single": 0}


def _count_fsdp_collectives() -> None:
    for name in CALLS:
        collective = getattr(dist, name)

        def counted(*args, _name=name, _collective=collective, **kwargs):
            CALLS[_name] += 1
            return _collective(*args, **kwargs)

        setattr(dist, name, counted)


class Record(Callback):
    """Rank 0 saves the whole gradients as the first optimizer step sees them, with the count of FSDP's
    collectives in that step, and the whole weights at the end; every rank takes part in the gathers."""

    def __init__(self, out):
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.before = dict(CALLS)
        if batch_idx == 0 and trainer.global_rank == 0:  # what the placement reserves beyond the shards
            torch.save(trainer.strategy.ranks.step_gpu_bytes, f"{self.out}-gathered.pt")
            torch.save([group["foreach"] for group in trainer.optimizers[0].param_groups], f"{self.out}-foreach.pt")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        calls = {name: CALLS[name] - self.before[name] for name in CALLS}
        grads = {n: _whole(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None}
        if trainer.global_step == 0 and trainer.global_rank == 0:
            torch.save(grads, f"{self.out}-grads.pt")
            torch.save(calls, f"{self.out}-calls.pt")

    def on_train_end(self, trainer, pl_module):
        final = {n: _whole(p) for n, p in pl_module.named_parameters() if p.requires_grad}
        if trainer.global_rank == 0:
            torch.save(final, f"{self.out}-weights.pt")


class ForeachAdamW(UserModule):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=True)


def _fit(out, family, items, steps, strategy_kwargs, callbacks=(), ckpt_path=None, optimizer="adamw",
         **trainer_kwargs):
    module = UserModule(tiny_model(family), lr=1e-2 if optimizer == "adamw" else 0.5, optimizer=optimizer)
    strategy = OOMBModelParallelStrategy(chunk_size=CHUNK, page_size=PAGE, attention="reference", **strategy_kwargs)
    trainer_kwargs = {**TRAINER, **trainer_kwargs}
    trainer = Trainer(devices=WORLD, strategy=strategy, max_steps=steps, callbacks=[Record(out), *callbacks],
                      use_distributed_sampler=False, **trainer_kwargs)
    trainer.fit(module, datamodule=RankRows(items), ckpt_path=ckpt_path)
    return trainer, module


def _ranks(rank: int, world: int, port: int, out: str) -> None:
    as_torchrun_rank(rank, world, port)
    _count_fsdp_collectives()
    trainer, module = _fit(f"{out}/zero2", "qwen2", ITEMS[:4], 2, {})
    export_hf(trainer, module, None, f"{out}/zero2-export")  # the CLI's export: every rank gathers, rank 0 writes
    _fit(f"{out}/zero3", "qwen2-tied", ITEMS[:2], 1, {"sharding": "zero3", "checkpoint_layers": True})
    _fit(f"{out}/zero1", "llama", ITEMS[:4], 1, {"sharding": "zero1"}, accumulate_grad_batches=2)
    _fit(f"{out}/clipped", "llama", ITEMS[:4], 2, {}, optimizer="sgd", gradient_clip_val=0.05)
    # Resume: one step, a checkpoint (one file, through AtomicCheckpointIO), a fresh module and Trainer that
    # restore it and take the second step on the second batch: zero2's two steps.
    saved = ModelCheckpoint(dirpath=f"{out}/ckpt", every_n_train_steps=1)
    _fit(f"{out}/first", "qwen2", ITEMS[:2], 1, {}, callbacks=[saved], enable_checkpointing=True)
    _fit(f"{out}/resumed", "qwen2", ITEMS[2:4], 2, {}, ckpt_path=saved.best_model_path or saved.last_model_path)
    # Sharded checkpoint folders (torch.distributed.checkpoint, every rank its own shards): two steps on the
    # first batch, each saved as last.ckpt (the second replacing the first), resumed for a third step on the
    # second batch; against the three steps run through.
    sharded = {"save_distributed_checkpoint": True}
    saved = ModelCheckpoint(dirpath=f"{out}/sharded", save_last=True, save_top_k=0, every_n_train_steps=1)
    _fit(f"{out}/sharded-first", "qwen2", ITEMS[:2], 2, sharded, callbacks=[saved], enable_checkpointing=True,
         max_epochs=2)
    _fit(f"{out}/sharded-resumed", "qwen2", ITEMS[2:4], 3, sharded, ckpt_path=f"{out}/sharded/last.ckpt")
    _fit(f"{out}/three-steps", "qwen2", ITEMS[:2] * 2 + ITEMS[2:4], 3, {})
    # Tensor parallel over the 2 processes (one data-parallel rank): both run the same row in each step.
    trainer, module = _fit(f"{out}/tp", "qwen2", TP_ITEMS, 2, TP)
    export_hf(trainer, module, None, f"{out}/tp-export")
    # Sparse attention, each KV head its own pages (a pick among the past's middle pages in the last chunk).
    _fit(f"{out}/tp-sparse", "qwen2", TP_ITEMS, 1, {**TP, "sparse": TP_SPARSE})
    # A pool sized at fit start (as for a data module with seq_len): this rank's KV heads only.
    _fit(f"{out}/tp-checkpointed", "llama", TP_ITEMS, 1, {**TP, "checkpoint_layers": True},
         callbacks=[PagedKVCallback(max_seq_len=TP_ITEMS[0]["input_ids"].shape[-1])])
    # Last, since it ends a fit in an exception: foreach asked for a group of sharded and whole weights.
    strategy = OOMBModelParallelStrategy(chunk_size=CHUNK, page_size=PAGE, attention="reference")
    try:
        Trainer(devices=WORLD, strategy=strategy, max_steps=1, use_distributed_sampler=False, **TRAINER).fit(
            ForeachAdamW(tiny_model("qwen2")), datamodule=RankRows(ITEMS[:2]))
    except SetupError as refusal:
        torch.save(str(refusal), f"{out}/foreach-refusal.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    spawn_ranks(_ranks, WORLD, str(out))

    def load(name, what):
        if what in ("export", "folder"):
            return out / (f"{name}-export" if what == "export" else name)
        return torch.load(out / f"{name}-{what}.pt")

    return load


def one_process_adamw(family, items, steps, rows=WORLD):
    """Weights after ``steps`` AdamW steps of OOMBStrategy on one process, ``rows`` rows per batch."""
    module = UserModule(tiny_model(family), lr=1e-2, optimizer="adamw")
    Trainer(devices=1, max_steps=steps, strategy=OOMBStrategy(chunk_size=CHUNK, page_size=PAGE, attention="reference"),
            **TRAINER).fit(module, DataLoader(items, batch_size=rows))
    return weights(module)


LAYERS, CHUNKS = 2, -(-len(ITEMS[0]["input_ids"]) // CHUNK)  # tiny_model's decoder layers, chunks per sequence


def test_zero2_adamw_steps_equal_one_process(runs):
    """zero2 (the default): rank 1's first batch has no valid label; the averaged gradient is transformers' of
    both rows, and two AdamW steps give the weights of one process with both rows per batch. Each layer is
    gathered once in the step and its gradients reduce-scattered after every chunk."""
    assert runs("zero2", "calls") == {"all_gather_single": LAYERS, "reduce_scatter_single": LAYERS * CHUNKS}
    assert_grads_close(runs("zero2", "grads"), module_grads(tiny_model("qwen2"), ITEMS[:2]), 1e-5)
    start = weights(UserModule(tiny_model("qwen2")))
    assert_adamw_updates_close(runs("zero2", "weights"), one_process_adamw("qwen2", ITEMS[:4], 2), start)


def test_groups_of_sharded_and_whole_weights_step_tensor_by_tensor(runs):
    """torch's foreach AdamW (its default on CUDA) cannot step DTensor shards and whole tensors in one list: the
    strategy sets such a group's foreach to False (the update is the same, as the test above shows), and refuses
    a group that asked for foreach=True, naming the way out."""
    assert runs("zero2", "foreach") == [False]
    assert runs("foreach", "refusal") == (
        "AdamW with foreach=True: parameter group 0 holds the sharded decoder layers and the whole embeddings, "
        "norm and output layer, which torch's foreach kernels cannot step together; leave foreach unset (the "
        "strategy steps such a group tensor by tensor) or put the whole weights in a group of their own")


def test_zero3_layer_checkpointing_tied_embeddings(runs):
    """zero3 gathers the layers again for the chunks' forwards and backwards."""
    assert runs("zero3", "calls")["all_gather_single"] > 2 * LAYERS * CHUNKS
    assert_grads_close(runs("zero3", "grads"), module_grads(tiny_model("qwen2-tied"), ITEMS[:2]), 1e-5)


def test_zero1_accumulation(runs):
    """zero1 sums the layers' gradients over the chunks of 2 micro-batches and reduces them once: the mean of
    transformers' gradients of the two micro-batches of 2 rows each."""
    assert runs("zero1", "calls") == {"all_gather_single": 2 * LAYERS, "reduce_scatter_single": LAYERS}
    first, second = module_grads(tiny_model("llama"), ITEMS[:2]), module_grads(tiny_model("llama"), ITEMS[2:4])
    assert_grads_close(runs("zero1", "grads"), {n: (first[n] + second[n]) / 2 for n in first}, 1e-5)


def test_clipping_takes_the_norm_over_sharded_and_whole_gradients(runs):
    """Clipped SGD steps give plain one-process training's weights (as test_ddp's clipping test)."""
    plain = UserModule(tiny_model("llama"))
    start = weights(plain)
    Trainer(devices=1, max_steps=2, gradient_clip_val=0.05, **TRAINER).fit(plain, DataLoader(ITEMS[:4], batch_size=2))
    got, want = runs("clipped", "weights"), weights(plain)
    worst = max((rel_err(got[n] - start[n], want[n] - start[n]), n) for n in want)
    assert worst[0] <= 1e-4, f"update of {worst[1]} differs by {worst[0]:.2e}"


def test_resume_from_checkpoint_takes_the_same_step(runs):
    got, want = runs("resumed", "weights"), runs("zero2", "weights")
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_sharded_checkpoint_folder_resumes_the_same_step(runs):
    """A sharded checkpoint folder replaced in place by the next save (nothing partial or old left beside it)
    and resumed takes the step the run never stopped would have taken, bit for bit (weights and AdamW state
    restored from every rank's shards)."""
    folder = runs("sharded", "folder")
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"] and (folder / "last.ckpt").is_dir()
    got, want = runs("sharded-resumed", "weights"), runs("three-steps", "weights")
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_tensor_parallel_adamw_steps_equal_one_process(runs):
    """tensor_parallel_size=2: each rank computes attention for 1 of qwen2's 2 KV heads (its K/V pages hold that
    one) and half the MLP; the gradient of every parameter, whole, is transformers' of the row both ranks ran,
    and two AdamW steps give one process's weights. No FSDP collective runs (one data-parallel rank).

    The updates are compared at 1e-3: o_proj's and down_proj's outputs are summed over the ranks in another order
    than one process sums them (gradients ~1e-6 apart), and AdamW divides each element by its own magnitude, so
    the elements of k_proj.bias whose gradients are ~1e-7 move by 3e-4 of that 16-element parameter's update.
    The FSDP cases compute each gradient element as one process does, up to the sum over rows: within 1e-5."""
    assert runs("tp", "calls") == {"all_gather_single": 0, "reduce_scatter_single": 0}
    assert_grads_close(runs("tp", "grads"), module_grads(tiny_model("qwen2"), TP_ITEMS[:1]), 1e-5)
    got, want = runs("tp", "weights"), one_process_adamw("qwen2", TP_ITEMS, 2, rows=1)
    start = weights(UserModule(tiny_model("qwen2")))
    worst = max((rel_err(got[n] - start[n], want[n] - start[n]), n) for n in want)
    assert worst[0] <= 1e-3, f"update of {worst[1]} differs by {worst[0]:.2e}"


def test_tensor_parallel_layer_checkpointing(runs):
    assert_grads_close(runs("tp-checkpointed", "grads"), module_grads(tiny_model("llama"), TP_ITEMS[:1]), 1e-5)


def test_tensor_parallel_sparse_steps_equal_one_process(runs):
    """Each rank selects the pages of its own KV heads as one process selects them for those heads: the
    gathered gradient is one process's sparse gradient (not the dense one: a page was left out)."""
    item = TP_ITEMS[0]
    model = tiny_model("qwen2")
    lightning_oomb.train_step(model, item["input_ids"][None], item["labels"][None], chunk_size=CHUNK, page_size=PAGE,
                              attention="reference", sparse=TP_SPARSE)
    want = {f"model.{n}": p.grad for n, p in model.named_parameters()}
    assert_grads_close(runs("tp-sparse", "grads"), want, 1e-5)
    dense = module_grads(tiny_model("qwen2"), TP_ITEMS[:1])
    assert max(rel_err(want[n], dense[n]) for n in dense) > 1e-3


def test_tensor_parallel_refusals():
    """Sizes that do not split the KV heads (qwen3's 3) and LoRA: refused before any work, each naming its fix."""
    with pytest.raises(SetupError, match="tensor_parallel_size=2 does not divide num_key_value_heads=3"):
        check_tensor_parallel(tiny_model("qwen3"), 2, lora=False)
    with pytest.raises(SetupError, match="LoRA"):
        check_tensor_parallel(tiny_model("qwen2"), 2, lora=True)
    with pytest.raises(SetupError, match="per_kv_head=False: one page selection for all KV heads"):
        check_tensor_parallel(tiny_model("qwen2"), 2, lora=False, sparse=SparseConfig(per_kv_head=False))
    check_tensor_parallel(tiny_model("qwen2"), 2, lora=False)


def test_registered_name_and_refusals():
    strategy = Trainer(accelerator="cpu", devices=2, strategy="oomb_model_parallel", logger=False).strategy
    assert isinstance(strategy, OOMBModelParallelStrategy) and strategy.sharding == "zero2"
    for kwargs, match in (({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive int"),
                          ({"sharding": "zero4"}, "sharding must be one of zero1, zero2, zero3")):
        with pytest.raises(ValueError, match=match):
            OOMBModelParallelStrategy(**kwargs)


def test_placement_reserves_what_a_step_gathers(runs):
    """The strategy hands the engine, through its ranks, the bytes a step allocates beyond the shards at rest:
    the other rank's half of every decoder layer (zero2), of the two largest layers (zero3), and under zero1
    also the whole float32 gradients it sums until the last chunk."""
    def layer_bytes(family):
        layers = tiny_model(family).get_decoder().layers
        return [sum(4 * p.numel() for p in layer.parameters()) for layer in layers]

    qwen2, llama = layer_bytes("qwen2"), layer_bytes("llama")
    assert abs(runs("zero2", "gathered") - sum(qwen2) / WORLD) <= 0.02 * sum(qwen2)
    assert abs(runs("zero3", "gathered") - sum(sorted(layer_bytes("qwen2-tied"))[-2:]) / WORLD) <= 0.02 * sum(qwen2)
    assert abs(runs("zero1", "gathered") - sum(llama) / WORLD - sum(llama)) <= 0.02 * sum(llama)


def test_export_gathers_sharded_weights_whole(runs):
    """The Hugging Face export after a sharded run (FSDP2 zero2; tensor parallel) holds the whole trained weights."""
    from transformers import AutoModelForCausalLM

    for name in ("zero2", "tp"):
        model = AutoModelForCausalLM.from_pretrained(runs(name, "export"), local_files_only=True)
        want = runs(name, "weights")
        for n, p in model.state_dict().items():
            assert torch.equal(p, want[f"model.{n}"]), (name, n)
