"""Messages printed on every run that its user cannot act on, each filtered by its text and by the logger or module
that emits it, so that every other message of those libraries still shows.

- torchao: transformers imports it whenever it is installed (``transformers.modeling_utils`` imports its
  quantizers), whatever the model, before lightning_oomb's own torchao optimizers are chosen or not. At import
  torchao loads its compiled extensions and logs each that this torch cannot load (``_C_mxfp8`` and
  ``_C_cutlass_90a`` are CUDA kernels of torchao's quantization, not of its optimizers: on a CPU torch every run
  printed two "Failed to load ..." lines); then it registers its enums (KernelPreference, ScaleCalculationMode)
  with torch's pytree, which logs torch's deprecation of that call, torchao's to change.
- The CLI only (:func:`quiet_known_noise`): Lightning's advertisements of its cloud services, the deprecation of
  ``LeafSpec`` inside its own pytree calls, and its advice to add DataLoader workers (below); two warnings of other
  libraries' calls of each other: peft reads transformers' deprecated ``is_gradient_checkpointing`` (LoRA), and
  Lightning's LearningRateMonitor copies torchao's tensor learning rate with ``torch.tensor()``; and torch.compile's
  note that torchao's 8-bit optimizer state defines no cache hash (adamw8bit).
"""

from __future__ import annotations

import logging
import re
import warnings


class _DropMessage(logging.Filter):
    """Drops the records of the logger it filters whose message starts as ``pattern`` matches and, with
    ``arg_module``, whose first argument is a class of a module whose name starts with it."""

    def __init__(self, pattern: str, arg_module: str | None = None):
        super().__init__()
        self.pattern = re.compile(pattern)
        self.arg_module = arg_module

    def filter(self, record: logging.LogRecord) -> bool:
        if self.arg_module is not None:
            args = record.args if isinstance(record.args, tuple) else ()
            if not (args and isinstance(args[0], type) and args[0].__module__.startswith(self.arg_module)):
                return True
        return not self.pattern.match(record.getMessage())


_IMPORT_NOISE = {
    # torchao's own compiled extensions only (a path ending in torchao/_C<name>.so).
    "torchao": _DropMessage(r"Failed to load \S*torchao[/\\]_C\w*[\w.-]*\.so: "),
    # Only the enums of torchao's modules.
    "torch.utils._pytree": _DropMessage(r"<enum '\w+'> is an Enum subclass and is now natively supported by "
                                        r"torch\.compile", arg_module="torchao."),
}
_CLI_NOISE = {
    "lightning.pytorch.utilities.rank_zero": _DropMessage(r"💡 Tip: For seamless cloud (logging|uploads)"),
}


def quiet_imports() -> None:
    """Filters the torchao messages above (logged when transformers' modeling is first imported); called when
    lightning_oomb is imported. Adds logging filters only: nothing is imported."""
    for name, drop in _IMPORT_NOISE.items():
        logging.getLogger(name).addFilter(drop)  # once: a filter already there is not added again


def quiet_known_noise() -> None:
    """Filters every message above; called by ``lightning-oomb`` before a command imports Lightning."""
    quiet_imports()
    for name, drop in _CLI_NOISE.items():
        logging.getLogger(name).addFilter(drop)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
    # The data modules here make each sequence in the training process, in microseconds against a step of
    # seconds: Lightning's advice to add DataLoader workers (on machines of more than two cores) does not apply.
    warnings.filterwarnings("ignore", message=r"The '\w+_dataloader' does not have many workers",
                            module=r"lightning\.pytorch\.trainer\.connectors\.data_connector")
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning,
                            module=r"transformers\.modeling_utils")
    warnings.filterwarnings("ignore", message=r"To copy construct from a tensor", category=UserWarning,
                            module=r"lightning\.pytorch\.callbacks\.lr_monitor")
    warnings.filterwarnings("ignore", message=r"OptimState8bit does not implement _stable_hash_for_caching",
                            category=UserWarning)
