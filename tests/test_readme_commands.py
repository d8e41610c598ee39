"""Every ``robust-attn`` command the README and the docs show (``docs/``, ``zoo/README.md``,
``benchmarks/README.md``, the reports' READMEs) parses as that command line would (its
subcommand and flags exist; words left over are recipe overrides only where the command takes
them), the repository files and zoo models it names exist, and its recipe overrides load; none
writes into a tracked folder unless the docs say it regenerates a committed report; and the
README's shell blocks, run as pasted in the repository, leave ``git status`` as it was.

A renamed flag or moved file otherwise leaves the docs' commands failing for the first user
who pastes one into a fresh shell."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from robust_attn.cli import COMMANDS, build_parser
from robust_attn.models.manifest import Manifest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


# docs/extending.md shows the commands of the plugins its reader is about to write (`eval grayscale`,
# `study --protocols fgsm`): they do not exist until then, and its own tests run its examples
NOT_YET = {"extending.md"}


def doc_files() -> list[Path]:
    """The README and the Markdown files it sends a reader to (a report's packed runs excluded)."""
    found = [README, ROOT / "zoo" / "README.md", ROOT / "benchmarks" / "README.md"]
    found += sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in NOT_YET)
    found += [p for p in sorted((ROOT / "reports").rglob("README.md")) if "runs" not in p.relative_to(ROOT).parts]
    return [p for p in found if p.is_file()]


DOCS = doc_files()
DOCS_TEXT = "\n".join(p.read_text() for p in DOCS)
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


COMMAND_LINES = sorted(set(readme_commands(DOCS_TEXT)))


def test_the_docs_show_commands_of_every_kind():
    """The extraction finds them: study, eval, train, report, status and zoo lines, and the
    benchmarks' commands; the README itself shows eval, report, study, status and zoo."""
    assert len(COMMAND_LINES) >= 40
    assert {c.split()[0] for c in COMMAND_LINES} - {"..."} == set(COMMANDS)
    assert any(c.startswith("train ") and "model=" in c for c in COMMAND_LINES)
    assert len(readme_benchmark_commands(DOCS_TEXT)) >= 8
    assert {c.split()[0] for c in readme_commands(README.read_text())} >= {"eval", "report", "study", "status", "zoo"}


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


BENCHMARK_LINES = sorted(set(readme_benchmark_commands(DOCS_TEXT)))


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


# the line that marks a code block whose commands write into tracked files on purpose
REGENERATES = "<!-- writes tracked files: regenerates a committed report -->"
TRACKED = ("reports/", "zoo/", "benchmarks/", "protocols/", "robust_attn/", "docs/", "tests/")


def written_folders(words: list[str]) -> list[str]:
    """The folders a ``robust-attn`` command writes (``--out``, ``--runs``, ``--cache``), and for a
    study without ``--out``, its default report folder."""
    out = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--out", "--runs", "--cache")]
    out += [w.split("=", 1)[1] for w in words if w.startswith(("--out=", "--runs="))]
    if words and words[0] == "study" and "--out" not in words:
        args = build_parser().parse_known_args(words)[0]
        name = Path(args.config).stem if args.config else args.dataset
        out.append(f"runs/study-{name}-report")
    return out


def doc_command_blocks() -> list[tuple[Path, str, bool]]:
    """``(file, command, marked)``: each ``robust-attn`` command of a doc file, with whether its
    code block is marked as regenerating a committed report."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"(<!--[^\n]*-->\n)?```[a-z]*\n(.*?)```", text, flags=re.S):
            marked = (m.group(1) or "").strip() == REGENERATES
            for line in m.group(2).replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if LAUNCHERS.match(line + " "):
                    found.append((path, LAUNCHERS.sub("", line + " ", count=1).strip(), marked))
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for span in re.findall(r"`([^`]+)`", prose):
            line = " ".join(span.split())
            if LAUNCHERS.match(line + " "):
                found.append((path, LAUNCHERS.sub("", line + " ", count=1).strip(), False))
    return found


def test_no_doc_command_writes_a_tracked_file_unless_marked():
    """Outputs go to runs/ or a folder the user names; a command writing under a tracked folder
    is one that regenerates a committed report: in a code block marked so, or in a report
    folder's README naming that very folder (the command that made it)."""
    wrong = []
    for path, command, marked in doc_command_blocks():
        words = shlex.split(command)
        if "..." in words:
            continue
        for folder in written_folders(words):
            if not folder.startswith(TRACKED):
                continue
            own = path.parent.relative_to(ROOT).as_posix()
            if marked or (own.startswith("reports/") and folder.rstrip("/") == own):
                continue
            wrong.append(f"{path.relative_to(ROOT)}: {command} writes {folder}")
    assert not wrong, "\n".join(wrong)


def test_the_study_report_goes_to_runs_by_default():
    """``robust-attn study`` without ``--out`` writes no tracked folder (the README's study)."""
    assert written_folders(["study", "--dataset", "cifar10"]) == ["runs/study-cifar10-report"]
    assert written_folders(["study", "zoo/studies/imagenet.toml"]) == ["runs/study-imagenet-report"]


def _git_status() -> str | None:
    import subprocess

    try:
        done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def run_in_repo(scripts: list[str]) -> None:
    """Run each bash script as pasted in the repository, with this interpreter's ``robust-attn``
    first on PATH (as the install has it); each must succeed and ``git status`` must stay as it
    was. The runs/ entries they make are removed afterwards."""
    import os
    import shutil
    import subprocess
    import sys

    before = _git_status()
    runs_before = set(os.listdir(ROOT / "runs")) if (ROOT / "runs").is_dir() else None
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1"}
    try:
        for script in scripts:
            done = subprocess.run(["bash", "-e", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=1800)
            assert done.returncode == 0, f"{script}\n{done.stderr[-3000:]}"
        if before is not None:
            assert _git_status() == before, "the commands changed what git sees"
    finally:
        if runs_before is None:
            shutil.rmtree(ROOT / "runs", ignore_errors=True)
        else:
            for name in set(os.listdir(ROOT / "runs")) - runs_before:
                target = ROOT / "runs" / name
                shutil.rmtree(target) if target.is_dir() else target.unlink()


def readme_shell_blocks() -> list[str]:
    """The README's bash blocks after the install (which makes ``.venv``)."""
    return [b for b in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S) if "python3 -m venv" not in b]


@pytest.mark.slow
def test_the_readme_shell_blocks_leave_git_status_clean():
    """Run as pasted in the repository (this interpreter's ``robust-attn`` first on PATH, as the
    install has it), the README's commands change nothing git tracks or sees: their outputs go
    to the ignored runs/. The run folders they make that were not there before are removed."""
    if _git_status() is None:
        pytest.skip("not a git checkout")
    run_in_repo(readme_shell_blocks())


# placeholders a command may hold; "DIR" (a folder the user names) becomes a runs/ folder, a
# command with any other one is an example of a form, not one to paste
PLACEHOLDERS = re.compile(r"\b(RUNS_DIR|RUN_A|RUN_B|OUT|PATH|DATA|CONFIG|REPORT|M|A|B|NAME|SPEC)\b|\.\.\.|/data/")
RUNNABLE = ("eval ", "report ", "status ", "diff ", "zoo list", "zoo verify", "study --dataset")


def runnable_doc_commands(path: Path) -> list[str]:
    """The commands of a doc file's code blocks that run on what the repository ships (the
    embedded test sets, the zoo, the committed runs), in order, shrunk: ``--limit`` at most 8,
    ``DIR`` a runs/ folder; none of a block that trains first or regenerates a committed report."""
    commands = []
    for m in re.finditer(r"(<!--[^\n]*-->\n)?```bash\n(.*?)```", path.read_text(), flags=re.S):
        block = m.group(2)
        if m.group(1) or " train " in f" {block}" or "pip install" in block:
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if not LAUNCHERS.match(line + " "):
                continue
            command = LAUNCHERS.sub("", line + " ", count=1).strip()
            command = re.sub(r"\bDIR\b", "runs/doc-check-report", command)
            if PLACEHOLDERS.search(command) or not command.startswith(RUNNABLE):
                continue
            command = re.sub(r"--limit \d+", "--limit 8", command)
            if command.startswith("study") and "--limit" not in command:
                continue   # a whole study is no test
            commands.append(command)
    return commands


DOC_FILES_TO_RUN = [p for p in DOCS if p != README and runnable_doc_commands(p)]


@pytest.mark.slow
@pytest.mark.parametrize("path", DOC_FILES_TO_RUN, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES_TO_RUN])
def test_each_doc_command_runs_shrunk(path):
    """The docs' commands run as written, on at most 8 images, in the repository (their outputs
    go to runs/, the folders they make removed after); git status stays as it was."""
    run_in_repo([f"robust-attn {command}" for command in runnable_doc_commands(path)])
