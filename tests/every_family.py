"""Every causal LM family transformers registers, as a tiny random model: trained exactly by the engine, or
refused in one line, never wrong and never an error from inside the engine (tests/test_every_family.py).

``tiny_config`` shrinks a family's default config by the field names families share (sizes, layer counts,
experts, dropout); a family whose config it cannot shrink to a model that builds and runs a whole-sequence
forward is "not built" and says why. ``python tests/every_family.py`` writes the table of docs/guide.md
("Which models") from the same classification the test makes.
"""

from __future__ import annotations

import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 101
TOKENS, CHUNK, PAGE = 40, 8, 3
TOL = 1e-5  # float32 on the CPU: loss and every gradient, norm-wise relative
LARGEST = 4_000_000  # parameters; more means a config the generic sizes do not reach (vision towers, ...)
GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide.md"
TABLE_START = "<!-- every-family table: python tests/every_family.py writes it -->"
TABLE_END = "<!-- end of the every-family table -->"

# Field names families share, each set where a config has it. Sizes are kept consistent: 4 query heads of 8,
# 2 K/V heads (MLA: one per query head), MLA's query-key width 8 + 8 and value width 8.
SIZES = dict(
    vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    hidden_size=32, n_embd=32, d_model=32, num_hidden_layers=2, n_layer=2, num_layers=2, decoder_layers=2,
    encoder_layers=2, num_attention_heads=4, n_head=4, decoder_attention_heads=4, encoder_attention_heads=4,
    num_key_value_heads=2, head_dim=8, rotary_dim=8, intermediate_size=48, ffn_dim=48, n_inner=48,
    decoder_ffn_dim=48, encoder_ffn_dim=48, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=64, n_positions=64,
)
# Families whose defaults need more than SIZES: LFM2's default config is attention alone (its checkpoints mix in
# short convolutions), LFM2-MoE's names no layer kinds and would build no model (one dense layer, then experts);
# Jamba places attention and experts by period and offset (defaults 8 and 4, 2 and 1), where two layers by the
# defaults would have no attention: a Mamba layer, then attention with experts. Mamba-2's heads times head_dim
# must be its mixer's width, expand x hidden: 4 heads of 16 (SIZES' head_dim is attention's).
OVERRIDES: dict[str, dict] = {
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "mamba2": dict(num_heads=4, head_dim=16, expand=2, n_groups=1, state_size=8),
    # Bamba's and Granite 4's defaults have no attention layer: a Mamba-2 layer (heads as Mamba-2's), then attention
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_expand=2, mamba_d_state=8,
                  mamba_chunk_size=16),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], mamba_n_heads=4, mamba_d_head=16,
                             mamba_expand=2, mamba_d_state=8, mamba_chunk_size=16, position_embedding_type="rope"),
}
_SUB_CONFIGS = ("text_config", "decoder", "decoder_config")


def _set(config, name: str, value) -> None:
    if isinstance(getattr(type(config), name, None), property):
        return  # derived from other fields
    if name == "num_key_value_heads" and getattr(config, "multi_query", False):
        return  # one K/V head, which Falcon's and GPT-BigCode's layers take from multi_query alone
    try:
        if hasattr(config, name):
            setattr(config, name, value)
    except Exception:  # a derived property or a per-layer field: left as the family defines it
        pass


def tiny_config(model_type: str):
    """The family's default config at the sizes of SIZES, dropout off, one layer of each kind it mixes."""
    config = AutoConfig.for_model(model_type)
    _shrink(config, {**SIZES, **OVERRIDES.get(model_type, {})})
    return config


def _shrink(config, sizes: dict) -> None:
    for name, value in sizes.items():
        if value is not None:
            _set(config, name, value)
    if getattr(config, "kv_lora_rank", None):  # MLA: keys expanded to every query head, no grouping
        _set(config, "num_key_value_heads", sizes["num_attention_heads"])
    for name, value in list(vars(config).items()):
        if ("dropout" in name or "pdrop" in name or name.endswith("jitter_noise")) and isinstance(value, float):
            _set(config, name, 0.0)
    kinds = getattr(config, "layer_types", None)
    if isinstance(kinds, list) and kinds:
        # One layer of each kind, in the order the family first uses them, so a hybrid keeps its attention.
        chosen = list(dict.fromkeys(kinds))[:3]
        if len(chosen) == 1:
            chosen = chosen * 2
        _set(config, "layer_types", chosen)
        _set(config, "num_hidden_layers", len(chosen))
    for sub in _SUB_CONFIGS:
        inner = getattr(config, sub, None)
        if inner is not None and hasattr(inner, "to_dict"):
            _shrink(inner, sizes)


@dataclass
class Outcome:
    model_type: str
    status: str  # "exact", "refused", "not built", "wrong" or "engine error"
    detail: str


def classify(model_type: str) -> Outcome:
    """Build the tiny model, train it on TOKENS tokens whole (transformers) and in chunks (lightning_oomb)."""
    import lightning_oomb
    from lightning_oomb.core.errors import SetupError
    from tiny_models import delta_rule_spread, full_sequence_grads, grads_of, rel_err

    try:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the families' own warnings about their configs
            config = tiny_config(model_type)
            with torch.device("meta"):
                count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
            if count > LARGEST:
                return Outcome(model_type, "not built", f"{count / 1e6:.1f}M parameters at the shared tiny sizes")
            model = AutoModelForCausalLM.from_config(config).train()
            with torch.no_grad():  # attention far from uniform
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            ids = torch.randint(3, VOCAB, (1, TOKENS))
            want_loss, want = full_sequence_grads(model, ids)
            # Linear attention's decay parameters: within twice what transformers' own gradient moves by in
            # another float32 order of its delta rule (tiny_models.delta_rule_spread), where that exceeds TOL.
            spread = delta_rule_spread(model, ids, None, want)
    except Exception as e:  # the family's own code on this config: no model to test
        return Outcome(model_type, "not built", f"{type(e).__name__}: {_first_line(e)}")
    try:
        loss = lightning_oomb.train_step(model, ids, chunk_size=CHUNK, page_size=PAGE)
    except (NotImplementedError, SetupError) as e:
        message = str(e)
        if "\n" in message:
            return Outcome(model_type, "engine error", f"a refusal of several lines: {message!r}")
        return Outcome(model_type, "refused", message)
    except Exception as e:
        return Outcome(model_type, "engine error", f"{type(e).__name__}: {_first_line(e)}")
    # A gradient that is zero but for rounding on both sides (a key's bias without RoPE) is compared by size.
    largest = max(g.norm() for g in want.values())
    got = grads_of(model)
    if got.keys() != want.keys():
        return Outcome(model_type, "wrong", f"gradients of other parameters: {sorted(set(got) ^ set(want))[:3]}")
    errors = {n: (float(got[n].norm() / largest) if want[n].norm() <= 1e-7 * largest else rel_err(got[n], want[n]))
              for n in want}
    errors = {n: e / max(1.0, 2 * spread.get(n, 0.0) / TOL) for n, e in errors.items()}  # within TOL: exact
    worst = max(errors, key=errors.get)
    if rel_err(loss, want_loss) > TOL or errors[worst] > TOL:
        return Outcome(model_type, "wrong", f"loss off by {rel_err(loss, want_loss):.1e}, gradient of {worst} off "
                                            f"by {errors[worst]:.1e}")
    floor = " (A_log, dt_bias: against twice transformers' own float32 spread)" if any(
        2 * v > TOL for v in spread.values()) else ""
    return Outcome(model_type, "exact", f"loss within {rel_err(loss, want_loss):.0e}, gradients within "
                                        f"{errors[worst]:.0e}{floor}")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:160]


def registered() -> list[str]:
    """Every model type transformers maps to a causal-LM class."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def reason(outcome: Outcome) -> str:
    """The table's short why: the refusal without the family's name."""
    text = re.sub(r"^\w+ \(model_type '[^']+'\)(: | )", "", outcome.detail)
    return text.replace("|", "/")


def table(outcomes: list[Outcome]) -> str:
    """The guide's table of ``outcomes``, between its markers."""
    counts = {s: sum(o.status == s for o in outcomes) for s in ("exact", "refused", "not built")}
    lines = [TABLE_START, "",
             f"transformers {transformers.__version__}: {len(outcomes)} model types registered for causal LM; "
             f"{counts['exact']} trained exactly, {counts['refused']} refused, {counts['not built']} not built at "
             "the test's tiny sizes.", "",
             "| model type | status | why |", "| --- | --- | --- |"]
    for o in outcomes:
        lines.append(f"| `{o.model_type}` | {o.status} | {'' if o.status == 'exact' else reason(o)} |")
    return "\n".join(lines + ["", TABLE_END])


def guide_table() -> str | None:
    text = GUIDE.read_text()
    if TABLE_START not in text:
        return None
    return text[text.index(TABLE_START):text.index(TABLE_END) + len(TABLE_END)]


def write_guide(outcomes: list[Outcome]) -> None:
    text, old = GUIDE.read_text(), guide_table()
    GUIDE.write_text(text.replace(old, table(outcomes)))


if __name__ == "__main__":
    found = []
    for model_type in registered():
        found.append(classify(model_type))
        print(f"{model_type}: {found[-1].status} ({found[-1].detail})", file=sys.stderr, flush=True)
    write_guide(found)
