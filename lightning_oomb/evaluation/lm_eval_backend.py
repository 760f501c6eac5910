"""lm-evaluation-harness's model ``lightning_oomb``: its three request types on the engine's chunked forward,
every request with its whole context (lm-eval's ``hf`` backend cuts contexts to ``max_length`` tokens and scores
long texts in windows; here each token sees every token before it, however long the text).

Importing this module registers the model with lm-eval's own registry (lm-eval 0.4.13 discovers no models of
other packages: ``lightning-oomb lm-eval ...`` imports it, then runs lm-eval's command line). It needs the
``[eval]`` extra. Requests are handled as the ``hf`` backend handles them, so that on contexts it does not cut both
give the same scores: the same tokenization (``add_bos_token``, the BOS/EOS prefix of an empty context), the
same stop strings and ``max_gen_toks`` of greedy ``generate_until``, chat templates only when lm-eval asks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..core.config import ChunkConfig
from ..core.errors import SetupError
from ..core.pretrained import config_overrides_from_json, load_pretrained, one_line, pretrained_config
from .generate import generate
from .scoring import loglikelihood, loglikelihood_rolling

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (
        _add_special_kwargs,
        handle_stop_sequences,
        has_bos_prefix,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
except ImportError as e:  # the one line a user without the extra reads
    raise ImportError(f"the lightning_oomb model of lm-eval needs lm-eval: pip install 'lightning-oomb[eval]' "
                      f"({e})") from None

# What the hf backend generates when a request names no max_gen_toks.
DEFAULT_MAX_GEN_TOKS = 256
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The files a saved tokenizer has one of (fast tokenizers, their config, SentencePiece and BPE vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


@register_model("lightning_oomb")
class LightningOOMBLM(TemplateLM):
    """A local Hugging Face causal LM (or a GGUF file of one) scored and decoded through lightning_oomb's
    chunked forward, one request at a time: memory is the K/V pages of one request plus one chunk's
    activations, so contexts far beyond what a whole-sequence forward holds are evaluated exactly.

    Args (lm-eval's ``--model_args``, as ``key=value,...`` or JSON):
        pretrained: a local model directory (config and weights, or the GGUF file named); nothing is downloaded.
        gguf_file: a GGUF file in ``pretrained`` to load instead of its safetensors (the ``[gguf]`` extra).
        config_overrides: config fields set before the model is built (a dict, or its JSON text), e.g.
            ``{"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": ..., ...},
            "max_position_embeddings": 131072}``.
        tokenizer: a directory with the tokenizer; None: ``pretrained`` (and its GGUF file).
        dtype: the weights' dtype: auto (the config's, as the hf backend), float32, bfloat16, float16.
        device: where the model runs; None: cuda if there is one, else cpu.
        add_bos_token, prefix_token_id: as the hf backend takes them (None: the tokenizer's own choice; the BOS
            token, else EOS, before an empty context and a rolling text).
        max_gen_toks: the most new tokens of a ``generate_until`` request that names none.
        batch_size, max_batch_size: accepted for lm-eval's command line; requests run one at a time.
        the rest: ``ChunkConfig``'s fields (chunk_size, page_size, offload, sparse, ...), the chunked forward's.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        gguf_file: str | None = None,
        config_overrides: dict | str | None = None,
        tokenizer: str | None = None,
        dtype: str = "auto",
        device: str | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        batch_size: int | str | None = 1,
        max_batch_size: int | None = None,
        **chunk_options: Any,
    ) -> None:
        super().__init__()
        if pretrained is None:
            raise SetupError("lightning_oomb needs pretrained=DIR (a local model directory) in --model_args")
        if isinstance(config_overrides, str):
            config_overrides = config_overrides_from_json(config_overrides)
        if str(dtype) not in DTYPES:
            raise SetupError(f"lightning_oomb: dtype={dtype} is none of {', '.join(DTYPES)}")
        unknown = set(chunk_options) - set(ChunkConfig.__dataclass_fields__)
        if unknown:
            raise SetupError(f"lightning_oomb: unknown model_args {', '.join(sorted(unknown))}; it takes pretrained, "
                             "gguf_file, config_overrides, tokenizer, dtype, device, add_bos_token, prefix_token_id, "
                             f"max_gen_toks and ChunkConfig's fields: {', '.join(ChunkConfig.__dataclass_fields__)}")
        self.chunk_config = ChunkConfig.build(**chunk_options)
        config = pretrained_config(pretrained, gguf_file, config_overrides)  # the directory checked first
        self.tokenizer = _load_tokenizer(tokenizer, pretrained, gguf_file)  # before the weights: fails fast
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.model = load_pretrained(pretrained, torch_dtype, self._device, gguf_file, config).eval()
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self._max_gen_toks = int(max_gen_toks)
        self.pretrained = str(pretrained)

    @property
    def eot_token_id(self) -> int:
        """The tokenizer's end-of-text token (the hf backend's EOT: the stop string every generation adds)."""
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token before an empty context and a rolling text: prefix_token_id, else BOS, else EOS (hf's)."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int | None:
        """The model's positions (max_position_embeddings): the longest request, context included."""
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def max_gen_toks(self) -> int:
        """The most new tokens of a generate_until request that names none."""
        return self._max_gen_toks

    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return self._device

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's name as lm-eval's request cache keys it (the hf backend's spelling)."""
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string`` as the hf backend encodes a context: special tokens as ``add_bos_token`` says,
        none where the string already starts with the prefix token's text."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(log-likelihood, is greedy) of each encoded (context, continuation), with the whole context."""
        results = []
        for key, context, continuation in tqdm(requests, disable=disable_tqdm or self.rank != 0,
                                               desc="lightning_oomb loglikelihood"):
            result = loglikelihood(self.model, [(context, continuation)], config=self.chunk_config)[0]
            results.append(result)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, every token after the prefix token scored with every token
        before it (the value the hf backend's windows of max_length tokens equal on texts that fit one)."""
        results = []
        for (string,) in tqdm([req.args for req in requests], disable=disable_tqdm or self.rank != 0,
                              desc="lightning_oomb loglikelihood_rolling"):
            tokens = self.tok_encode(string)
            if not tokens:  # hf's windows of no tokens sum to 0
                total = 0.0
            else:
                total = loglikelihood_rolling(self.model, [tokens], prefix_token_id=self.prefix_token_id,
                                              config=self.chunk_config)[0]
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return results

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations of each context, until a stop string (``until`` and the EOT token's text) or
        ``max_gen_toks`` new tokens, cut before the first stop string as the hf backend cuts them. Sampling
        (do_sample, temperature > 0) is refused: the engine decodes greedily."""
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        results = []
        for context, gen_kwargs in tqdm([req.args for req in requests], disable=disable_tqdm or self.rank != 0,
                                        desc="lightning_oomb generate_until"):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
                raise SetupError(f"lightning_oomb decodes greedily; this task asks for sampling ({gen_kwargs}): "
                                 "set --gen_kwargs do_sample=False,temperature=0")
            ids = self._encode_prompt(context)
            out = generate(self.model, torch.tensor([ids], device=self._device), max_new_tokens=max_gen_toks,
                           stop=self._stop_strings_seen(until), config=self.chunk_config)
            text = self.tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
            text = postprocess_generated_text(generation=text, stop=until, think_end_token=None)
            results.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return results

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template over ``chat_history`` (only with lm-eval's --apply_chat_template)."""
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def _encode_prompt(self, context: str) -> list[int]:
        """A generation prompt's token ids as the hf backend's batch encoding makes them (its BOS test is on the
        tokenizer's bos_token, not the prefix token); an empty one is the prefix token."""
        special: dict[str, bool] = {}
        if has_bos_prefix(context, getattr(self.tokenizer, "bos_token", None)):
            special = {"add_special_tokens": False}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        ids = self.tokenizer(context, **special)["input_ids"]
        return ids or [self.prefix_token_id]

    def _stop_strings_seen(self, until: list[str]):
        """generate's ``stop``: True once the new tokens' text (special tokens included, as hf's stopping
        criterion decodes it) holds a stop string; the text is cut before it afterwards."""
        def seen(new_tokens: torch.Tensor) -> bool:
            text = self.tokenizer.decode(new_tokens[0].tolist(), skip_special_tokens=False)
            return any(stop and stop in text for stop in until)
        return seen


def _load_tokenizer(tokenizer: str | None, pretrained: str, gguf_file: str | None):
    """The tokenizer of ``tokenizer`` (a local directory) or of the model directory (and its GGUF file)."""
    from transformers import AutoTokenizer

    source = tokenizer or pretrained
    extra = {"gguf_file": gguf_file} if gguf_file and tokenizer is None else {}
    # transformers builds an empty tokenizer of the config's family from a folder without tokenizer files, which
    # would score every text as nothing: look for them first.
    if not extra and not any((Path(source).expanduser() / name).is_file() for name in TOKENIZER_FILES):
        raise SetupError(f"lightning_oomb: {source} has no tokenizer ({', '.join(TOKENIZER_FILES)}); save one there "
                         "(tokenizer.save_pretrained) or give tokenizer=DIR")
    try:
        return AutoTokenizer.from_pretrained(str(source), local_files_only=True, **extra)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SetupError(f"lightning_oomb: no tokenizer could be loaded from {source} ({type(e).__name__}: "
                         f"{one_line(e)}); save one there (tokenizer.save_pretrained) or give tokenizer=DIR") from None
