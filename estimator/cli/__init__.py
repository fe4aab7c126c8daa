"""The ``fxmem`` command line (also ``python -m estimator``).

    fxmem report gpt --size gpt2-small --batch 8
    fxmem formula resnet --format latex
    fxmem fit llama --size 7b --budget 80GiB --json
    fxmem report mlp --step my_step.py:train_step

Exit codes: 0 success, 2 bad arguments or input, 3 the model could not be captured,
130 interrupted (Ctrl-C).

The package: ``options`` (the shared options and their parsing), ``commands`` (the click group
and its commands), ``models`` (what the MODEL argument names); here, the entry point.

Torch is imported inside the commands only: ``fxmem --help`` stays fast.
"""

from __future__ import annotations

import gc
import signal
import sys
import threading

import click

from estimator.capture import watchdog
from estimator.cli.commands import EXIT_CAPTURE, EXIT_INTERRUPTED, EXIT_OK, INTERRUPTED, cli
from estimator.progress_bars import progress
from estimator.vocab import bookkeeping

__all__ = ["cli", "entry", "main"]


def _on_sigint(signum, frame):
    INTERRUPTED.set()
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """The console-script entry: returns the exit code."""
    INTERRUPTED.clear()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _on_sigint) if main_thread else None
    try:
        with progress(show=None):  # bars for long work where standard error is a terminal
            result = cli.main(args=argv, prog_name="fxmem", standalone_mode=False)
    except click.exceptions.Exit as exc:  # raised inside commands (standalone_mode=False passes it)
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("fxmem: interrupted", err=True)
        return EXIT_INTERRUPTED
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return result if isinstance(result, int) else EXIT_OK


_CAPTURING = ("report", "formula", "fit", "compare", "plan")  # the commands that capture a step


def entry() -> None:
    """The ``fxmem`` program (console script and ``python -m estimator``): ``main``, then exit.

    The objects that importing torch makes (millions, alive until the end) are kept out of the
    garbage collector's passes: for the commands that capture, imported with the collector
    paused, then frozen (``gc.freeze``); everything is frozen again before exiting, where the
    interpreter's last collection would walk them only for the process to end: about 1.3 s of
    ``fxmem report mlp --batch 8`` (3.7-4.0 s before, 2.3-2.6 s after, with the zoo's models
    imported on first use; docs/benchmark.md).  The capture itself runs with the collector as it
    is (its thresholds decide when cyclic garbage is freed) and leaves what it froze frozen
    (``bookkeeping.keep_frozen``)."""
    if sys.argv[1:2] and sys.argv[1] in _CAPTURING and not {"-h", "--help"} & set(sys.argv[2:]):
        watchdog.guard_process(EXIT_CAPTURE)  # a capture stuck in C++ ends with exit 3, not never
        gc.disable()
        try:
            _import_capture_stack()
        except KeyboardInterrupt:  # Ctrl-C while torch imports
            sys.exit(EXIT_INTERRUPTED)
        finally:
            gc.freeze()
            bookkeeping.keep_frozen()
            gc.enable()
    code = main()
    gc.freeze()
    sys.exit(code)


def _import_capture_stack() -> None:
    """The modules every capture imports: the estimator, torch, Dynamo (``FakeTensorMode``
    imports ``torch._dynamo.config``) and ``torch.export._trace`` (a ``ShapeEnv`` imports it to
    name the files its symbols' source locations skip, ``symbolic_shapes.uninteresting_files``)."""
    import torch._dynamo  # noqa: F401
    import torch.export._trace  # noqa: F401

    import estimator.api  # noqa: F401
