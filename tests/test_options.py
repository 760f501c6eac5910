"""Every step option has one declaration (``ChunkConfig``/``SparseConfig``): each entry point that takes an
option gives it the declared default."""

import inspect

import pytest
import torch

from lightning_oomb import OOMBDDPStrategy, OOMBModelParallelStrategy, OOMBStrategy, eval_loss, train_step
from lightning_oomb.lightning.strategy import OOMBStrategyMixin
from lightning_oomb.core.config import ChunkConfig, SparseConfig, option_defaults
from lightning_oomb.core.errors import SetupError
from lightning_oomb.core.plan.search import plan
from lightning_oomb.lightning.sparse import SparseCausalLMModule
from lightning_oomb.bench.run import build_parser as bench_parser
from lightning_oomb.planner_cli import build_parser

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


def test_the_planner_gives_shared_options_the_declared_defaults():
    planner = _defaults(plan)
    for name in ("chunk_size", "page_size", "grad_dtype", "sparse", "host_memory"):
        assert _same(planner[name], CHUNK[name]), name
    args = build_parser().parse_args(["--model", "qwen2.5-7b", "--context", "128K"])
    for flag, name in (("chunk", "chunk_size"), ("page_size", "page_size"), ("grad_dtype", "grad_dtype"),
                       ("offload", "offload")):
        assert _same(getattr(args, flag), CHUNK[name]), flag


def test_the_cli_flags_of_plan_and_bench_give_the_declared_defaults_under_one_spelling():
    plan_args = build_parser().parse_args(["--model", "qwen2.5-7b", "--context", "128K"])
    bench_args = bench_parser().parse_args([])
    for flag in ("chunk", "page_size", "grad_dtype", "lora_rank"):  # one spelling in both
        assert hasattr(plan_args, flag) and hasattr(bench_args, flag), flag
    for flag, name in (("chunk", "chunk_size"), ("page_size", "page_size"), ("grad_dtype", "grad_dtype")):
        assert _same(getattr(bench_args, flag), CHUNK[name]), flag
    assert bench_args.budget_pages == SPARSE["budget_pages"] and bench_args.attention == CHUNK["attention"]
