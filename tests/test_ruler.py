"""RULER's synthetic tasks (lightning_oomb/evaluation/ruler.py) and ``lightning-oomb evaluate`` on the CPU: the
generators fit a length in the tokenizer's tokens and hide their answers, the scoring is RULER's, and the
command runs end to end on a tiny random model or refuses bad input in one line with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lightning_oomb.cli import main
from lightning_oomb.evaluation.ruler import TASKS, make_sample, score, string_match_all, string_match_part
from tiny_models import save_byte_level_llama

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = str(ROOT / "examples" / "byte_tokenizer")  # one token per byte
CHAT_TOKENIZER = str(ROOT / "examples" / "chat_tokenizer")  # the same bytes, ChatML's markers and template


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.mark.parametrize("task", list(TASKS))
def test_sample_fits_the_length_and_hides_its_answers(task, tokenizer):
    length = 2048
    a, b = make_sample(task, length, tokenizer, index=0), make_sample(task, length, tokenizer, index=0)
    assert a == b  # deterministic in (task, length, index, seed)
    assert make_sample(task, length, tokenizer, index=1).prompt != a.prompt
    assert make_sample(task, length, tokenizer, index=0, seed=1).prompt != a.prompt
    assert a.tokens == len(tokenizer.encode(a.prompt, add_special_tokens=True))
    total = a.tokens + a.max_new_tokens
    assert 0.9 * length <= total <= length, (task, total)
    assert a.references and all(r in a.prompt for r in a.references)


@pytest.mark.parametrize("task", list(TASKS))
def test_chat_form_is_the_base_prompt_as_the_users_turn(task, tokenizer):
    """chat=True: the base-form prompt's task text as the user's turn of the tokenizer's template, the answer
    prefix (without its leading space) opening the assistant's turn; counted without added special tokens, as
    the template writes its own."""
    chat_tokenizer = AutoTokenizer.from_pretrained(CHAT_TOKENIZER)
    length = 2048
    chat = make_sample(task, length, chat_tokenizer, index=0, chat=True)
    assert not chat.add_special_tokens
    assert chat.tokens == len(chat_tokenizer.encode(chat.prompt, add_special_tokens=False))
    assert 0.9 * length <= chat.tokens + chat.max_new_tokens <= length
    head, turn = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
    assert chat.prompt.startswith(head) and chat.prompt.count(turn) == 1
    body, prefix = chat.prompt[len(head):].split(turn)
    assert prefix and not prefix.startswith(" ") and body.endswith(("?", "."))
    base = make_sample(task, length, tokenizer, index=0)  # same seed: the same keys, values and answers
    assert base.add_special_tokens and base.references == chat.references
    # the same instruction, question and prefix; the filler is shorter by the template's tokens
    assert base.prompt.endswith(body.rsplit("\n", 1)[1] + " " + prefix) and base.prompt[:60] == body[:60]
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        make_sample(task, length, tokenizer, chat=True)


def test_answers_are_what_the_recipes_say(tokenizer):
    vt = make_sample("vt", 2048, tokenizer)
    assert len(vt.references) == 5 and all(f"VAR {v} =" in vt.prompt for v in vt.references)
    cwe = make_sample("cwe", 2048, tokenizer)  # under 4K: the 10 common words twice, the others once
    words = cwe.prompt.split("\n")[1].split()[1::2]
    assert len(cwe.references) == 10 and all(words.count(w) == 2 for w in cwe.references)
    assert max(words.count(w) for w in set(words) - set(cwe.references)) == 1
    fwe = make_sample("fwe", 2048, tokenizer)
    coded = fwe.prompt.split("coded words. ", 1)[1].split("\n")[0].split()
    counts = sorted(((coded.count(w), w) for w in set(coded) - {"...."}), reverse=True)
    assert [w for _, w in counts[:3]] == fwe.references and counts[2][0] > counts[3][0]
    multi = make_sample("niah_multivalue", 2048, tokenizer)
    assert len(multi.references) == 4


def test_too_short_a_length_is_refused(tokenizer):
    with pytest.raises(ValueError, match="ask for a longer length"):
        make_sample("niah_single_1", 200, tokenizer)
    with pytest.raises(ValueError, match="unknown RULER task"):
        make_sample("qa_1", 4096, tokenizer)


def test_scoring_is_ruler_s():
    refs = [["1234567", "7654321", "ABC"], ["x"]]
    # string_match_all: the fraction of a sample's references in its prediction, case-insensitive, in percent
    assert string_match_all(["1234567 and abc", "no"], refs) == pytest.approx(100 * (2 / 3 + 0) / 2)
    # string_match_part: any reference
    assert string_match_part(["1234567 and abc", "no"], refs) == pytest.approx(50.0)
    assert score("niah_multivalue", ["\x00 1234567, 7654321 and ABC "], [refs[0]]) == 100.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_byte_level_llama(tmp_path_factory.mktemp("ruler") / "model", TOKENIZER)


def test_evaluate_end_to_end(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["evaluate", "--model", str(model_dir), "--tasks", "vt,fwe", "--lengths", "640,768",
                 "--samples", "1", "--chunk", "256", "--page-size", "64", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "Eval plan" in printed.out and "no gradients" in printed.out
    assert printed.err.count("[") >= 4 and "[4/4] fwe at 768" in printed.err  # a progress line per task x length
    table = printed.out.split("task", 1)[1].splitlines()
    assert table[0].split() == ["640", "768"] and [r.split()[0] for r in table[1:4]] == ["vt", "fwe", "mean"]
    results = json.loads((out / "results.json").read_text())
    assert results["lengths"] == [640, 768] and set(results["scores"]) == {"vt", "fwe"}
    # K and V of 2 layers, 1 KV head of 16 dims, float32: 256 bytes a token
    assert results["plan"]["pages"]["640"] == {"bytes": 640 * 256, "on": "cpu"}
    assert all(0 <= v <= 100 for row in results["scores"].values() for v in row.values())
    detail = results["details"]["vt"]["640"][0]
    assert detail["tokens"] + 30 <= 640 and len(detail["references"]) == 5 and isinstance(detail["prediction"], str)
    assert 1 <= detail["new_tokens"] <= 30 and detail["seconds"] > 0  # vt answers in at most 30 tokens
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _refused(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["evaluate", *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_evaluate_in_the_chat_template(tmp_path, capsys):
    """--apply-chat-template: every prompt in the tokenizer's chat template, recorded in results.json; a
    tokenizer without one is refused in one line before the model loads."""
    chat_dir = save_byte_level_llama(tmp_path / "chat_model", CHAT_TOKENIZER)
    out = tmp_path / "out"
    assert main(["evaluate", "--model", str(chat_dir), "--tasks", "vt", "--lengths", "640", "--samples", "1",
                 "--chunk", "256", "--page-size", "64", "--out", str(out), "--apply-chat-template"]) == 0
    results = json.loads((out / "results.json").read_text())
    detail = results["details"]["vt"]["640"][0]
    assert results["apply_chat_template"] is True and detail["tokens"] + 30 <= 640
    capsys.readouterr()


def test_unknown_task_is_one_line(model_dir, capsys):
    assert "unknown task 'niah_single_9' (did you mean" in _refused(
        capsys, ["--model", str(model_dir), "--tasks", "vt,niah_single_9", "--lengths", "1K"])


def test_a_length_that_does_not_fit_is_one_line(model_dir, capsys):
    err = _refused(capsys, ["--model", str(model_dir), "--tasks", "vt", "--lengths", "1K,8K"])
    assert "--lengths 8K does not fit: beyond the model's max_position_embeddings 4,096" in err
    err = _refused(capsys, ["--model", str(model_dir), "--tasks", "vt", "--lengths", "2K", "--host-memory", "1MiB"])
    assert "--lengths 2K does not fit: its K/V pages take" in err
    err = _refused(capsys, ["--model", str(model_dir), "--tasks", "vt,niah_single_1", "--lengths", "400,1K"])
    assert "--lengths: vt at 400 tokens: its prompt alone takes" in err


def test_config_overrides_set_the_length_the_model_reaches(model_dir, tmp_path, capsys):
    """RoPE scaling for lengths past the model's own, as in training's model.config_overrides: the plan takes the
    new max_position_embeddings, the model is built with it, and results.json says what was set."""
    overrides = '{"max_position_embeddings": 8192, "rope_parameters": {"rope_type": "linear", "factor": 2.0, ' \
                '"rope_theta": 10000.0}}'
    out = tmp_path / "out"
    assert main(["evaluate", "--model", str(model_dir), "--tasks", "vt", "--lengths", "5K", "--samples", "1",
                 "--chunk", "1024", "--page-size", "64", "--out", str(out), "--config-overrides", overrides]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["lengths"] == [5120] and results["config_overrides"] == overrides
    assert results["details"]["vt"]["5K"][0]["tokens"] > 4096
    capsys.readouterr()
    # The YAML's (model.config_overrides) and lm-eval's underscore spelling is the same flag.
    err = _refused(capsys, ["--model", str(model_dir), "--tasks", "vt", "--lengths", "1K",
                            "--config_overrides", '{"max_position_embedings": 8192}'])
    assert "--config-overrides: the llama config has no field 'max_position_embedings'" in err
    err = _refused(capsys, ["--model", str(model_dir), "--tasks", "vt", "--lengths", "1K", "--config-overrides", "[1]"])
    assert "--config-overrides: must be a JSON object of config fields, got" in err
    assert "--config-overrides: must be a JSON object of config fields such as" in _refused(
        capsys, ["--model", str(model_dir), "--tasks", "vt", "--lengths", "1K", "--config-overrides", "{x"])


def test_a_sparse_budget_below_its_sink_and_local_pages_is_one_line(model_dir, capsys):
    err = _refused(capsys, ["--model", str(model_dir), "--tasks", "vt", "--lengths", "1K", "--budget-pages", "2"])
    assert "--budget-pages: SparseConfig: sink_pages + local_pages (1 + 4) must not exceed budget_pages (2)" in err


def test_a_chat_template_the_tokenizer_lacks_is_one_line(model_dir, capsys):
    err = _refused(capsys, ["--model", str(model_dir), "--tasks", "vt", "--lengths", "1K", "--apply-chat-template"])
    assert "--apply-chat-template: the tokenizer of" in err and "has no chat template" in err


def test_a_directory_without_tokenizer_is_one_line(model_dir, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((model_dir / name).read_bytes())
    assert "has no tokenizer" in _refused(capsys, ["--model", str(bare), "--tasks", "vt", "--lengths", "1K"])


def test_missing_matplotlib_is_one_line(model_dir, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    assert "needs matplotlib" in _refused(capsys, ["--model", str(model_dir), "--tasks", "vt", "--lengths", "1K"])


def test_the_eval_plan_counts_pages_of_the_attention_layers_only():
    """A hybrid's state-carrying layers hold no K/V pages: Qwen3-Next's 12 attention layers of 48 do, with
    their keys and values as wide as the planner's ModelShape.kv_bytes_per_token counts them."""
    from lightning_oomb.core.model_shape import ModelShape
    from lightning_oomb.evaluate_cli import eval_plan

    import torch

    shape = ModelShape.resolve("qwen3-next-80b-a3b")
    assert shape.kv_layers < shape.n_layers
    _, plans = eval_plan(shape, [131072], torch.bfloat16, 4096, "cpu", "auto", None, 1 << 50, None)
    assert plans[0].pages == 131072 * shape.kv_bytes_per_token(torch.bfloat16)


def test_the_plans_time_per_sample_on_a_gpu():
    """What `lightning-oomb evaluate` prints on a GPU before the model loads: the plan's prefill and time per new
    token at each length, in the weights' dtype, dense and sparse (computed on any machine)."""
    import torch

    from lightning_oomb.core.config import SparseConfig
    from lightning_oomb.core.plan.timing import generation_time
    from lightning_oomb.evaluate_cli import planned_times

    lengths = [4096, 1 << 20]
    dense = planned_times("smollm2-135m", lengths, 4096, 128, None, torch.bfloat16)
    sparse = planned_times("smollm2-135m", lengths, 4096, 128, SparseConfig(budget_pages=64), torch.bfloat16)
    assert list(dense) == lengths and dense[4096] == generation_time("smollm2-135m", 4096, dtype_bytes=2)
    assert sparse[1 << 20].prefill_s < dense[1 << 20].prefill_s


def test_time_against_the_plan_is_each_tasks_seconds_over_its_planned_prompts():
    """The line `lightning-oomb evaluate` prints on a GPU after the table: per length, the range over tasks of
    the seconds measured over the plan's prefill per prompt plus its time per generated token."""
    from lightning_oomb.core.plan.timing import GenerationTime
    from lightning_oomb.evaluate_cli import time_against_plan

    def cell(*prompts):  # (new tokens, seconds) per prompt
        return {"score": 0.0, "samples": [dict(new_tokens=k, seconds=s) for k, s in prompts]}

    results = {"vt": {4096: cell((10, 1.0), (30, 3.0)), 65536: cell((1, 2.0))},
               "fwe": {4096: cell((50, 2.0)), 65536: cell((2, 8.0))}}
    times = {4096: GenerationTime(0.0, 0.5, 0.0, 0.05), 65536: GenerationTime(0.0, 4.0, 0.0, 0.1)}
    # vt at 4K: 4.0 s against 2 x 0.5 + 40 x 0.05 = 3.0 s; fwe at 4K: 2.0 against 3.0; at 64K 2.0/4.1, 8.0/4.2
    assert time_against_plan(results, times) == ("Time against the plan (per task, for the tokens generated): "
                                                 "4K 0.67-1.33x, 64K 0.49-1.90x")
