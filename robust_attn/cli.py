"""The ``robust-attn`` command. Each subcommand lives in ``robust_attn/commands/<name>.py``
and exposes ``add_parser(subparsers)``, which registers its parser and sets ``func``."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

COMMANDS = ["zoo", "train", "eval", "report", "study", "status", "diff"]


class UserError(Exception):
    """An error caused by the command's input; printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="robust-attn",
        description="Robustness evaluation of attention backbones: SAN's rotation (Table 9) and PGD (Table 10) "
                    "protocols, strong and black-box attacks, distribution shifts, and reports with intervals.",
        epilog="A first try: `robust-attn zoo list`, then `robust-attn eval rotation --model resnet26 --zoo --dataset "
               "fashion_mnist --limit 200 --out runs/rot`. Each command's options: robust-attn COMMAND --help.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"robust_attn.commands.{name}").add_parser(sub)
    return parser


def _warnings_as_lines(command: str):
    """A ``warnings.showwarning`` printing each distinct message once, as ``robust-attn CMD:
    warning: ...`` (no source line: the user did not write that code)."""
    seen: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if text not in seen:
            seen.add(text)
            print(f"robust-attn {command}: warning: {text}", file=file or sys.stderr)

    return show


def _os_message(err: Exception):
    """An ``OSError`` from a path the user gave (``--out`` a file where a folder is written, a folder
    that cannot be written, a full disk) said in one line with what to do; other errors as they are."""
    if not isinstance(err, OSError) or isinstance(err, FileNotFoundError) or err.filename is None:
        return err
    path = err.filename
    if isinstance(err, (FileExistsError, NotADirectoryError)):
        return f"{path}: a file is in the way where a folder is needed; give another path or move the file"
    if isinstance(err, IsADirectoryError):
        return f"{path} is a folder where a file is needed; give a file path"
    if isinstance(err, PermissionError):
        return f"{path}: permission denied; give a path you may write to, or change its permissions"
    return f"{path}: {err.strerror or err}"


def main(argv: list[str] | None = None) -> int:
    from robust_attn.utils.allocator import keep_freed_memory

    keep_freed_memory()   # large tensors are not page-faulted anew each pass (same numbers; see the module)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    previous = warnings.showwarning
    warnings.showwarning = _warnings_as_lines(args.command)
    try:
        code = _run(parser, args, extra)
        sys.stdout.flush()   # a reader gone shows here, where it is caught, not at the interpreter's exit
        return code
    except BrokenPipeError:
        # the reader went away (`robust-attn status DIR | head -3`): no traceback, and the rest of
        # the output goes nowhere, as for any program the pipe's SIGPIPE ends
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 128 + 13   # as a process killed by SIGPIPE reports it
    finally:
        warnings.showwarning = previous


def _run(parser: argparse.ArgumentParser, args, extra: list[str]) -> int:
    if extra:  # argparse leaves KEY=VALUE words given after options unparsed; a command may take them
        if not isinstance(getattr(args, "overrides", None), list):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        raise   # handled by main: the reader went away, not an input error
    except (UserError, KeyError, ValueError, OSError) as err:
        if isinstance(err, KeyError) and not (err.args and isinstance(err.args[0], str) and " " in err.args[0]):
            raise  # a bare missing key ('top1') is a bug, not the input's fault: its traceback says where
        message = err.args[0] if isinstance(err, KeyError) and err.args else _os_message(err)
        print(f"robust-attn {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        from robust_attn.attacks.stopping import StopRequested

        if isinstance(err, StopRequested):
            print(f"robust-attn {args.command}: {err}", file=sys.stderr)
            return 128 + err.signum   # as a process killed by the signal reports it
        resume = ("; what was finished is saved: run the same command again to resume"
                  if args.command in ("eval", "study", "train") else "")
        print(f"robust-attn {args.command}: interrupted (Ctrl-C){resume}", file=sys.stderr)
        return 130   # as a process killed by SIGINT reports it
    except (MemoryError, RuntimeError) as err:
        from robust_attn.utils.memory import out_of_memory_message

        message = out_of_memory_message(err, args)
        if message is None:
            raise
        print(f"robust-attn {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # ``python -m robust_attn.cli`` (torchrun): run the importable module's main, whose UserError is
    # the class the commands raise (this file as __main__ defines a second one)
    from robust_attn.cli import main as _main

    sys.exit(_main())
