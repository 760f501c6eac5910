"""A causal LM from a local Hugging Face directory or a GGUF file in it, never downloaded: the directory checked
(config and weights, or the GGUF file named), its config read with overrides (``config_overrides``: RoPE scaling,
...), the model loaded onto a device. ``model.pretrained`` of the Lightning module and lm-eval's ``lightning_oomb``
backend load through here; errors are ``SetupError`` lines naming the directory."""

from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import is_accelerate_available

from .errors import SetupError

WEIGHT_FILES = ("*.safetensors", "*.bin")


def check_pretrained_dir(path: str, gguf_file: str | None = None) -> Path:
    """The model directory, if it has a config and weights (or the GGUF file named); else a SetupError
    naming what is missing."""
    where = Path(path).expanduser()
    if not where.is_dir():
        raise SetupError(f"model.pretrained: the model directory {path} does not exist")
    if gguf_file is not None:
        if not (where / gguf_file).is_file():
            found = sorted(p.name for p in where.glob("*.gguf"))
            raise SetupError(f"model.gguf_file: {path} has no file {gguf_file}"
                             + (f"; it holds {', '.join(found)}" if found else ""))
        if importlib.util.find_spec("gguf") is None:
            raise SetupError("model.gguf_file: reading GGUF needs the gguf package: "
                             "pip install 'lightning-oomb[gguf]' (or pip install gguf)")
        return where
    if not (where / "config.json").is_file():
        gguf = next(where.glob("*.gguf"), None)
        raise SetupError(
            f"model.pretrained: {path} has no config.json; give a directory written by save_pretrained "
            "(config.json and *.safetensors)" + (f", or set model.gguf_file: {gguf.name}" if gguf else "")
        )
    if not any(next(where.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise SetupError(
            f"model.pretrained: {path} has no weights ({' or '.join(WEIGHT_FILES)}); give a directory written "
            "by save_pretrained"
        )
    return where


def config_overrides_from_json(text: str) -> dict:
    """``config_overrides`` given as text (a command-line flag, lm-eval's model_args): a JSON object of config
    fields, or a SetupError that says so."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SetupError(f"model.config_overrides: must be a JSON object of config fields such as "
                         f"'{{\"max_position_embeddings\": 262144}}', got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise SetupError(f"model.config_overrides: must be a JSON object of config fields, got {text!r}")
    return value


def pretrained_config(path: str, gguf_file: str | None = None, overrides: dict | None = None):
    """The config of a local model directory (checked by ``check_pretrained_dir``; no weights read), with the
    fields in ``overrides`` set as ``from_pretrained`` sets keyword arguments; a field it lacks is refused."""
    where = check_pretrained_dir(path, gguf_file)
    source = f"{path}/{gguf_file}" if gguf_file else str(path)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        config, unused = AutoConfig.from_pretrained(str(where), local_files_only=True, return_unused_kwargs=True,
                                                    **extra, **(overrides or {}))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SetupError(f"model.pretrained: the config in {source} could not be read ({type(e).__name__}: "
                         f"{one_line(e)})") from None
    unknown = sorted(set(unused) - set(extra))
    if unknown:
        raise SetupError(f"model.config_overrides: the {config.model_type} config has no field "
                         f"{', '.join(map(repr, unknown))}; `AutoConfig.from_pretrained({str(path)!r})` lists them")
    return config


def load_pretrained(path: str, dtype, device: torch.device | str | None = None, gguf_file: str | None = None,
                    config=None, quantization_config=None) -> torch.nn.Module:
    """A causal LM from a local Hugging Face directory or a GGUF file in it (never downloads), loaded straight
    onto ``device`` (default CPU), with errors that name the directory, in one line. ``config``: the
    directory's config as ``pretrained_config`` returns it (None: read it). ``quantization_config``:
    transformers' ``BitsAndBytesConfig`` for 4-bit weights (QLoRA)."""
    where = check_pretrained_dir(path, gguf_file)
    device = torch.device(device if device is not None else "cpu")
    via_cpu = device.type != "cpu" and not is_accelerate_available()  # transformers' device_map needs accelerate
    device_map = None if device.type == "cpu" or via_cpu else {"": device}
    extra = {"gguf_file": gguf_file, **_gguf_dequantized()} if gguf_file else {}
    if quantization_config is not None:
        # bitsandbytes quantises as it places the weights: on ``device`` (without a map it would pick a GPU)
        device_map, via_cpu = {"": device}, False
        extra["quantization_config"] = quantization_config
    if config is not None:
        extra["config"] = config
    try:
        # Under a device context (Lightning's, in configure_model) transformers would infer a device_map itself.
        with torch.device("cpu"):
            model = AutoModelForCausalLM.from_pretrained(
                str(where), local_files_only=True, dtype=dtype, device_map=device_map, **extra
            )
    except torch.OutOfMemoryError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:  # unreadable, corrupt, mismatched
        raise SetupError(f"model.pretrained: the model in {path} could not be loaded ({type(e).__name__}: "
                         f"{one_line(e)})") from None
    if gguf_file:
        _forget_gguf_quantizer(model)
    return model.to(device) if via_cpu else model


def config_dtype(config) -> torch.dtype:
    """The dtype a config names for its weights (what ``from_pretrained(dtype="auto")`` loads them in);
    float32 where it names none."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else torch.float32


def _gguf_dequantized() -> dict:
    """from_pretrained's keyword asking for a GGUF's weights unpacked into plain float tensors, where this
    transformers could keep them packed (its GgufConfig takes ``dequantize``); older ones always unpack."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    if "dequantize" not in inspect.signature(GgufConfig.__init__).parameters:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _forget_gguf_quantizer(model: torch.nn.Module) -> None:
    """A GGUF model loaded with its weights unpacked is a plain dense model, but some transformers versions
    keep its GGUF quantizer attached, which makes ``save_pretrained`` (our export) refuse it. Drop it."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    if any(type(m).__name__.startswith("Gguf") for m in model.modules()):  # packed after all: say so, not drop
        raise SetupError("model.gguf_file: this transformers kept the GGUF's weights packed, which cannot be "
                         "trained; save the model as safetensors (save_pretrained) and load that directory")
    quantizer.remove_quantization_config(model)


def one_line(e: BaseException) -> str:
    """An exception's message on one line (a SetupError is printed as one)."""
    return " ".join(str(e).split())
