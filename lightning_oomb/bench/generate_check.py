"""``lightning_oomb.generate`` on a real model against transformers' greedy search, float32 on the CPU.

Loads a local model (a Hugging Face directory, or a GGUF file in it, dequantised to float32), builds a prompt of
``--prompt-tokens`` tokens of generated English-like text, and decodes ``--new-tokens`` tokens both ways:
``model.generate(do_sample=False)`` on the whole prompt, and the engine with the prompt stored chunk by chunk
in its pages (each of ``OPTION_SETS`` in turn). Prints, per set, whether the tokens are equal and the largest
difference of the chosen tokens' log-probabilities; exits 1 if a token differs or a difference exceeds twice
what transformers itself differs by between its cached decoding and one forward of the whole sequence (the
float32 rounding of this model at this length), or ``--tolerance`` where that is larger.

    python -m lightning_oomb.bench.generate_check --model DIR --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

WORDS = ("the of and to in is was for on that with as by at from his her an which were are this be had not "
         "but they one all have their has more also who been into time other its first after two new").split()

# Each set of engine options decodes the same prompt: pages on the device, streamed from host memory, and
# sparse attention over a budget that holds every page (then equal to dense).
OPTION_SETS = {
    "pages": {},
    "host pages": {"offload": "host"},
    "sparse, every page": {"sparse": {"budget_pages": 4096, "sink_pages": 1, "local_pages": 1}},
}


def english_prompt(tokenizer, tokens: int, seed: int = 0) -> torch.Tensor:
    """(1, tokens) int64: the first ``tokens`` ids of generated sentences of common English words."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < tokens:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))).capitalize() + ". "
        ids += tokenizer(sentence, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids[:tokens]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a local model directory")
    parser.add_argument("--gguf-file", default=None, help="a GGUF file in it")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="the least allowed log-probability difference (the bound is the larger of this and "
                             "twice transformers' own cached-against-whole difference)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    import lightning_oomb
    from ..core.pretrained import load_pretrained
    from ..lightning.corpus import load_tokenizer

    torch.manual_seed(0)
    tokenizer = load_tokenizer(args.model, "--model", gguf_file=args.gguf_file)
    model = load_pretrained(args.model, torch.float32, gguf_file=args.gguf_file).eval()
    ids = english_prompt(tokenizer, args.prompt_tokens)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=args.new_tokens, output_scores=True,
                             return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
    want = out.sequences
    want_logprobs = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    # transformers against itself: the same tokens' log-probabilities from one forward of the whole sequence,
    # the float32 rounding of this model at this length that any other order of the sums also meets.
    with torch.no_grad():
        logits = model(want[:, :-1]).logits[:, ids.shape[1] - 1:].float()
    whole = torch.log_softmax(logits, -1).gather(-1, want[:, ids.shape[1]:, None])[..., 0]
    own_diff = (whole - want_logprobs).abs().max().item()
    results = {"transformers_cached_vs_whole_diff": own_diff, "model": args.model, "gguf_file": args.gguf_file, "prompt_tokens": args.prompt_tokens,
               "new_tokens": int(want.shape[1] - ids.shape[1]), "chunk_size": args.chunk_size,
               "page_size": args.page_size, "transformers_s": round(time.perf_counter() - started, 2),
               "text": tokenizer.decode(want[0, ids.shape[1]:]), "sets": {}}
    bound = max(args.tolerance, 2 * own_diff)
    results["bound"] = bound
    failed = False
    for name, options in OPTION_SETS.items():
        started = time.perf_counter()
        got = lightning_oomb.generate(model, ids, max_new_tokens=args.new_tokens, output_logprobs=True,
                                      chunk_size=args.chunk_size, page_size=args.page_size, **options)
        equal = torch.equal(got.sequences, want)
        diff = (got.logprobs - want_logprobs).abs().max().item() if got.logprobs.shape == want_logprobs.shape \
            else float("inf")
        failed |= not equal or diff > bound
        results["sets"][name] = {"tokens_equal": equal, "max_logprob_diff": diff,
                                 "seconds": round(time.perf_counter() - started, 2)}
        print(f"{name:20s} tokens equal: {equal}  largest log-probability difference: {diff:.2e}  "
              f"({results['sets'][name]['seconds']} s)", flush=True)
    print(f"transformers' own cached decoding against one whole-sequence forward: {own_diff:.2e}")
    print(f"transformers' greedy search: {results['new_tokens']} tokens in {results['transformers_s']} s: "
          f"{results['text']!r}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
