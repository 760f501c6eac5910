"""Writes the CPU chat demo's data (examples/chat_cpu.yaml): examples/chat_tokenizer/ and examples/chat_set.jsonl.

    python examples/make_chat_set.py            # rewrites both, byte for byte the same on every run
    python examples/make_chat_set.py OUT        # writes them into the folder OUT instead
    python examples/make_chat_set.py OUT --long --tokenizer MODEL_DIR [--gguf-file F] [--tokens 8000:60000]
        # long conversations of the same form for a real model's chat template (docs/bench/smollm2-chat-64k-h200.sh)

The tokenizer is examples/byte_tokenizer (one token per byte, EOS 256) with ChatML's special tokens added,
<|im_start|> 257 and <|im_end|> 258, and ChatML's template: 259 tokens, the model's vocab_size.

Each conversation is multi-turn and long (582 to 2,724 tokens): the first user turn states a secret letter, the
only upper-case letter in the conversation; 3 to 12 turns follow, each a user turn of random lower-case words
answered "ok." or, one time in four, the question "what is my secret letter?" answered with the letter; the last
turn is that question. With train_on: assistant every assistant turn is labelled, and all but the recalled
letters can be told from the turn itself: once the turns' form is learnt, the held-out loss is mostly the
recalled letters, which the model gets right only by attending back to the first user turn, up to 2,400 tokens
and several chunks earlier.

With --long it writes only OUT/long_chats.jsonl: --conversations conversations of that form whose user turns hold
4 to 16 sentences, each rendered with the tokenizer's own chat template to a token count drawn uniformly from
--tokens (MIN:MAX), so the last question is asked that far after the secret.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
BYTE_TOKENIZER = HERE / "byte_tokenizer" / "tokenizer.json"
TOKENIZER_DIR = "chat_tokenizer"
CHAT_SET = "chat_set.jsonl"
LONG_CHATS = "long_chats.jsonl"

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

SECRETS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
WORDS = ("the a of and to in is was for on with as by at from that this it be are were has had not but or an "
         "river stone cloud window paper table garden morning evening winter summer train road city village "
         "music letter story friend market bread coffee water light shadow field mountain valley ocean bird "
         "walk read write cook build carry open close watch listen travel rest plant paint count sing "
         "quiet bright slow quick warm cold old new small large green blue red yellow soft heavy early late").split()
QUESTION = "what is my secret letter?"
SYSTEM = "you are a helpful assistant. remember what the user tells you."
N_CONVERSATIONS = 240
SEED = 0


def make_tokenizer():
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(BYTE_TOKENIZER), eos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 45))) + "."


def opening(rng: random.Random, secret: str) -> list[dict]:
    """The system prompt, the user turn that states the secret, and the assistant's "ok."."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{sentence(rng)} my secret letter is {secret}. keep it for later."},
            {"role": "assistant", "content": "ok."}]


def question(secret: str) -> list[dict]:
    return [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": f"{secret}."}]


def turn(rng: random.Random, secret: str, long: bool = False) -> list[dict]:
    """One turn after the opening: one time in four the question (asked on the way too: the same recall from
    nearer, which helps it be learnt), else one sentence (``long``: 4 to 16) answered "ok."."""
    if rng.random() < 0.25:
        return question(secret)
    text = " ".join(sentence(rng) for _ in range(rng.randint(4, 16))) if long else sentence(rng)
    return [{"role": "user", "content": text}, {"role": "assistant", "content": "ok."}]


def conversation(rng: random.Random) -> dict:
    secret = rng.choice(SECRETS)
    messages = opening(rng, secret)
    for _ in range(rng.randint(3, 12)):
        messages += turn(rng, secret)
    return {"messages": messages + question(secret)}


def long_conversation(rng: random.Random, tokens: int, count) -> tuple[dict, int]:
    """A conversation of ``conversation``'s form of at most ``tokens`` tokens once rendered, filled with long
    turns until the next would pass ``tokens``, and its token count; ``count(messages)`` counts the rendered
    tokens. A turn is counted as what it adds to the shortest conversation (templates render turn by turn), and
    the whole is counted at the end, dropping turns while it is over."""
    secret = rng.choice(SECRETS)
    head, tail = opening(rng, secret), question(secret)
    turns: list[dict] = []
    shortest = count(head + tail)
    total = shortest
    while True:
        next_turn = turn(rng, secret, long=True)
        total += count(head + next_turn + tail) - shortest
        if total > tokens:
            break
        turns += next_turn
    while (n := count(head + turns + tail)) > tokens and turns:
        turns = turns[:-2]
    return {"messages": head + turns + tail}, n


def write_long(path: Path, tokenizer, conversations: int, low: int, high: int, seed: int = SEED) -> list[int]:
    """Writes ``conversations`` long conversations to ``path`` (JSON Lines), each at most a token count drawn
    uniformly from [low, high] in ``tokenizer``'s chat template; returns their token counts."""
    def count(messages: list[dict]) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    rng = random.Random(seed)
    rows, counts = [], []
    for _ in range(conversations):
        row, n = long_conversation(rng, rng.randint(low, high), count)
        rows.append(json.dumps(row) + "\n")
        counts.append(n)
    path.write_text("".join(rows))
    return counts


def write(folder: Path) -> list[Path]:
    """Writes the tokenizer folder and the conversations into ``folder``; returns the files written."""
    tokenizer = folder / TOKENIZER_DIR
    make_tokenizer().save_pretrained(tokenizer)
    rng = random.Random(SEED)
    rows = [conversation(rng) for _ in range(N_CONVERSATIONS)]
    chat_set = folder / CHAT_SET
    chat_set.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return sorted(tokenizer.iterdir()) + [chat_set]


def main() -> None:
    parser = argparse.ArgumentParser(description="Writes the chat demo's data, or long conversations (--long).")
    parser.add_argument("folder", nargs="?", type=Path, default=HERE)
    parser.add_argument("--long", action="store_true", help=f"write only FOLDER/{LONG_CHATS}")
    parser.add_argument("--tokenizer", help="with --long: the model directory whose tokenizer and template count")
    parser.add_argument("--gguf-file", default=None, help="with --long: a GGUF file in --tokenizer holding them")
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--tokens", default="8000:60000", help="MIN:MAX tokens of a conversation, rendered")
    args = parser.parse_args()
    if not args.long:
        for path in write(args.folder):
            print(f"wrote {path} ({path.stat().st_size:,} bytes)")
        return
    if args.tokenizer is None:
        parser.error("--long needs --tokenizer (the model directory whose chat template renders the conversations)")
    low, high = (int(x) for x in args.tokens.split(":"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, gguf_file=args.gguf_file)
    args.folder.mkdir(parents=True, exist_ok=True)
    path = args.folder / LONG_CHATS
    counts = write_long(path, tokenizer, args.conversations, low, high)
    print(f"wrote {path}: {len(counts)} conversations of {min(counts):,} to {max(counts):,} tokens "
          f"({sum(counts):,} in all)")


if __name__ == "__main__":
    main()
