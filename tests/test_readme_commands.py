"""Every ``robust-attn`` command the README shows parses as that command line would (its
subcommand and flags exist; words left over are recipe overrides only where the command takes
them), the repository files and zoo models it names exist, and its recipe overrides load.

A renamed flag or moved file otherwise leaves the README's commands failing for the first user
who pastes one into a fresh shell. Nothing is run: the commands' own tests run them."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from robust_attn.cli import COMMANDS, build_parser
from robust_attn.models.manifest import Manifest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the first word of a command as the README writes it
LAUNCHERS = re.compile(r"^(?:\S+=\S+\s+)*(?:time\s+)?(?:\.venv/bin/robust-attn|robust-attn"
                       r"|torchrun\s+(?:--\S+\s+)*-m\s+robust_attn\.cli)\s")
# arguments that name a file of this repository
REPO_PATH = re.compile(r"^(zoo|protocols|reports|benchmarks|robust_attn)/[^*]*$")


def readme_commands(text: str) -> list[str]:
    """The commands of the README's code blocks (a backslash continues a line; ``#`` starts a
    comment) and of its inline code spans (which may wrap across lines), one string each, from
    the subcommand on."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            found.append(line.split(" #")[0].strip())
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    commands = [LAUNCHERS.sub("", c + " ", count=1).strip() for c in found if LAUNCHERS.match(c + " ")]
    return [c for c in commands if c]   # not the tool's bare name


COMMAND_LINES = readme_commands(README.read_text())


def test_the_readme_shows_commands_of_every_kind():
    """The extraction finds them: study, eval, train, report, status and zoo lines, and the
    benchmarks' commands."""
    assert len(COMMAND_LINES) >= 40
    assert {c.split()[0] for c in COMMAND_LINES} - {"..."} == set(COMMANDS)
    assert any(c.startswith("train ") and "model=" in c for c in COMMAND_LINES)
    assert len(readme_benchmark_commands(README.read_text())) >= 8


def _raising_parser():
    """The CLI's parser, its subcommands' and eval's protocols', with errors collected, not exits."""
    parser, errors = build_parser(), []
    stack = [parser]
    while stack:
        p = stack.pop()
        p.error = errors.append
        if p._subparsers is not None:
            stack += p._subparsers._group_actions[0].choices.values()
    return parser, errors


def _subcommands(parser, words: list[str]) -> list[str]:
    """The subcommand words of ``words`` the parser knows, from the first (``eval pgd``, ``zoo list``)."""
    known, p = [], parser
    for word in words:
        if p._subparsers is None or word not in p._subparsers._group_actions[0].choices:
            break
        known.append(word)
        p = p._subparsers._group_actions[0].choices[word]
    return known


@pytest.mark.parametrize("line", COMMAND_LINES)
def test_each_readme_command_parses_and_names_files_that_exist(line):
    words = shlex.split(line)
    parser, errors = _raising_parser()
    if "..." in words or not any(w.startswith("-") or "/" in w or "=" in w for w in words[1:]):
        # a command named in prose (`robust-attn zoo import`, `robust-attn report ... --partial`):
        # its subcommands exist
        plain = [w for w in words if w != "..." and not w.startswith("-")]
        if not plain:   # `torchrun ... -m robust_attn.cli ...`: any command
            return
        known = _subcommands(parser, plain)
        assert known and known[0] == plain[0], line
        takes_action = parser._subparsers._group_actions[0].choices[known[0]]._subparsers is not None
        assert not takes_action or len(plain) == 1 or len(known) == 2, line   # `zoo import`: an action of zoo
        return
    args, extra = parser.parse_known_args(words)
    assert not errors, f"{line}: {errors}"
    if extra:
        assert isinstance(getattr(args, "overrides", None), list), f"{line}: unrecognized {extra}"
        assert all("=" in w for w in extra), f"{line}: unrecognized {extra}"
    for word in words:
        if REPO_PATH.match(word) and word.endswith((".toml", ".py", ".md", ".json")):
            assert (ROOT / word).is_file(), f"{line}: no file {word} in the repository"
    zoo_names = list(getattr(args, "source", None) or []) + list(getattr(args, "target", None) or [])
    zoo_names += [args.model] if getattr(args, "zoo", False) else []
    zoo_names += [m for m in (getattr(args, "models", None) or "").split(",") if m and not m.isupper()]
    if zoo_names:   # the zoo has each model the command names, trained on its dataset
        shipped = {(e.name, e.dataset) for e in Manifest().entries.values()}
        for name in zoo_names:
            assert (name, args.dataset) in shipped, f"{line}: no zoo {name} for {args.dataset}"
    if args.command == "train":
        from robust_attn.train.recipe import load_recipe

        load_recipe(ROOT / args.recipe, list(args.overrides) + list(extra), check_data=False)


def readme_benchmark_commands(text: str) -> list[str]:
    """The README's ``python benchmarks/NAME.py ...`` commands (inline spans, wrapped or not)."""
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))]
    return [re.sub(r"^(?:\S+=\S+\s+)*python\s+", "", s) for s in spans
            if re.match(r"^(?:\S+=\S+\s+)*python benchmarks/", s)]


BENCHMARK_LINES = readme_benchmark_commands(README.read_text())


@pytest.mark.parametrize("line", BENCHMARK_LINES)
def test_each_readme_benchmark_command_names_a_script_and_flags_it_has(line):
    """The script exists and defines each flag the command gives (in its own parser or in
    ``benchmarks/_measure.py``'s, which the layer benchmarks share)."""
    script, *words = shlex.split(line)
    assert (ROOT / script).is_file(), f"{line}: no {script}"
    source = (ROOT / script).read_text()
    if "from _measure import" in source:
        source += (ROOT / "benchmarks" / "_measure.py").read_text()
    for flag in (w.split("=")[0] for w in words if w.startswith("--")):
        assert f'"{flag}"' in source, f"{line}: {script} has no {flag}"
