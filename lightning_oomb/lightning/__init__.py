"""The Lightning layer: strategy, callback, ready module and data, built on the core engine."""

from .callback import PagedKVCallback
from .data import PasskeyDataModule
from .module import CausalLMModule
from .strategy import OOMBStrategy

__all__ = ["CausalLMModule", "OOMBStrategy", "PagedKVCallback", "PasskeyDataModule"]
