"""What the engine cannot compute exactly is refused before any compute, with a message naming the fix."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

import lightning_oomb
from tiny_models import VOCAB, tiny_model


def refuses(model, ids, match, exc=Exception, **kwargs):
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(exc, match=match):
        lightning_oomb.train_step(model, ids, **kwargs)
    assert all(p.grad is None for p in model.parameters()), "a refused step must not touch gradients"
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_one_selection_per_chunk_over_packed_documents():
    model = tiny_model("llama")
    position_ids = torch.cat([torch.arange(15), torch.arange(25)])[None]
    refuses(model, torch.randint(0, VOCAB, (1, 40)), r"per_query_tile=False.*packed documents", ValueError,
            position_ids=position_ids, chunk_size=8, sparse={"budget_pages": 2, "local_pages": 1, "per_query_tile": False})


def test_attention_dropout_in_training():
    model = tiny_model("llama", attention_dropout=0.1)
    refuses(model, torch.randint(0, VOCAB, (1, 20)), "attention_dropout=0.1", NotImplementedError, chunk_size=4)


def test_unsupported_architecture():
    """GPT-2 routes attention through the AttentionInterface; its default dropout is what stands in the way."""
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    refuses(model, torch.randint(0, VOCAB, (1, 20)), "model_type 'gpt2'.*dropout in training mode",
            NotImplementedError)


def test_length_dependent_rope():
    model = tiny_model("llama")
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    refuses(model, torch.randint(0, VOCAB, (1, 20)), "rope_type 'dynamic'", NotImplementedError)


def test_not_a_causal_lm():
    with pytest.raises(TypeError, match="transformers causal LMs"):
        lightning_oomb.train_step(torch.nn.Linear(3, 3), torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize(
    "ids,labels,kwargs,match",
    [
        (torch.zeros(1, 8), None, {}, "token ids"),
        (torch.zeros(8, dtype=torch.long), None, {}, r"\(batch, seq_len\)"),
        (torch.zeros(1, 0, dtype=torch.long), None, {}, "at least 2 tokens"),
        (torch.zeros(0, 8, dtype=torch.long), None, {}, "at least one sequence"),
        (torch.zeros(1, 1, dtype=torch.long), None, {}, "at least 2 tokens"),
        (torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 7, dtype=torch.long), {}, "labels must have the shape"),
        (torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8), {}, "labels must be integer"),
        (torch.zeros(1, 8, dtype=torch.long), torch.full((1, 8), -100), {}, "every label is -100"),
        (torch.zeros(1, 8, dtype=torch.long), torch.full((1, 8), VOCAB), {}, f"token id {VOCAB}, outside"),
        (torch.zeros(1, 8, dtype=torch.long), torch.full((1, 8), -5), {}, "token id -5, outside"),
        (torch.zeros(1, 8, dtype=torch.long), None, {"chunk_size": 0}, "chunk_size must be an integer >= 1"),
        (torch.zeros(1, 8, dtype=torch.long), None, {"page_size": -1}, "page_size must be an integer >= 1"),
        (torch.zeros(1, 8, dtype=torch.long), None, {"attention": "flash"}, "attention must be"),
        (torch.zeros(1, 8, dtype=torch.long), None, {"loss_weights": torch.ones(1, 7)}, "loss_weights must have the"),
        (torch.zeros(1, 8, dtype=torch.long), None, {"loss_weights": torch.ones(1, 8, dtype=torch.long)},
         "loss_weights must be finite, non-negative floats"),
        (torch.zeros(1, 8, dtype=torch.long), None, {"loss_weights": -torch.ones(1, 8)}, "non-negative"),
        (torch.zeros(1, 8, dtype=torch.long), None, {"loss_weights": torch.full((1, 8), float("nan"))}, "finite"),
        (torch.zeros(1, 8, dtype=torch.long), None, {"loss_weights": torch.zeros(1, 8)},
         "every label's loss weight is 0"),
    ],
)
def test_bad_input(ids, labels, kwargs, match):
    model = tiny_model("qwen2")
    with pytest.raises((ValueError, TypeError), match=match):
        lightning_oomb.train_step(model, ids, labels, **kwargs)
    assert all(p.grad is None for p in model.parameters())


def test_checkpoint_layers_needs_training_mode():
    model = tiny_model("qwen2").eval()
    refuses(model, torch.randint(0, VOCAB, (1, 20)), "training mode", ValueError, checkpoint_layers=True)
    assert model.config._attn_implementation == "sdpa"
