"""The ``lightning-oomb`` command: Lightning CLI subcommands (fit, validate, test) with YAML configs
(lightning_oomb/lightning/cli.py), plus the plain ``plan``, ``bench`` and ``evaluate`` commands."""

from __future__ import annotations

import sys

from ._noise import quiet_known_noise

USAGE = """usage: lightning-oomb COMMAND [options]

commands:
  fit       train a Hugging Face causal LM with OOMBStrategy (Lightning CLI): fit --config examples/lora.yaml
  validate  held-out loss of a model or checkpoint (Lightning CLI)
  test      test loss (Lightning CLI)
  plan      memory and time of one step before running it: plan --model qwen2.5-7b --context 1M --gpu-memory 140GiB
  bench     measure steps against plain transformers on this GPU: bench --model qwen2.5-7b --lengths 16k,32k
  evaluate  RULER's synthetic tasks at each context length: evaluate --model DIR --lengths 4K,16K,64K

`lightning-oomb COMMAND --help` lists a command's options (fit: --print_config shows a whole configuration)."""


COMMANDS = ("fit", "validate", "test", "plan", "bench", "evaluate")


def main(args: list[str] | None = None) -> int | None:
    """Run ``lightning-oomb ARGS`` (None: the command line's). Returns the exit status (None: 0)."""
    argv = list(args if args is not None else sys.argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    # Each command imports what it needs here: `plan` and `--help` answer without loading Lightning and
    # transformers. `plan` and `bench` are plain argparse commands, the others Lightning CLI subcommands.
    if argv[0] == "plan":
        from .planner_cli import main as plan_main

        return plan_main(argv[1:])
    quiet_known_noise()
    if argv[0] == "bench":
        from .bench.run import main as bench_main

        return bench_main(argv[1:])
    if argv[0] == "evaluate":
        from .evaluate_cli import main as evaluate_main

        return evaluate_main(argv[1:])
    if argv[0] not in COMMANDS and not argv[0].startswith("-"):
        import difflib

        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        print(f"lightning-oomb: error: unknown command {argv[0]!r}" + (f"; did you mean {close[0]!r}?" if close else "")
              + f" (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    from .lightning.cli import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
