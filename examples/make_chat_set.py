"""Writes the CPU chat demo's data (examples/chat_cpu.yaml): examples/chat_tokenizer/ and examples/chat_set.jsonl.

    python examples/make_chat_set.py            # rewrites both, byte for byte the same on every run
    python examples/make_chat_set.py OUT        # writes them into the folder OUT instead

The tokenizer is examples/byte_tokenizer (one token per byte, EOS 256) with ChatML's special tokens added,
<|im_start|> 257 and <|im_end|> 258, and ChatML's template: 259 tokens, the model's vocab_size.

Each conversation is multi-turn and long (582 to 2,724 tokens): the first user turn states a secret letter, the
only upper-case letter in the conversation; 3 to 12 turns follow, each a user turn of random lower-case words
answered "ok." or, one time in four, the question "what is my secret letter?" answered with the letter; the last
turn is that question. With train_on: assistant every assistant turn is labelled, and all but the recalled
letters can be told from the turn itself: once the turns' form is learnt, the held-out loss is mostly the
recalled letters, which the model gets right only by attending back to the first user turn, up to 2,400 tokens
and several chunks earlier.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BYTE_TOKENIZER = HERE / "byte_tokenizer" / "tokenizer.json"
TOKENIZER_DIR = "chat_tokenizer"
CHAT_SET = "chat_set.jsonl"

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


def conversation(rng: random.Random) -> dict:
    secret = rng.choice(SECRETS)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{sentence(rng)} my secret letter is {secret}. keep it for later."},
                {"role": "assistant", "content": "ok."}]
    for _ in range(rng.randint(3, 12)):
        if rng.random() < 0.25:  # asked on the way too: the same recall from nearer, which helps it be learnt
            messages += [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": f"{secret}."}]
        else:
            messages += [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": "ok."}]
    messages += [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": f"{secret}."}]
    return {"messages": messages}


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
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    for path in write(folder):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
