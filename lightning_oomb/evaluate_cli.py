"""``lightning-oomb evaluate``: RULER's synthetic tasks (``evaluation/ruler.py``) at a list of context lengths, each
prompt decoded greedily over the engine's K/V pages (``lightning_oomb.generate``).

Order: the flags, the optional packages, the model directory and its tokenizer are checked, then the eval plan
(K/V pages of each length, no gradients) says what fits; any of them refused is one line and exit status 2,
before the model loads. Then one progress line per task and length, the task x length table, on a GPU the time
against the plan, and in --out: results.json (scores, and every sample's prediction, new tokens and seconds) and
heatmap.png.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, TypeVar

from .cli_flags import OneLineParser, add_budget_pages, add_chunk, add_offload, add_page_size
from .core.units import human_tokens, parse_tokens

if TYPE_CHECKING:
    import torch

    from .core.model_shape import ModelShape

T = TypeVar("T")
DTYPES = ("auto", "bfloat16", "float32")
GiB = 2 ** 30


def _size(n: int) -> str:
    """Bytes for people: GiB from 1 GiB on, MiB below."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2 ** 20:.1f} MiB"


def build_parser() -> argparse.ArgumentParser:
    from .evaluation.ruler import TASKS

    parser = OneLineParser(
        prog="lightning-oomb evaluate",
        description="RULER's synthetic tasks (no downloaded data) at each context length, on a local Hugging Face "
        "model directory: a plan first, then a task x length table, results.json and heatmap.png. Token counts: "
        "K = 1024, M = 1024*1024.",
    )
    parser.add_argument("--model", required=True, help="a model directory written by save_pretrained, with its "
                        "tokenizer")
    # The underscore spellings are model.gguf_file's and model.config_overrides' in a YAML, and lm-eval's.
    parser.add_argument("--gguf-file", "--gguf_file", dest="gguf_file", default=None,
                        help="the GGUF file in --model to load instead (needs gguf)")
    parser.add_argument("--config-overrides", "--config_overrides", dest="config_overrides", default=None,
                        help="config fields set before the model is built, "
                        "as a JSON object, as model.config_overrides sets them in training: RoPE scaling for "
                        "lengths past the model's own, e.g. '{\"rope_parameters\": {\"rope_type\": \"yarn\", "
                        "\"factor\": 32.0, ...}, \"max_position_embeddings\": 262144}'")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of: {', '.join(TASKS)} "
                        "(default all)")
    parser.add_argument("--lengths", required=True, help="comma-separated token counts, e.g. 4K,16K,64K,256K,1M: "
                        "each prompt and the tokens its task generates together")
    parser.add_argument("--apply-chat-template", "--apply_chat_template", dest="apply_chat_template",
                        action="store_true", help="prompts as RULER gives them to chat "
                        "models: the task as the user's turn of the tokenizer's chat template, the answer prefix "
                        "opening the assistant's turn (default: base-model prompts)")
    parser.add_argument("--samples", type=int, default=10, help="prompts per task and length (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="the samples' seed (default 0)")
    parser.add_argument("--out", default="ruler_results", help="folder of results.json and heatmap.png "
                        "(default ruler_results)")
    add_chunk(parser)
    add_page_size(parser)
    add_offload(parser, help="where the K/V pages live; auto: the GPU if they fit there, else host memory")
    add_budget_pages(parser, default=0, help="page-level sparse attention with this many past pages per query "
                     "tile; 0: dense")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="the weights' dtype; auto: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if there is one)")
    parser.add_argument("--gpu-memory", default=None, help="the GPU memory the plan may use, e.g. 70GiB "
                        "(default: the device's free memory)")
    parser.add_argument("--host-memory", default=None, help="the run's host memory budget, e.g. 100GiB "
                        "(default: what this machine has available less a headroom)")
    return parser


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.error(message)  # one line, exit 2


def _parse_list(parser: argparse.ArgumentParser, text: str, what: str, parse: Callable[[str], T]) -> list[T]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        _fail(parser, f"--{what} is empty")
    try:
        return [parse(t) for t in items]
    except ValueError as e:
        _fail(parser, f"--{what}: {e}")


@dataclass
class LengthPlan:
    """What one length holds: ``tokens`` positions, K/V pages of ``pages`` bytes (no gradient pages) placed
    ``where`` ("gpu", "host", or None: refused, ``why`` says why)."""

    tokens: int
    pages: int
    where: str | None
    why: str = ""


def eval_plan(shape: ModelShape, tokens: list[int], dtype: torch.dtype, chunk: int, device: str, offload: str,
              gpu_memory: int | None, host_memory: int | None, max_positions: int | None) -> tuple[int, list[LengthPlan]]:
    """Each length's K/V pages (bytes = ``shape.kv_bytes_per_token(dtype)`` x tokens: a hybrid's state-carrying
    layers hold none) against the memory left once the weights (``shape.total_params`` x ``dtype.itemsize``)
    and one chunk's activations (an estimate: the chunk's q, k, v, attention output, MLP and residual rows) are
    placed: free GPU memory, else (offload auto or host) the host memory budget; on the CPU the host budget
    holds all of it. Returns (the fixed bytes of weights and activations, a LengthPlan per length)."""
    from .core.host_memory import host_budget, process_host_bytes

    dtype_bytes = dtype.itemsize
    weights = shape.total_params * dtype_bytes
    row = 2 * shape.q_width + 2 * shape.kv_width + 3 * shape.intermediate + 4 * shape.hidden
    fixed = weights + chunk * row * dtype_bytes
    per_token = shape.kv_bytes_per_token(dtype)
    host_room = host_budget(host_memory) - process_host_bytes()
    gpu_room = None
    if device.startswith("cuda"):
        import torch

        free = torch.cuda.mem_get_info(torch.device(device))[0] if gpu_memory is None else gpu_memory
        gpu_room = free - fixed
    else:
        host_room -= fixed
    plans = []
    for n in tokens:
        pages = per_token * n
        if max_positions is not None and n > max_positions:
            plans.append(LengthPlan(n, pages, None, f"beyond the model's max_position_embeddings {max_positions:,}"))
        elif gpu_room is not None and gpu_room < 0:
            plans.append(LengthPlan(n, pages, None, f"the weights and one chunk ({_size(fixed)}) do not fit "
                                    "the GPU"))
        elif gpu_room is not None and offload != "host" and pages <= gpu_room:
            plans.append(LengthPlan(n, pages, "gpu"))
        elif (gpu_room is None or offload != "gpu") and pages <= host_room:
            plans.append(LengthPlan(n, pages, "host" if gpu_room is not None else "cpu"))
        else:
            room = max(gpu_room or 0, host_room if offload != "gpu" or gpu_room is None else 0)
            plans.append(LengthPlan(n, pages, None, f"its K/V pages take {_size(pages)}, {_size(max(room, 0))} is free "
                                    f"for them (offload {offload})"))
    return fixed, plans


def planned_times(shape: "ModelShape", lengths: list[int], chunk: int, page_size: int, sparse: Any,
                  dtype: "torch.dtype") -> dict[int, Any]:
    """The plan's GenerationTime on a GPU at each of ``lengths`` (tokens): the prefill in chunks of ``chunk``
    tokens and each new token after it (``core.plan.timing.generation_time``, weights and pages in ``dtype``)."""
    from .core.plan.timing import generation_time

    return {n: generation_time(shape, n, chunk, page_size, sparse, 1, dtype.itemsize) for n in lengths}


def time_against_plan(results: dict, times: dict[int, Any]) -> str:
    """One line: at each length, the range over tasks of a task's measured seconds (its prompts' prefill and
    decoding, ``run_grid``'s samples) divided by the plan's (``planned_times``: a prefill per prompt, plus the
    time a new token for each token the prompt generated)."""
    ranges = []
    for n, plan in times.items():
        ratios = []
        for by_length in results.values():
            rows = by_length[n]["samples"]
            planned = sum(plan.prefill_s + r["new_tokens"] * plan.decode_s for r in rows)
            ratios.append(sum(r["seconds"] for r in rows) / planned)
        ranges.append(f"{human_tokens(n)} {min(ratios):.2f}-{max(ratios):.2f}x")
    return "Time against the plan (per task, for the tokens generated): " + ", ".join(ranges)


def _check_model_dir(parser: argparse.ArgumentParser, path: str, gguf_file: str | None,
                     overrides: str | None) -> tuple[Path, Any, Any]:
    """The model's config (with ``overrides``, a JSON object) and tokenizer, or one line and exit 2: a missing
    directory, config, weights, gguf package or tokenizer, overrides that are not a JSON object or name a field
    the config lacks. Reads no weights."""
    from transformers import AutoTokenizer

    from .core.errors import SetupError
    from .core.pretrained import check_pretrained_dir, config_overrides_from_json, pretrained_config

    def flag_names(e: SetupError) -> str:
        return (str(e).replace("model.pretrained: ", "--model: ").replace("model.gguf_file: ", "--gguf-file: ")
                .replace("model.config_overrides: ", "--config-overrides: "))

    try:
        fields = None if overrides is None else config_overrides_from_json(overrides)
        where = check_pretrained_dir(path, gguf_file)
    except SetupError as e:
        _fail(parser, flag_names(e))
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(where), local_files_only=True, **extra)
    except Exception as e:  # transformers raises OSError, ValueError or TypeError by what is missing
        _fail(parser, f"--model: {path} has no tokenizer that loads offline (tokenizer.json, tokenizer.model or "
              f"vocab files; {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); save the model's "
              "tokenizer with tokenizer.save_pretrained(DIR)")
    try:
        config = pretrained_config(path, gguf_file, fields)
    except SetupError as e:
        _fail(parser, flag_names(e))
    return where, config, tokenizer


def main(argv: list[str] | None = None) -> int:
    """Run the evaluation; 0 when it ran, 2 for input refused before the model loads."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    from .evaluation.ruler import TASKS

    def task(name: str) -> str:
        if name not in TASKS:
            close = difflib.get_close_matches(name, TASKS, n=1)
            raise ValueError(f"unknown task {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                             + f"; the tasks: {', '.join(TASKS)}")
        return name

    tasks = list(dict.fromkeys(_parse_list(parser, args.tasks, "tasks", task)))
    lengths = sorted(set(_parse_list(parser, args.lengths, "lengths", parse_tokens)))
    if args.samples < 1:
        _fail(parser, f"--samples must be >= 1, got {args.samples}")
    from .core.units import parse_bytes

    try:
        gpu_memory = None if args.gpu_memory is None else parse_bytes(args.gpu_memory)
        host_memory = None if args.host_memory is None else parse_bytes(args.host_memory)
    except ValueError as e:
        _fail(parser, str(e))
    if importlib.util.find_spec("matplotlib") is None:
        _fail(parser, "the heatmap needs matplotlib: pip install 'lightning-oomb[bench]' (or pip install matplotlib)")
    shortest = max(TASKS[t].max_new_tokens for t in tasks)
    if lengths[0] <= shortest:
        _fail(parser, f"--lengths {human_tokens(lengths[0])} is no longer than the {shortest} tokens the tasks "
              "generate; give lengths of 1K tokens or more")

    import torch

    from ._noise import quiet_known_noise
    from .core.model_shape import ModelShape

    quiet_known_noise()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        _fail(parser, f"--device {device}: there is no CUDA device here")
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32,
             "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    _, config, tokenizer = _check_model_dir(parser, args.model, args.gguf_file, args.config_overrides)
    from .evaluation.ruler import has_chat_template, make_sample

    if args.apply_chat_template and not has_chat_template(tokenizer):
        _fail(parser, f"--apply-chat-template: the tokenizer of {args.model} has no chat template; leave the flag "
              "out (base-model prompts) or give a model directory whose tokenizer has one")
    for t in tasks:  # the shortest length takes each task's prompt in this tokenizer, or is refused here
        try:
            make_sample(t, lengths[0], tokenizer, 0, args.seed, args.apply_chat_template)
        except ValueError as e:
            _fail(parser, f"--lengths: {e}")
    shape = ModelShape.from_config(config, name=Path(args.model).name)
    fixed, plans = eval_plan(shape, lengths, dtype, args.chunk, device, args.offload, gpu_memory, host_memory,
                             getattr(config, "max_position_embeddings", None))
    refused = [p for p in plans if p.where is None]
    if refused:
        _fail(parser, "; ".join(f"--lengths {human_tokens(p.tokens)} does not fit: {p.why}" for p in refused))
    sparse = None
    if args.budget_pages:
        from .core.config import SparseConfig
        from .core.errors import SetupError

        try:
            sparse = SparseConfig(budget_pages=args.budget_pages)
        except SetupError as e:
            _fail(parser, f"--budget-pages: {e}")
    print(f"Eval plan ({device}, {dtype}, K/V pages only, no gradients): weights and one chunk "
          f"{_size(fixed)}; " + ", ".join(f"{human_tokens(p.tokens)}: {_size(p.pages)} of pages on {p.where}"
                                            for p in plans))
    times = {}
    if device.startswith("cuda"):  # the planner's GPU time model (docs/planner.md, "Generation")
        times = planned_times(shape, lengths, args.chunk, args.page_size, sparse, dtype)
        print("Time per sample (plan): " + ", ".join(
            f"{human_tokens(n)}: prefill {t.prefill_s:.2g} s, then {t.decode_s * 1e3:.0f} ms a new token"
            for n, t in times.items()))

    from .core.pretrained import load_pretrained
    from .evaluation.grid import format_table, heatmap, run_grid

    model = load_pretrained(args.model, dtype, device, args.gguf_file, config=config).eval()
    options = dict(chunk_size=args.chunk, page_size=args.page_size, offload=args.offload, host_memory=host_memory)
    if sparse is not None:
        options["sparse"] = sparse
    results = run_grid(model, tokenizer, tasks, lengths, args.samples, args.seed, options, device,
                       chat=args.apply_chat_template)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scores = {t: {human_tokens(n): results[t][n]["score"] for n in lengths} for t in tasks}
    table = format_table(scores, tasks, [human_tokens(n) for n in lengths])
    print(table)
    if times:
        print(time_against_plan(results, times))
    report = dict(model=str(args.model), gguf_file=args.gguf_file, config_overrides=args.config_overrides,
                  apply_chat_template=args.apply_chat_template, tasks=tasks, lengths=lengths, samples=args.samples,
                  seed=args.seed, options={k: str(v) for k, v in options.items()},
                  plan=dict(device=device, dtype=str(dtype).removeprefix("torch."), fixed_bytes=fixed,
                            pages={human_tokens(p.tokens): dict(bytes=p.pages, on=p.where) for p in plans},
                            seconds={human_tokens(n): dict(prefill=t.prefill_s, per_new_token=t.decode_s)
                                     for n, t in times.items()}),
                  scores=scores, details={t: {human_tokens(n): results[t][n]["samples"] for n in lengths}
                                          for t in tasks})
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    heatmap(scores, tasks, [human_tokens(n) for n in lengths], out / "heatmap.png", title=Path(args.model).name)
    print(f"wrote {out / 'results.json'} and {out / 'heatmap.png'}")
    return 0
