"""lightning_oomb.train_step in a plain PyTorch loop, checked against full-sequence training.

A tiny Qwen2-shaped model (random init) on one sequence many chunks long: first the loss and gradient
of train_step next to transformers' own full-sequence backward, then a few optimizer steps.

    python examples/plain_pytorch_loop.py [--seq-len 4096] [--chunk-size 256]
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import lightning_oomb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len)
    model = AutoModelForCausalLM.from_config(config).float().train()
    ids = torch.randint(0, config.vocab_size, (1, args.seq_len))

    full = model(input_ids=ids, labels=ids).loss
    full.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    loss = lightning_oomb.train_step(model, ids, chunk_size=args.chunk_size)
    got = [p.grad for p in model.parameters()]
    err = max(float((g - w).norm() / w.norm()) for g, w in zip(got, want))
    chunks = -(-args.seq_len // args.chunk_size)
    print(f"{args.seq_len} tokens in {chunks} chunks of {args.chunk_size}")
    print(f"loss: full sequence {full.item():.6f}  lightning_oomb {loss.item():.6f}")
    print(f"largest relative gradient difference over all parameters: {err:.2e}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # optimizer=: the step leaves GPU memory free for the state AdamW's first update creates
        loss = lightning_oomb.train_step(model, ids, chunk_size=args.chunk_size, optimizer=optimizer)
        print(f"step {step + 1}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
