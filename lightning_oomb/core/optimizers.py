"""The optimizers a run chooses by name, the bytes each keeps per trained parameter, and how one is built.

``adamw`` (torch, fused on CUDA), ``adamw-sr`` (torchao, bf16 stochastic rounding), ``adamw8bit`` (torchao),
``adamw-kahan`` and ``adamw8bit-kahan`` (a bf16 compensation buffer per bf16 weight, ``core/kahan.py``) and
``sgd`` (momentum 0.9); or a class path, whose state the planner counts as AdamW's. Why under ``bf16-true``
the choice matters, and what each costs: docs/optimizers.md. The torchao choices need the ``optim`` extra.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .errors import SetupError

# torchao's 8-bit state: one byte per value plus one float32 scale per block of this many values, for tensors
# of at least MIN_QUANTIZED values that the block divides (smaller ones keep the weights' dtype).
BLOCK_SIZE_8BIT = 256
MIN_QUANTIZED_8BIT = 4096
SGD_MOMENTUM = 0.9
# Host memory torchao's first update adds to the process on CUDA, where its step is compiled (Inductor and
# Triton's compiler in the process, the compiled kernels): measured 2.1 GiB beyond the 2 GiB growth allowance
# for Qwen2.5-7B on the H200 (docs/optimizers.md); counted until the optimizer has state.
COMPILE_HOST_BYTES = 5 * (1 << 30) // 2


@dataclass(frozen=True)
class OptimizerChoice:
    """One named optimizer: what it is, what it needs, and the state it keeps per trained parameter."""

    name: str
    summary: str
    moments: int                 # state tensors per parameter (AdamW: exp_avg and exp_avg_sq)
    eight_bit: bool = False      # moments stored in 8 bits (torchao blocks)
    kahan: bool = False          # a compensation buffer per bf16 weight
    package: str | None = None   # the import it needs beyond torch
    compile_host_bytes: int = 0  # host memory its first CUDA update adds (torch.compile)
    # float32 bytes per element of the slice an update takes at a time (torchao_optim.SlicedStep): each 8-bit
    # moment before it is quantized again (torch.compile makes them buffers), the compensated weight
    step_scratch_bytes: int = 0
    defaults: dict[str, Any] = field(default_factory=dict)

    def state_bytes_per_param(self, weight_bytes: int) -> float:
        """Bytes of state per trained parameter for weights of ``weight_bytes`` bytes each (the planner's
        rate: 8-bit moments as if every tensor were quantised, which all but norms and biases are)."""
        moment = 1 + 4 / BLOCK_SIZE_8BIT if self.eight_bit else weight_bytes
        compensation = weight_bytes if self.kahan and weight_bytes == 2 else 0
        return self.moments * moment + compensation

    def state_bytes(self, p: torch.Tensor) -> int:
        """Bytes of state this optimizer's first step creates for parameter ``p`` (exact, per tensor)."""
        n, size = p.numel(), p.element_size()
        if self.eight_bit and n >= MIN_QUANTIZED_8BIT and n % BLOCK_SIZE_8BIT == 0:
            moment = n + 4 * (n // BLOCK_SIZE_8BIT)
        else:
            moment = n * size
        compensation = n * size if self.kahan and p.dtype == torch.bfloat16 else 0
        return self.moments * moment + compensation


OPTIMIZERS: dict[str, OptimizerChoice] = {c.name: c for c in (
    OptimizerChoice("adamw", "moments in the weights' dtype", 2),
    OptimizerChoice("adamw-sr", "moments in the weights' dtype, bf16 weights stochastically rounded", 2, package="torchao", compile_host_bytes=COMPILE_HOST_BYTES),
    OptimizerChoice("adamw8bit", "8-bit moments", 2, eight_bit=True, package="torchao", compile_host_bytes=COMPILE_HOST_BYTES,
                    step_scratch_bytes=8),
    OptimizerChoice("adamw-kahan", "moments in the weights' dtype + bf16 compensation", 2, kahan=True, package="torchao", compile_host_bytes=COMPILE_HOST_BYTES,
                    step_scratch_bytes=4),
    OptimizerChoice("adamw8bit-kahan", "8-bit moments + bf16 compensation", 2,
                    eight_bit=True, kahan=True, package="torchao", compile_host_bytes=COMPILE_HOST_BYTES,
                    step_scratch_bytes=12),
    OptimizerChoice("sgd", f"momentum {SGD_MOMENTUM}", 1, defaults={"momentum": SGD_MOMENTUM}),
)}
# What the planner takes: the named choices, and "none" for a step without an optimizer.
PLAN_OPTIMIZERS = (*OPTIMIZERS, "none")
INSTALL_HINT = "pip install 'lightning_oomb[optim]'"


def plan_state_bytes(name: str, weight_bytes: int) -> float:
    """Bytes of optimizer state per trained parameter that the planner counts for ``name`` (PLAN_OPTIMIZERS)."""
    return 0.0 if name == "none" else OPTIMIZERS[name].state_bytes_per_param(weight_bytes)


@dataclass(frozen=True)
class OptimizerSpec:
    """The user's choice, checked: a name of OPTIMIZERS or a class path, and extra keyword arguments.

    ``lr`` and ``weight_decay`` come from the module's ``learning_rate`` and ``weight_decay`` (one home each),
    so ``init_args`` may not set them.
    """

    class_path: str
    init_args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, optimizer: str, init_args: dict | None = None, where: str = "model.optimizer") -> OptimizerSpec:
        """The checked choice of ``optimizer`` (a name or a class path) with ``init_args``."""
        if not isinstance(optimizer, str):
            raise SetupError(f"{where} must be a name ({', '.join(OPTIMIZERS)}) or a class path; got {optimizer!r}")
        spec = cls(optimizer, dict(init_args or {}))
        spec.check(where)
        return spec

    @property
    def choice(self) -> OptimizerChoice | None:
        return OPTIMIZERS.get(self.class_path)

    def check(self, where: str = "model.optimizer") -> None:
        """Refuse, in one line, an unknown name, a missing package, or an argument the class does not take."""
        for taken in ("lr", "weight_decay"):
            if taken in self.init_args:
                field_name = "learning_rate" if taken == "lr" else taken
                raise SetupError(f"{where}: set {taken} as model.{field_name}, not in model.optimizer_args")
        cls = self.optimizer_class(where)
        parameters = inspect.signature(cls.__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return
        for name in self.init_args:
            if name not in parameters or name in ("self", "params"):
                accepted = [p for p in parameters if p not in ("self", "params", "lr", "weight_decay")]
                raise SetupError(f"{where}: {self.class_path} takes no argument {name!r} "
                                 f"(it takes {', '.join(accepted) or 'none'})")

    def optimizer_class(self, where: str = "model.optimizer") -> type:
        choice = self.choice
        if choice is not None:
            if choice.package and importlib.util.find_spec(choice.package) is None:
                raise SetupError(f"{where}: {choice.name} needs {choice.package}, which is not installed: "
                                 f"{INSTALL_HINT}")
            return _named_class(choice)
        module_name, _, class_name = self.class_path.rpartition(".")
        if not module_name:
            raise SetupError(f"{where}: unknown optimizer {self.class_path!r}; choose one of "
                             f"{', '.join(OPTIMIZERS)} or give a class path such as torch.optim.NAdam")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise SetupError(f"{where}: cannot import {module_name} for {self.class_path} ({e}); install the "
                             f"package that provides it") from None
        cls = getattr(module, class_name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise SetupError(f"{where}: {self.class_path} is not a torch.optim.Optimizer class")
        return cls

    def build(self, params: list[torch.nn.Parameter], lr: float, weight_decay: float,
              fused: bool = True) -> torch.optim.Optimizer:
        """The optimizer over ``params`` (one parameter group). ``fused=False`` keeps torch AdamW unfused on CUDA
        (Lightning's mixed precision refuses to clip the gradients of a fused optimizer)."""
        cls = self.optimizer_class()
        choice = self.choice
        kwargs: dict[str, Any] = {**(choice.defaults if choice else {}), **self.init_args}
        if choice is not None and choice.name == "adamw" and "fused" not in kwargs:
            kwargs["fused"] = (fused and all(p.is_cuda for p in params)) or None
        if choice is not None and choice.name == "adamw-sr":
            kwargs.setdefault("bf16_stochastic_round", True)
        takes_decay = "weight_decay" in inspect.signature(cls.__init__).parameters
        if weight_decay and not takes_decay:
            raise SetupError(f"model.weight_decay: {self.class_path} takes no weight_decay; set it to 0")
        if takes_decay:
            kwargs["weight_decay"] = weight_decay
        # torchao's own step is compiled on every device; the Kahan step only on CUDA (core/kahan.py).
        if choice is not None and choice.package == "torchao" and not choice.kahan and any(
                p.device.type == "cpu" for p in params):
            key_compile_caches_by_cpu_isa()
        return cls(params, lr=lr, **kwargs)


CPU_ISA_TAG = "inductor-cpu-isa="


def key_compile_caches_by_cpu_isa() -> None:
    """Add the vector ISA that Inductor writes CPU code for to torch.compile's cache key tag
    (``torch.compiler.config.cache_key_tag``), for the rest of the process.

    The on-disk caches (FX graph, AOTAutograd) leave that ISA out of their key: a graph whose C++ was written for
    AVX-512 (16 floats a vector) is then served to a process whose Inductor picked AVX2 (ATEN_CPU_CAPABILITY=avx2,
    or another machine sharing TORCHINDUCTOR_CACHE_DIR), which builds that source with AVX2's flags: its loops
    advance by AVX-512's width and compute AVX2's, half of it, leaving the rest of each output unwritten; the
    other way round they write past their buffers. A tag the user set is kept."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    tags = torch.compiler.config.cache_key_tag.split(";")
    kept = [tag for tag in tags if tag and not tag.startswith(CPU_ISA_TAG)]
    torch.compiler.config.cache_key_tag = ";".join([*kept, f"{CPU_ISA_TAG}{pick_vec_isa()}"])


def _named_class(choice: OptimizerChoice) -> type:
    if choice.name == "adamw":
        return torch.optim.AdamW
    if choice.name == "sgd":
        return torch.optim.SGD
    _quiet_torchao_import()
    if choice.kahan:
        from . import kahan

        return kahan.KahanAdamW8bit if choice.eight_bit else kahan.KahanAdamW
    from . import torchao_optim

    return torchao_optim.AdamW8bit if choice.eight_bit else torchao_optim.AdamW


def _quiet_torchao_import() -> None:
    """Import torchao without its notices about optional compiled extensions (unused by its optimizers)."""
    import logging
    import warnings

    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.optim  # noqa: F401
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)


def choice_of(optimizer: torch.optim.Optimizer) -> OptimizerChoice | None:
    """The named choice ``optimizer`` was built as, or None for another class."""
    cls = type(optimizer)
    if cls is torch.optim.AdamW:
        return OPTIMIZERS["adamw"]
    if cls is torch.optim.SGD:
        return OPTIMIZERS["sgd"]
    module = cls.__module__
    if module.endswith("core.kahan"):
        return OPTIMIZERS["adamw8bit-kahan" if "8bit" in cls.__name__ else "adamw-kahan"]
    if module.startswith("torchao.optim") or module.endswith("core.torchao_optim"):
        if cls.__name__ == "AdamW8bit":
            return OPTIMIZERS["adamw8bit"]
        if cls.__name__ in ("_AdamW", "AdamW"):
            return OPTIMIZERS["adamw-sr"]
    return None


def pending_state(optimizers: list[torch.optim.Optimizer]) -> tuple[str, int, int]:
    """(the planner's name for the optimizers, bytes of GPU state their first update will create, host bytes it
    will add): torch's and torchao's optimizers create their state at their first ``step``, after the first
    step's pages are placed, and torchao's compile their step then (``compile_host_bytes``, on CUDA). Another
    class is counted as AdamW (two copies, three with amsgrad, in each parameter's dtype)."""
    name, pending, host = "none", 0, 0
    for optimizer in optimizers:
        choice = choice_of(optimizer)
        for group in optimizer.param_groups:
            if choice is None:
                momentum = group.get("momentum", 0) if isinstance(optimizer, torch.optim.SGD) else None
                copies = (1 if momentum else 0) if momentum is not None else (3 if group.get("amsgrad") else 2)
                group_name = {0: "none", 1: "sgd"}.get(copies, "adamw")
                rule: Callable[[torch.Tensor], int] = lambda p, c=copies: c * p.numel() * p.element_size()
            else:
                if choice.name == "sgd" and not group.get("momentum", 0):
                    group_name, rule = "none", lambda p: 0
                else:
                    group_name, rule = choice.name, choice.state_bytes
            if group_name != "none" and (name == "none" or name == "sgd"):
                name = group_name
            for p in group["params"]:
                if p.requires_grad and not optimizer.state.get(p):
                    pending += rule(p)
                    if choice is not None and p.is_cuda:
                        host = max(host, choice.compile_host_bytes)
    return name, pending, host
