"""Every step option has one declaration (``ChunkConfig``/``SparseConfig``): each entry point that takes an
option gives it the declared default."""

import dataclasses
import importlib
import inspect

import pytest
import torch

from lightning_oomb import OOMBDDPStrategy, OOMBModelParallelStrategy, OOMBStrategy, eval_loss, train_step
from lightning_oomb.lightning.strategy import OOMBStrategyMixin
from lightning_oomb.core.config import ChunkConfig, SparseConfig, option_defaults
from lightning_oomb.core.errors import SetupError
from lightning_oomb.core.plan import PlanConfig, max_context, plan, plan_placed, step_time
from lightning_oomb.lightning.sparse import SparseCausalLMModule
from lightning_oomb.bench.config import BenchConfig
from lightning_oomb.bench.run import build_parser as bench_parser
from lightning_oomb.planner_cli import build_parser, plan_config

CHUNK = option_defaults(ChunkConfig)
SPARSE = option_defaults(SparseConfig)


def _same(a, b) -> bool:
    """Defaults compare as the config reads them (grad_dtype "float32" is torch.float32)."""
    dtype = lambda v: getattr(torch, v) if isinstance(v, str) and hasattr(torch, v) else v  # noqa: E731
    return dtype(a) == dtype(b)


def _defaults(fn) -> dict:
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


def test_the_strategies_take_every_step_option_with_its_declared_default_and_help():
    strategy = _defaults(OOMBStrategyMixin.__init__)
    assert {name: strategy[name] for name in CHUNK} == CHUNK
    for cls in (OOMBStrategy, OOMBDDPStrategy, OOMBModelParallelStrategy):  # the mixin's, not restated
        assert not set(inspect.signature(cls.__init__).parameters) & set(CHUNK), cls.__name__
    # The Lightning CLI reads each option's help from the mixin's docstring: ChunkConfig's text.
    first_option = inspect.getdoc(ChunkConfig).split("Args:\n")[1].splitlines()[0].strip()
    assert first_option.startswith("chunk_size:") and first_option in OOMBStrategyMixin.__doc__


def test_train_step_and_eval_loss_build_the_declared_config():
    for fn in (train_step, eval_loss):
        params = inspect.signature(fn).parameters
        assert not set(params) & set(CHUNK), f"{fn.__name__} restates step options"
    assert ChunkConfig.build() == ChunkConfig()
    with pytest.raises(SetupError, match="unknown step option.*chunksize.*the options are ChunkConfig's fields"):
        ChunkConfig.build(chunksize=128)


def test_the_sparse_module_takes_sparse_config_defaults_and_restates_nothing_else():
    module = _defaults(SparseCausalLMModule.__init__)
    renamed = {"sparse_score": "score"}
    assert {renamed.get(name, name): value for name, value in module.items()} == SPARSE
    assert "learning_rate" not in inspect.signature(SparseCausalLMModule.__init__).parameters


def test_the_planner_reads_every_step_option_from_chunk_config():
    """plan(), plan_placed(), max_context() and step_time() restate no step option: they take a PlanConfig,
    whose ``chunk`` is a ChunkConfig (defaults and checks there), or its fields by name through
    PlanConfig.build, which routes the step options to ChunkConfig.build: one exception type and message."""
    for fn in (plan, plan_placed, max_context, step_time):
        assert not set(inspect.signature(fn).parameters) & set(CHUNK), f"{fn.__name__} restates step options"
    assert not {f.name for f in dataclasses.fields(PlanConfig)} & set(CHUNK), "PlanConfig restates step options"
    assert PlanConfig(1).chunk == PlanConfig.build(1).chunk == ChunkConfig()
    built = PlanConfig.build(1 << 20, chunk_size=2048, grad_dtype="bfloat16", lora_rank=16)
    assert built.chunk == ChunkConfig(chunk_size=2048, grad_dtype="bfloat16") and built.lora_rank == 16
    for bad, message in ((dict(chunk_size=0), "chunk_size must be an integer >= 1, got 0"),
                         (dict(grad_dtype="float16"), "grad_dtype must be float32 or bfloat16"),
                         (dict(offload=True), "offload must be one of 'auto', 'gpu', 'host', got True")):
        with pytest.raises(SetupError, match=message):
            plan("qwen2.5-7b", 4096, gpu_memory=2**40, **bad)
        with pytest.raises(SetupError, match=message):
            ChunkConfig(**bad)
    with pytest.raises(SetupError, match="unknown plan option.*chunksize.*ChunkConfig's fields"):
        PlanConfig.build(1, chunksize=128)
    with pytest.raises(SetupError, match="batch must be an integer >= 1"):  # the run's options: PlanConfig's
        PlanConfig.build(1, batch=0)


def test_the_plan_cli_builds_the_declared_config_from_its_defaults():
    """`lightning-oomb plan` with no step flag plans ChunkConfig() (--checkpoint-layers auto is the planner's
    choice, off where the step fits, not a ChunkConfig value); --budget-pages gives SparseConfig's others."""
    args = build_parser().parse_args(["--model", "qwen2.5-7b", "--context", "128K"])
    assert plan_config(args).chunk == ChunkConfig()
    sparse = plan_config(build_parser().parse_args(["--model", "qwen2.5-7b", "--max-context", "--budget-pages", "8"]))
    assert sparse.chunk == ChunkConfig(sparse=SparseConfig(budget_pages=8))
    for flag, name in (("chunk", "chunk_size"), ("page_size", "page_size"), ("grad_dtype", "grad_dtype"),
                       ("offload", "offload"), ("segment_tokens", "segment_tokens"), ("host_memory", "host_memory")):
        assert _same(getattr(args, flag), CHUNK[name]), flag


def test_the_page_selection_left_open_is_per_chunk_with_host_pages_and_per_tile_otherwise():
    """SparseConfig.per_query_tile None: ChunkConfig decides it from offload (per chunk with "host", whose
    per-tile gathers grow with the past); what is given stays; --selection auto gives None."""
    sparse = SparseConfig(budget_pages=8)
    assert sparse.per_query_tile is None
    decided = {o: ChunkConfig(sparse=sparse, offload=o).sparse.per_query_tile for o in ("gpu", "auto", "host")}
    assert decided == {"gpu": True, "auto": True, "host": False}
    assert ChunkConfig(sparse={"budget_pages": 8, "per_query_tile": True}, offload="host").sparse.per_query_tile
    assert PlanConfig.build(1 << 20, sparse=sparse, offload="host").sparse.per_query_tile is False
    with pytest.raises(SetupError, match="per_query_tile must be True, False or None"):
        SparseConfig(per_query_tile="tile")
    args = build_parser().parse_args(["--model", "qwen2.5-7b", "--context", "1M", "--budget-pages", "8",
                                      "--offload", "host"])
    assert args.selection == "auto" and plan_config(args).sparse.per_query_tile is False


def test_the_cli_flags_of_plan_and_bench_give_the_declared_defaults_under_one_spelling():
    plan_args = build_parser().parse_args(["--model", "qwen2.5-7b", "--context", "128K"])
    bench_args = bench_parser().parse_args([])
    for flag in ("chunk", "page_size", "grad_dtype", "lora_rank", "budget_pages", "selection"):  # one spelling in both
        assert hasattr(plan_args, flag) and hasattr(bench_args, flag), flag
    for flag, name in (("chunk", "chunk_size"), ("page_size", "page_size"), ("grad_dtype", "grad_dtype")):
        assert _same(getattr(bench_args, flag), CHUNK[name]), flag
    assert bench_args.budget_pages == SPARSE["budget_pages"] and bench_args.attention == CHUNK["attention"]
    assert BenchConfig().chunk_size == CHUNK["chunk_size"] and BenchConfig().budget_pages == SPARSE["budget_pages"]


@pytest.mark.parametrize("tool", ["grad_store_precision", "kernels", "lightning_step", "memory_trace",
                                  "profile_step", "sparse_fidelity", "sparse_kernels"])
def test_every_bench_tool_spells_the_step_options_as_plan_does(tool):
    """The bench tools take --chunk in tokens (4K too) with ChunkConfig's default, the sparse budget as
    --budget-pages, the KV-gradient dtype and the offload with ChunkConfig's defaults."""
    parser = importlib.import_module(f"lightning_oomb.bench.{tool}").build_parser()
    flags = {o for a in parser._actions for o in a.option_strings}
    assert not flags & {"--budget", "--budgets", "--train-budget", "--chunk-size"}, tool
    args = parser.parse_args(["--chunk", "2K"] if "--chunk" in flags else [])
    if "--chunk" in flags:
        assert args.chunk == 2048 and parser.parse_args([]).chunk == CHUNK["chunk_size"]
    if "--grad-dtype" in flags:
        assert args.grad_dtype == CHUNK["grad_dtype"]
    if "--page-size" in flags and tool != "sparse_fidelity":  # the CPU demo's short sequences want small pages
        assert args.page_size == CHUNK["page_size"]
    assert "--budget-pages" in flags or tool not in ("profile_step", "sparse_fidelity", "sparse_kernels"), tool
