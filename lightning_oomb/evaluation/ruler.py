"""RULER's synthetic tasks that need no downloaded data, generated here after NVIDIA/RULER's recipes
(scripts/data/synthetic: niah.py, variable_tracking.py, common_words_extraction.py,
freq_words_extraction.py), and scored as RULER scores them.

What differs from RULER, and why: RULER's essay haystack (Paul Graham's essays) is a download, so the tasks that
use it (niah_single_2, niah_single_3, niah_multikey_1, niah_multivalue, niah_multiquery) take the noise haystack
here, with their own keys, values and needle counts; the word lists RULER takes from the wonderwords package
are made up here from syllables (``_words``), so no package and no data file is needed. The prompts follow
RULER's templates (task instruction, context, question, then an answer prefix the model continues), in base-model
form, or with ``chat=True`` as RULER prompts chat models: the instruction, context and question as the user's
turn of the tokenizer's own chat template, the answer prefix opening the assistant's turn. Lengths are in tokens
of the model's own tokenizer and include the tokens the task generates, as RULER's ``max_seq_length`` does.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NOISE_SENTENCES = [s.strip() + "." for s in NOISE.split(".") if s.strip()]


class Tokenizer(Protocol):
    """What the generators need of a tokenizer (transformers' tokenizers): ``encode(text) -> list[int]``, and
    for chat-form prompts ``apply_chat_template`` and a ``chat_template``."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class TaskSpec:
    """One RULER task: how its samples are made and scored.

    kind: "niah", "vt", "cwe" or "fwe". max_new_tokens: the tokens RULER lets the model generate
    (``tokens_to_generate``). metric: "all" (string_match_all) or "part" (string_match_part). options: the
    recipe's parameters (needle counts, key and value types, haystack).
    """

    kind: str
    max_new_tokens: int
    metric: str = "all"
    options: dict = field(default_factory=dict)


def _niah(haystack: str, keys: str, values: str, k: int = 1, v: int = 1, q: int = 1) -> TaskSpec:
    return TaskSpec("niah", 128, options=dict(haystack=haystack, keys=keys, values=values, k=k, v=v, q=q))


# RULER's synthetic.yaml, the essay haystack replaced by noise (module docstring).
TASKS: dict[str, TaskSpec] = {
    "niah_single_1": _niah("noise", "words", "numbers"),
    "niah_single_2": _niah("noise", "words", "numbers"),
    "niah_single_3": _niah("noise", "words", "uuids"),
    "niah_multikey_1": _niah("noise", "words", "numbers", k=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("noise", "words", "numbers", v=4),
    "niah_multiquery": _niah("noise", "words", "numbers", k=4, q=4),
    "vt": TaskSpec("vt", 30, options=dict(chains=1, hops=4)),
    # Under 4K tokens RULER lists the common words twice and the others once (30 x 10 words do not fit).
    "cwe": TaskSpec("cwe", 120, options=dict(common=10, freq_common=30, freq_uncommon=3, short=(2, 1))),
    "fwe": TaskSpec("fwe", 50, options=dict(alpha=2.0, answers=3)),
}


@dataclass
class Sample:
    """One prompt of a task at one length.

    prompt: the text the model continues (ends with the answer prefix). references: the strings the answer
    must contain. tokens: the prompt's length in tokens of the tokenizer it was made with,
    ``len(encode(prompt, add_special_tokens=add_special_tokens))``; tokens + max_new_tokens <= the length asked
    for. add_special_tokens: True in base form (the tokenizer's BOS, for many), False in chat form (the template
    writes its own special tokens).
    """

    task: str
    length: int
    index: int
    prompt: str
    references: list[str]
    tokens: int
    max_new_tokens: int
    add_special_tokens: bool = True


# -- words, keys and values ---------------------------------------------------------------------------------

_ONSETS = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "cl", "dr", "fl", "gr", "pl", "st", "tr", "sh", "ch"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "oo"]
_CODAS = ["", "", "n", "r", "l", "s", "t", "m", "ck", "nd"]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


def _words(rng: random.Random, n: int, syllables: tuple[int, int] = (2, 3)) -> list[str]:
    """n distinct made-up lowercase words of 2-3 syllables (RULER draws real English words from wonderwords)."""
    out: dict[str, None] = {}
    while len(out) < n:
        out[_word(rng, rng.randint(*syllables))] = None
    return list(out)


def _key(rng: random.Random, kind: str) -> str:
    # RULER's word keys are adjective-noun pairs ("tasteful-coral"); here two made-up words.
    return "-".join(_words(rng, 2)) if kind == "words" else str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _value(rng: random.Random, kind: str) -> str:
    return str(rng.randint(1_000_000, 9_999_999)) if kind == "numbers" else str(uuid.UUID(int=rng.getrandbits(128), version=4))


# -- the tasks: each builds a prompt from n units of filler -----------------------------------------------------
# A builder (made from the task, a seeded rng and the length asked) takes (rng, n units of filler) and returns
# (the instruction, context and question; the answer prefix; the references); the same rng state and n give the
# same text, and its length grows with n, which make_sample searches for the length asked.
Builder = Callable[[random.Random, int], tuple[str, str, list[str]]]


def _spread(n_slots: int, n: int, rng: random.Random) -> list[int]:
    """n insertion points among n_slots + 1 gaps, sorted (RULER spreads needles over the depth)."""
    return sorted(rng.randint(0, n_slots) for _ in range(n))


def _niah_builder(spec: TaskSpec, seed_rng: random.Random, length: int) -> Builder:
    o = spec.options
    what = "numbers" if o["values"] == "numbers" else "UUIDs"
    # The keys and values are drawn once per sample, so that only the haystack grows with n.
    keys = list(dict.fromkeys(_key(seed_rng, o["keys"]) for _ in range(o["k"] * 2)))[: o["k"]]
    values = [[_value(seed_rng, o["values"]) for _ in range(o["v"])] for _ in keys]
    queried = seed_rng.sample(range(len(keys)), o["q"])
    needles = [f"One of the special magic {what} for {k} is: {v}." for k, vs in zip(keys, values) for v in vs]
    layout_seed = seed_rng.getrandbits(64)

    def build(rng: random.Random, n: int) -> tuple[str, str, list[str]]:
        r = random.Random(layout_seed)
        if o["haystack"] == "noise":
            filler = [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(n)]
        else:  # a haystack of needles of other keys (RULER's "needle" haystack)
            taken = set(keys)
            filler = []
            while len(filler) < n:
                k = _key(r, o["keys"])
                if k not in taken:
                    filler.append(f"One of the special magic {what} for {k} is: {_value(r, o['values'])}.")
        order = needles[:]
        r.shuffle(order)
        for at, needle in zip(reversed(_spread(len(filler), len(order), r)), order):
            filler.insert(at, needle)
        query_keys = [keys[i] for i in queried]
        query = query_keys[0] if len(query_keys) == 1 else ", ".join(query_keys[:-1]) + ", and " + query_keys[-1]
        prompt = (f"Some special magic {what} are hidden within the following text. Make sure to memorize it. "
                  f"I will quiz you about the {what} afterwards.\n{' '.join(filler)}\n"
                  f"What are all the special magic {what} for {query} mentioned in the provided text?")
        answer = f" The special magic {what} for {query} mentioned in the provided text are"
        return prompt, answer, [v for i in queried for v in values[i]]

    return build


def _vt_builder(spec: TaskSpec, seed_rng: random.Random, length: int) -> Builder:
    chains, hops = spec.options["chains"], spec.options["hops"]
    names = list(dict.fromkeys("".join(seed_rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
                                for _ in range(chains * (hops + 1) * 2)))
    value = str(seed_rng.randint(10_000, 99_999))
    others = [str(seed_rng.randint(10_000, 99_999)) for _ in range(chains - 1)]
    links: list[list[str]] = []
    for c in range(chains):
        var = names[c * (hops + 1):(c + 1) * (hops + 1)]
        start = value if c == 0 else others[c - 1]
        links.append([f"VAR {var[0]} = {start}"] + [f"VAR {var[i]} = VAR {var[i - 1]}" for i in range(1, hops + 1)])
    answer = names[: hops + 1]
    layout_seed = seed_rng.getrandbits(64)

    def build(rng: random.Random, n: int) -> tuple[str, str, list[str]]:
        r = random.Random(layout_seed)
        filler = [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(n)]
        # Each chain in order, its statements spread over the text (a statement never precedes the one it reads).
        statements = [s + "." for chain in links for s in chain]
        for at, s in zip(reversed(_spread(len(filler), len(statements), r)), reversed(statements)):
            filler.insert(at, s)
        prompt = (f"Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                  f"{' '.join(filler)}\nQuestion: Find all variables that are assigned the value {value} in the "
                  f"text above.")
        prefix = (f" Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} "
                  f"variables are assigned the value {value}, they are: ")
        return prompt, prefix, answer

    return build


def _cwe_builder(spec: TaskSpec, seed_rng: random.Random, length: int) -> Builder:
    o = spec.options
    freq_common, freq_uncommon = o["short"] if length < 4096 else (o["freq_common"], o["freq_uncommon"])
    layout_seed = seed_rng.getrandbits(64)

    def build(rng: random.Random, n: int) -> tuple[str, str, list[str]]:
        # n: the number of uncommon words, each listed freq_uncommon times; the common ones freq_common times.
        r = random.Random(layout_seed)
        vocab = _words(r, o["common"] + n)
        common, uncommon = vocab[: o["common"]], vocab[o["common"]:]
        items = common * freq_common + uncommon * freq_uncommon
        r.shuffle(items)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        prompt = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize "
                  f"the ones that appear most often.\n{listing}\nQuestion: What are the {o['common']} most common "
                  f"words in the above list?")
        return prompt, f" Answer: The top {o['common']} words that appear most often in the list are:", common

    return build


def _fwe_builder(spec: TaskSpec, seed_rng: random.Random, length: int) -> Builder:
    o = spec.options
    layout_seed = seed_rng.getrandbits(64)

    def build(rng: random.Random, n: int) -> tuple[str, str, list[str]]:
        # n coded words in all, drawn by Zipf's law over a vocabulary of made-up words: the word of rank r
        # about n / r^alpha / zeta(alpha) times; the answers are the top ranks, whose counts differ.
        r = random.Random(layout_seed)
        vocab = _words(r, max(o["answers"] + 1, n // 8 + o["answers"]), syllables=(1, 2))
        weights = [1.0 / (rank + 1) ** o["alpha"] for rank in range(len(vocab))]
        total = sum(weights)
        counts = [max(1, round(n * w / total)) for w in weights]
        for i in range(1, o["answers"] + 1):  # the top ranks strictly more frequent than the next
            counts[i] = min(counts[i], counts[i - 1] - 1) if counts[i - 1] > 1 else counts[i]
        items = [w for w, c in zip(vocab, counts) for _ in range(c)]
        r.shuffle(items)
        text = " ".join(w if i % 10 else w + " ...." for i, w in enumerate(items))
        prompt = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                  f"frequently appeared coded words. {text}\nQuestion: Do not provide any explanation. Please ignore "
                  "the dots '....'. What are the three most frequently appeared words in the above coded text?")
        prefix = " Answer: According to the coded text above, the three most frequently appeared words are:"
        return prompt, prefix, vocab[: o["answers"]]

    return build


BUILDERS: dict[str, Callable[[TaskSpec, random.Random, int], Builder]] = {
    "niah": _niah_builder, "vt": _vt_builder, "cwe": _cwe_builder, "fwe": _fwe_builder,
}


def has_chat_template(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` can give chat-form prompts (``compose``): it has a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def compose(tokenizer: Tokenizer, body: str, prefix: str, chat: bool) -> str:
    """A sample's prompt: in base form ``body`` then the answer ``prefix``; in chat form ``body`` as the user's
    turn of the tokenizer's chat template with the assistant's turn opened (``add_generation_prompt``), then
    the prefix, its leading space dropped (it starts the assistant's text)."""
    if not chat:
        return body + prefix
    turn = tokenizer.apply_chat_template([{"role": "user", "content": body}], add_generation_prompt=True,
                                         tokenize=False)
    return turn + prefix.lstrip()


def make_sample(task: str, length: int, tokenizer: Tokenizer, index: int = 0, seed: int = 0,
                chat: bool = False) -> Sample:
    """Sample ``index`` of ``task`` whose prompt plus the task's new tokens take at most ``length`` tokens of
    ``tokenizer``, and as many as the filler's granularity allows (a noise sentence, a needle, a listed word:
    a few tokens to a few dozen); ``chat``: in the tokenizer's chat template (``compose``). Deterministic in
    (task, length, index, seed, chat). Raises ValueError for an unknown task, a length shorter than the task's
    prompt without filler plus its new tokens, or ``chat`` with a tokenizer that has no chat template."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; known: {', '.join(TASKS)}")
    if chat and not has_chat_template(tokenizer):
        raise ValueError("the tokenizer has no chat template; leave out the chat form (base-model prompts) or "
                         "give a tokenizer that has one")
    spec = TASKS[task]
    rng = random.Random(f"{task}/{length}/{index}/{seed}")
    build = BUILDERS[spec.kind](spec, rng, length)
    budget = length - spec.max_new_tokens
    # A 1M-token prompt is megabytes of text, so each count is a tokenizer pass over it: the search interpolates
    # (the count grows about linearly with the filler) and bisects only where interpolation stalls.
    seen: dict[int, int] = {}

    def render(n: int) -> tuple[str, list[str]]:
        body, prefix, references = build(rng, n)
        return compose(tokenizer, body, prefix, chat), references

    def tokens(n: int) -> int:
        # With the special tokens the model is given (base form: a BOS token, for many; chat form: the
        # template's own), as the prompt is encoded to decode it.
        if n not in seen:
            seen[n] = len(tokenizer.encode(render(n)[0], add_special_tokens=not chat))
        return seen[n]

    low = 1
    if tokens(low) > budget:
        raise ValueError(f"{task} at {length} tokens: its prompt alone takes {tokens(low)} tokens and it generates "
                         f"{spec.max_new_tokens}; ask for a longer length")
    probe = 64
    per_unit = max((tokens(probe) - tokens(low)) / (probe - low), 1e-3)
    high = max(low + 1, int((budget - tokens(low)) / per_unit) + 1)
    while tokens(high) <= budget:  # an upper bracket: the estimate, or past it
        low, high = high, high + max(2, (high - low) // 8, int((budget - tokens(high)) / per_unit) + 2)
    # tokens(low) <= budget < tokens(high)
    steps = 0
    while high - low > 1:
        steps += 1
        if steps % 3:  # interpolated between the brackets
            rate = (tokens(high) - tokens(low)) / (high - low)
            mid = min(max(low + int((budget - tokens(low)) / max(rate, 1e-3)), low + 1), high - 1)
            if tokens(mid) <= budget and mid + 1 < high and tokens(mid + 1) > budget:
                low, high = mid, mid + 1
                continue
        else:
            mid = (low + high) // 2
        if tokens(mid) <= budget:
            low = mid
        else:
            high = mid
    prompt, references = render(low)
    return Sample(task, length, index, prompt, references, tokens(low), spec.max_new_tokens, not chat)


def make_samples(task: str, length: int, tokenizer: Tokenizer, n: int, seed: int = 0,
                 chat: bool = False) -> list[Sample]:
    """``n`` samples of ``task`` at ``length`` tokens (``make_sample`` with index 0..n-1)."""
    return [make_sample(task, length, tokenizer, i, seed, chat) for i in range(n)]


# -- scoring, as RULER's evaluate.py ------------------------------------------------------------------------------

def postprocess(prediction: str) -> str:
    """The prediction as RULER scores it: stripped, without NUL and other non-printable characters."""
    return "".join(c for c in prediction.strip() if c.isprintable() or c in "\n\t")


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's metric of the NIAH, VT, CWE and FWE tasks: per sample the fraction of its references found in
    the prediction (case-insensitive substring), averaged over samples, in percent (0-100)."""
    scores = [sum(r.lower() in p.lower() for r in refs) / len(refs) for p, refs in zip(predictions, references)]
    return 100.0 * sum(scores) / len(scores)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's metric of its QA tasks: per sample 1 if any reference is in the prediction (case-insensitive),
    averaged over samples, in percent (0-100)."""
    scores = [max(r.lower() in p.lower() for r in refs) for p, refs in zip(predictions, references)]
    return 100.0 * sum(scores) / len(scores)


METRICS = {"all": string_match_all, "part": string_match_part}


def score(task: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """The task's RULER score (0-100) of the predictions (each postprocessed first)."""
    return METRICS[TASKS[task].metric]([postprocess(p) for p in predictions], references)
