"""The one place where an error becomes what the user sees: every `trainer` command runs in `user_errors()`.

A user's mistake or a damaged file is one line on stderr and exit code 2, never a traceback; an
interrupted run exits 130 and says how to resume (SIGTERM and SIGHUP, a scheduler's stop or a closed
terminal, are interruptions too: 128 + the signal's number); a bug in the trainer is one line too, with the
environment variable that shows its traceback.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.text import Text

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
# Set to see the traceback of an unexpected failure (a bug in the trainer, not a user's mistake).
DEBUG_ENV = "TRAINER_DEBUG"


class UsageError(ValueError):
    """A bad command-line argument: the message says which and what is allowed."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: the command stops as it does for Ctrl-C (a run is marked `interrupted`
    and resumes), instead of dying where it stands with run.json still saying `running`."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """While inside: SIGTERM / SIGHUP raise Terminated in the main thread (once; a second signal while the
    first is being handled is ignored, so the run's record is written whole). Elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def handler(signum: int, frame: object) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise Terminated(signum)

    previous = {sig: signal.signal(sig, handler) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# (module, class) of every error whose message is written for the user.
_USER_ERRORS = (
    ("trainer.config", "ConfigError"),
    ("trainer.run.rundir", "RunError"),
    ("trainer.data.datasets", "DataError"),
    ("trainer.target.frozen", "TargetError"),
    ("trainer.eval.speculative", "EvalError"),
    ("trainer.export", "ExportError"),
    ("trainer.safe_io", "UnsafeFileError"),
    ("trainer.eval.foreign", "ForeignDrafterError"),
)


def user_error_types() -> tuple[type[BaseException], ...]:
    """Every user-facing error class among the modules loaded so far: an exception of a module that was
    never imported cannot be raised, and importing it (torch, transformers) would cost seconds per error."""
    types: list[type[BaseException]] = [UsageError]
    for module_name, class_name in _USER_ERRORS:
        module = sys.modules.get(module_name)
        if module is not None:
            types.append(getattr(module, class_name))
    return tuple(types)


def print_error(message: str) -> None:
    """The one writer of an error line. One line whatever the terminal width; the message is plain text,
    never rich markup; and every value in it that came from a file (a config value, a path, a key) is shown
    with its control, bidi and invisible characters escaped, so a shipped config.json cannot send a terminal
    sequence, retitle the window or reverse the line it appears in."""
    from trainer.safe_io import escape_unsafe

    shown = escape_unsafe(one_line(message))
    Console(stderr=True, highlight=False).print(Text("error: ", style="bold red") + Text(shown), soft_wrap=True)


def os_error_message(exc: OSError, resume_hint: str | None = None) -> str:
    where = f" {exc.filename}" if exc.filename else ""
    if exc.errno == errno.ENOSPC:
        then = f", then {resume_hint}" if resume_hint else ""
        return f"disk full writing{where}: what was written before is intact; free space{then}"
    if exc.errno in (errno.EACCES, errno.EPERM):  # reading or writing: the path says which file
        return f"permission denied:{where or ' ' + str(exc.strerror)}"
    if exc.errno == errno.EROFS:
        return f"cannot write{where}: {exc.strerror}"
    return f"{exc.strerror or exc}{':' + where if where else ''}"


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())  # messages are single lines by design; a path with a newline too
    return text or type(exc).__name__


# What a command that was stopped, or ran out of disk, tells the user to do next; each command names its own
# (None: the command keeps nothing to continue from, so rerunning it is the obvious way on).
RUN_RESUME = "continue the run with `trainer run NAME --resume` (the last checkpoint is intact)"
HIDDEN_STATES_RESUME = ("rerun the same `trainer hidden-states generate` command to continue "
                        "(the shards written so far are intact)")
TRAINING_OOM = "lower seq_len or batch_size (or --prompts / --max-new-tokens for eval)"


@contextmanager
def user_errors(resume_hint: str | None = RUN_RESUME, oom_hint: str | None = TRAINING_OOM) -> Iterator[None]:
    """Map every error to one line: exit 2 for anything a user can cause (and, with a hint, for bugs).
    `resume_hint` says how this command goes on after an interruption or a full disk; `oom_hint` what to lower
    when it runs out of memory (None for a command whose memory no setting bounds)."""
    try:
        with stop_signals_interrupt():
            yield
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
        what = f"stopped by {signal.Signals(signum).name}" if isinstance(exc, Terminated) else "interrupted"
        try:  # after SIGHUP the terminal may be gone: the run's record is already written
            print_error(f"{what}: {resume_hint}" if resume_hint else what)
        except OSError:
            pass
        raise typer.Exit(128 + int(signum) if isinstance(exc, Terminated) else EXIT_INTERRUPTED) from None
    except OSError as exc:
        print_error(os_error_message(exc, resume_hint))
        raise typer.Exit(EXIT_USER_ERROR) from None
    except MemoryError:
        print_error(f"out of memory: {oom_hint}" if oom_hint else "out of memory")
        raise typer.Exit(EXIT_USER_ERROR) from None
    except Exception as exc:
        if isinstance(exc, user_error_types()):
            print_error(one_line(exc))
            raise typer.Exit(EXIT_USER_ERROR) from None
        if _is_distributed_failure(exc):
            print_error(distributed_failure_message(exc, resume_hint))
            raise typer.Exit(EXIT_USER_ERROR) from None
        if os.environ.get(DEBUG_ENV):
            raise
        first = one_line(exc)
        print_error(f"internal error ({type(exc).__name__}: {first[:300]}); rerun with {DEBUG_ENV}=1 for the "
                    "traceback and report it")
        raise typer.Exit(EXIT_USER_ERROR) from None


def _is_distributed_failure(exc: BaseException) -> bool:
    """A torch.distributed failure (gloo or NCCL: a peer that died, a rendezvous that failed): not a bug of
    this process, so it is the job's one line, never `internal error` with a C++ stack pasted into it."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    # gloo raises a peer's death in a collective as a plain RuntimeError naming its transport (and the run has
    # left its process group by the time the error gets here): a job of several processes, and that text
    world = os.environ.get("WORLD_SIZE", "1")
    in_a_job = world.isdigit() and int(world) > 1
    return in_a_job and isinstance(exc, RuntimeError) and _COLLECTIVE_FAILURE.search(str(exc)) is not None


_COLLECTIVE_FAILURE = re.compile(r"third_party/gloo|ProcessGroup(Gloo|NCCL)|NCCL error", re.IGNORECASE)


def distributed_failure_message(exc: BaseException, resume_hint: str | None) -> str:
    # torch's message is the C++ error, then "Exception raised from ... frame #0 ..." lines: keep its first
    # line, without the "[../third_party/gloo/...cc:534]" source location in front.
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0][:200]  # its first sentence: the rest is advice
    rank = os.environ.get("RANK")
    who = f"rank {rank}" if rank is not None else "this process"
    then = f"; {resume_hint}" if resume_hint else ""
    return (f"the distributed job failed at {who} ({type(exc).__name__}: {first}): another process of the job "
            f"stopped or cannot be reached; see its own error above{then}")
