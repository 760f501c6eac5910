"""lm-eval's model ``lightning_oomb`` against its ``hf`` backend on one tiny random model and byte tokenizer saved to
a directory, float32 on CPU, through lm-eval's own ``simple_evaluate``: three offline tasks (a JSONL file each),
multiple choice (loglikelihood), perplexity (loglikelihood_rolling) and exact match (generate_until); every
sample's responses and every metric equal (log-likelihoods within 1e-5, generated text exactly)."""

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import lightning_oomb.evaluation.lm_eval_backend  # noqa: E402,F401  (registers "lightning_oomb")
from lightning_oomb.core.errors import SetupError  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "examples" / "byte_tokenizer"  # one token per byte, <|endoftext|> = 256
TOL = 1e-5
# Chunks of 8 over pages of 3: every context crosses chunk and page borders.
CHUNKS = "chunk_size=8,page_size=3"

CHOICES = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "label": 0},
    {"question": "Two and two make", "choices": [" four", " five"], "label": 0},
    {"question": "", "choices": ["yes", "no"], "label": 1},  # an empty context: the EOT token is its context
]
TEXTS = [{"text": "A long time ago, in a galaxy far away, the chunks were many."}, {"text": "short"}]
QUESTIONS = [{"question": "Q: name a colour\nA:", "answer": " red"}, {"question": "Count: 1 2 3", "answer": " 4"},
             {"question": "The end", "answer": "."}]


def task_yaml(name: str, data: Path, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}metadata:\n  version: 1.0\n")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A model directory (tiny qwen2 over the byte tokenizer's 257 ids, with the tokenizer) and a task folder."""
    root = tmp_path_factory.mktemp("lm_eval")
    model_dir = root / "model"
    model = tiny_model("qwen2", vocab_size=257, bos_token_id=None, eos_token_id=256, pad_token_id=256,
                       max_position_embeddings=512)
    model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, model_dir / name)
    tasks = root / "tasks"
    tasks.mkdir()
    for name, rows in (("choices", CHOICES), ("texts", TEXTS), ("questions", QUESTIONS)):
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "oomb_choice.yaml").write_text(task_yaml("oomb_choice", tasks / "choices.jsonl", (
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n")))
    (tasks / "oomb_rolling.yaml").write_text(task_yaml("oomb_rolling", tasks / "texts.jsonl", (
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")))
    # Stop strings this random model writes in two of the three answers (the third runs to max_gen_toks).
    (tasks / "oomb_generate.yaml").write_text(task_yaml("oomb_generate", tasks / "questions.jsonl", (
        "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \"A\", \"x\"]\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")))
    return model_dir, tasks


def evaluate(model: str, model_args: str, tasks: Path) -> dict:
    return simple_evaluate(model=model, model_args=model_args, tasks=["oomb_choice", "oomb_rolling", "oomb_generate"],
                           task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                           device="cpu", batch_size=1, log_samples=True, bootstrap_iters=0)


def flat(value) -> list:
    """Every number or string in a sample's responses, in order."""
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in flat(v)]
    return [value]


def close(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= TOL * max(1.0, abs(a), abs(b))
    return a == b


def test_scores_equal_the_hf_backend(assets):
    model_dir, tasks = assets
    want = evaluate("hf", f"pretrained={model_dir},dtype=float32", tasks)
    got = evaluate("lightning_oomb", f"pretrained={model_dir},dtype=float32,{CHUNKS}", tasks)
    for task in ("oomb_choice", "oomb_rolling", "oomb_generate"):
        want_samples, got_samples = want["samples"][task], got["samples"][task]
        assert len(got_samples) == len(want_samples) > 0
        for w, g in zip(want_samples, got_samples):
            assert w["doc_id"] == g["doc_id"]
            w_resps, g_resps = flat(w["resps"]), flat(g["resps"])
            assert len(w_resps) == len(g_resps) and all(map(close, w_resps, g_resps)), (task, w_resps, g_resps)
        metrics = {k: v for k, v in want["results"][task].items() if not k.endswith("_stderr,none") and k != "alias"}
        assert metrics
        for name, value in metrics.items():
            assert close(got["results"][task][name], value), (task, name, got["results"][task][name], value)
    generated = [flat(s["resps"])[0] for s in got["samples"]["oomb_generate"]]
    assert all(isinstance(text, str) for text in generated)


def test_bad_model_args_are_one_line(assets, tmp_path):
    from lightning_oomb.evaluation.lm_eval_backend import LightningOOMBLM

    model_dir, _ = assets
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for item in model_dir.iterdir():
        if not item.name.startswith("tokenizer"):
            shutil.copy(item, no_tokenizer / item.name)
    cases = [
        ({}, "needs pretrained=DIR"),
        ({"pretrained": str(tmp_path / "absent")}, "does not exist"),
        ({"pretrained": str(no_tokenizer)}, "has no tokenizer"),
        ({"pretrained": str(model_dir), "chunk": 8}, "unknown model_args chunk"),
        ({"pretrained": str(model_dir), "config_overrides": "{not json"}, "must be a JSON object"),
    ]
    for kwargs, message in cases:
        with pytest.raises(SetupError, match=message) as info:
            LightningOOMBLM(**kwargs)
        assert "\n" not in str(info.value)


def test_without_lm_eval_the_import_says_how_to_install(monkeypatch):
    """lm-eval hidden (its modules None in sys.modules: their import fails): the backend's import is one line
    naming the extra."""
    import importlib

    monkeypatch.delitem(sys.modules, "lightning_oomb.evaluation.lm_eval_backend")
    for name in ("lm_eval", "lm_eval.api.model", "lm_eval.api.registry", "lm_eval.models.utils"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"needs lm-eval: pip install 'lightning-oomb\[eval\]'") as info:
        importlib.import_module("lightning_oomb.evaluation.lm_eval_backend")
    assert "\n" not in str(info.value)


def test_lightning_oomb_lm_eval_finds_the_model_and_says_a_bad_argument_in_one_line(assets, capsys):
    """``lightning-oomb lm-eval`` runs lm-eval's command line with the model registered, no import of the
    user's: the model's own refusal of a missing pretrained comes back as one line and exit status 2. (One call:
    lm-eval's command line indexes all its tasks first, some 10 s here; test_scores_equal_the_hf_backend runs
    the model through lm-eval itself.)"""
    from lightning_oomb.cli import main

    _, tasks = assets
    args = ["run", "--model", "lightning_oomb", "--include_path", str(tasks), "--tasks", "oomb_choice",
            "--device", "cpu"]
    assert main(["lm-eval", *args, "--model_args", "chunk_size=8"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "lightning-oomb lm-eval: error: lightning_oomb needs pretrained=DIR (a local model directory) in --model_args")


def test_a_gguf_file_with_config_overrides_scores_beyond_its_original_context(tmp_path):
    """gguf_file and config_overrides as model.pretrained takes them: a GGUF llama with YaRN over 4x its 128
    positions scores a text of 300 bytes as the same model loaded by transformers scores it in one forward."""
    from types import SimpleNamespace

    import torch
    from test_context_extension import YARN, tiny_llama, write_gguf
    from transformers import AutoModelForCausalLM

    from lightning_oomb.evaluation.lm_eval_backend import LightningOOMBLM

    write_gguf(tiny_llama(), tmp_path)
    overrides = {"rope_parameters": YARN, "max_position_embeddings": 512}
    lm = LightningOOMBLM(pretrained=str(tmp_path), gguf_file="tiny.gguf", tokenizer=str(TOKENIZER), dtype="float32",
                         device="cpu", config_overrides=json.dumps(overrides), chunk_size=64, page_size=16)
    assert lm.model.config.rope_parameters["rope_type"] == "yarn" and lm.max_length == 512
    text = "".join(chr(97 + (7 * i) % 26) for i in range(300))
    got = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))], disable_tqdm=True)[0]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32,
                                                 **overrides).eval()
    ids = torch.tensor([[lm.prefix_token_id, *lm.tok_encode(text)]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    want = logprobs.gather(1, ids[0, 1:, None]).sum().item()
    assert abs(got - want) <= TOL * abs(want), (got, want)
