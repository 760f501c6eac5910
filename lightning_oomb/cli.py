"""The ``lightning-oomb`` command: Lightning CLI subcommands (fit, validate, test) with YAML configs
(lightning_oomb/lightning/cli.py), plus the plain ``plan``, ``bench`` and ``evaluate`` commands and ``lm-eval``
(lm-eval's own command line, with the ``lightning_oomb`` model registered)."""

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
  lm-eval   lm-eval's command line with the lightning_oomb model (the [eval] extra):
            lm-eval run --model lightning_oomb --model_args pretrained=DIR,chunk_size=4096 --tasks TASK

`lightning-oomb COMMAND --help` lists a command's options (fit: --print_config shows a whole configuration).
`kill -USR1 PID` prints a running fit's, validate's or test's Python stacks to stderr and the run goes on
(not under SLURM, whose auto-requeue signal it is)."""


COMMANDS = ("fit", "validate", "test", "plan", "bench", "evaluate", "lm-eval")


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
    if argv[0] == "lm-eval":
        return lm_eval_main(argv[1:])
    if argv[0] not in COMMANDS and not argv[0].startswith("-"):
        import difflib

        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        print(f"lightning-oomb: error: unknown command {argv[0]!r}" + (f"; did you mean {close[0]!r}?" if close else "")
              + f" (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    dump_stacks_on_sigusr1()
    from .lightning.cli import run

    return run(args)


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` prints every thread's Python stack to stderr and the run goes on: where a long step or
    an unexpected growth of memory is, without stopping it. Not under SLURM, where SIGUSR1 is the signal that
    Lightning's auto-requeue handles, and which it does not claim where a handler is already set."""
    import os
    import signal

    if "SLURM_JOB_ID" in os.environ:
        return
    if hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        # A Python handler, not faulthandler.register: Lightning's Trainer saves the handlers Python knows at
        # set-up and puts them back at teardown, which would reset a C-level one to the default (terminate).
        try:
            signal.signal(signal.SIGUSR1, _dump_stacks)
        except ValueError:  # called from a thread other than the main one, where no handler can be set
            return


def _dump_stacks(signum: int, frame: object) -> None:
    import faulthandler

    # The process's own stderr: a captured or redirected sys.stderr may have no file descriptor to write to.
    if sys.__stderr__ is not None:
        try:
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        except (OSError, ValueError):
            pass


def lm_eval_main(args: list[str]) -> int:
    """lm-eval's command line on ``args`` (``lm-eval ARGS`` with the ``lightning_oomb`` model registered, which
    lm-eval does not discover in other packages by itself); a bad model argument is one line, exit status 2."""
    try:
        from .evaluation import lm_eval_backend  # noqa: F401  (registers the model "lightning_oomb")
    except ImportError as e:
        print(f"lightning-oomb lm-eval: error: {e}", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    from .core.errors import SetupError

    saved, sys.argv = sys.argv, ["lightning-oomb lm-eval", *args]  # lm-eval's parser reads sys.argv
    try:
        cli_evaluate()
    except SetupError as e:
        print(f"lightning-oomb lm-eval: error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
