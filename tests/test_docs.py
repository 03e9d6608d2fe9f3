"""The docs point at things that exist (issue 21).

Every relative link in README.md and docs/*.md resolves to a file (and a ``#anchor`` to a heading of that
file, by GitHub's slug rules), and every command-line option the docs name in code (``--name``,
``--group.field``) is accepted by one of the project's CLIs, whose parsers are built here without running
anything. The checkers are tested on bad examples too, so a checker that finds nothing cannot pass.
"""
from __future__ import annotations

import argparse
import collections
import functools
import pathlib
import re
from typing import Callable, Dict, Iterable, List, Set
from unittest import mock

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Options of other programs that the docs show in commands, with why they are there.
EXTERNAL_OPTIONS: Dict[str, str] = {
    "--nodes": "sbatch: nodes of the allocation (docs/experiments.md, SLURM)",
    "--ntasks-per-node": "sbatch / srun: tasks per node (docs/experiments.md, SLURM)",
    "--gpus-per-node": "sbatch: GPUs per node (docs/experiments.md, SLURM)",
    "--signal": "sbatch: the requeue signal before the time limit (docs/experiments.md, Preemption)",
    "--logdir": "tensorboard: the log folder to serve",
    "--unshallow": "git fetch: the whole history, for a commit a shallow clone lacks (experiments.repro.retrain)",
}
# Options of the project's commands that read sys.argv by hand (no parser to build), checked against their source.
HAND_PARSED: Dict[str, str] = {"--step0": "experiments/weights.py"}
# Options of a variant that a docs page defines as a worked example (not in the repository): the page must
# define the option's group in its example code.
EXAMPLE_OPTIONS: Dict[str, str] = {"--model.wide.ffn_mult": "docs/adding-a-variant.md"}

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
OPTION = re.compile(r"(?<![\w\-/])--[A-Za-z][\w\-.]*")


# ----------------------------------------------------------------------------------------- markdown
def split_code(text: str) -> tuple[List[str], List[str]]:
    """(prose lines with code spans removed, code texts: fenced blocks and inline spans)."""
    prose, code, block, fenced = [], [], [], False
    for line in text.split("\n"):
        if FENCE.match(line.strip()):
            if fenced:
                code.append("\n".join(block))
                block = []
            fenced = not fenced
            continue
        if fenced:
            block.append(line)
            continue
        code.extend(m.group(2) for m in INLINE_CODE.finditer(line))
        prose.append(INLINE_CODE.sub(lambda m: "\x00" * len(m.group(0)), line))
    return prose, code


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower-cased, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = text.replace("`", "")
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # keeps letters, digits, '_', '-', spaces (unicode aware)
    return text.replace(" ", "-")


def anchors(text: str) -> Set[str]:
    """Every heading anchor of a markdown text; repeated headings get -1, -2, ... as on GitHub."""
    seen: Dict[str, int] = {}
    out = set()
    fenced = False
    for line in text.split("\n"):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: pathlib.Path, text: str | None = None) -> List[str]:
    """One message per relative link of ``path`` whose file or #anchor does not exist."""
    text = path.read_text(encoding="utf-8") if text is None else text
    prose, _ = split_code(text)
    problems = []
    for lineno, line in enumerate(prose, 1):
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{path.name}: link to {target}: {file_part} does not exist")
            elif anchor and dest.suffix == ".md":
                dest_text = text if dest == path else dest.read_text(encoding="utf-8")
                if anchor not in anchors(dest_text):
                    problems.append(f"{path.name}: link to {target}: no heading #{anchor} in {dest.name}")
    return problems


def named_options(text: str) -> Set[str]:
    """Options named in code spans and blocks; ``--optim.*`` and ``--model.<group>`` become prefixes."""
    _, code = split_code(text)
    return {m.group(0) for snippet in code for m in OPTION.finditer(snippet)}


# ----------------------------------------------------------------------------------------- the CLIs
class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__("parser built")
        self.parser = parser


def _capture(build: Callable[[], object]) -> argparse.ArgumentParser:
    """The argparse parser a CLI builds inside its main/parse function, stopped before it parses."""
    def stop(self, *args, **kwargs):
        raise _Built(self)
    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop):
        try:
            build()
        except _Built as built:
            return built.parser
    raise AssertionError(f"{build} built no argparse parser")


def _option_strings(parser: argparse.ArgumentParser) -> Set[str]:
    out: Set[str] = set()
    for action in parser._actions:
        out.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _option_strings(sub)
    return out


def _parsers() -> Dict[str, argparse.ArgumentParser]:
    from experiments import (analyze, bench, bench_data, compare, compiling, device_check, finetune, paper_options,
                             repro, run, sweep, two_phase)
    from experiments.repro import publish, retrain
    return {
        "experiments.run": run.build_parser(),
        "experiments.finetune": finetune.build_parser(),
        "experiments.repro": repro.build_parser(),
        "experiments.analyze": analyze.build_parser(),
        "experiments.compare": compare.build_parser(),
        "experiments.repro.publish": publish.build_parser(),
        "experiments.repro.retrain": retrain.build_parser(),
        "experiments.bench": _capture(lambda: bench.parse_args([])),
        "experiments.bench_data": _capture(lambda: bench_data.parse_args([])),  # experiments.prepare: run's parser
        "experiments.device_check": _capture(lambda: device_check.parse_args([])),
        "experiments.two_phase": _capture(lambda: two_phase.parse([])),
        "experiments.sweep": _capture(lambda: sweep.main([])),
        "experiments.paper_options": _capture(lambda: paper_options.main([])),
        "experiments.compiling": _capture(lambda: compiling.main([])),
    }


@functools.lru_cache(maxsize=None)
def cli_options() -> frozenset:
    from experiments.run import ALIASES
    options = set(ALIASES)  # --variant, --size, --max_steps, ... (experiments.run rewrites them)
    for parser in _parsers().values():
        options |= _option_strings(parser)
    return frozenset(options)


def accepted(option: str, options: Iterable[str]) -> bool:
    options = set(options)
    if option in EXTERNAL_OPTIONS:
        return True
    if option in EXAMPLE_OPTIONS:  # the example must still define the group
        group = option.split(".")[1]
        return f'config_groups = {{"{group}"' in (ROOT / EXAMPLE_OPTIONS[option]).read_text()
    if option in HAND_PARSED:  # the command must still read it
        return f'"{option}"' in (ROOT / HAND_PARSED[option]).read_text()
    phase = re.match(r"^--phase[12]\.(.+)$", option)  # experiments.two_phase passes --phaseN.X on as --X
    if phase:
        rest = phase.group(1)
        return rest == "X" or accepted("--" + rest, options)
    if option.endswith("."):  # a family: --optim.*, --model.<group>.<field>
        return any(o.startswith(option) for o in options)
    return option in options


def unknown_options(text: str, options: Iterable[str]) -> List[str]:
    options = set(options)
    return sorted(o for o in named_options(text) if not accepted(o, options))


def defined_tests() -> Dict[str, Set[str]]:
    """Every test function per tests/ file name (``test_x.py``)."""
    return {f.name: set(re.findall(r"^(?:async )?def (test_\w+)", f.read_text(encoding="utf-8"), re.M))
            for f in (ROOT / "tests").glob("test_*.py")}


NOT_TESTS = {"test_settings", "test_config"}  # registry fields (architectures/registry.py) the docs name


def unknown_tests(text: str, tests: Dict[str, Set[str]]) -> List[str]:
    """Tests named in code spans (`test_x`, `tests/test_f.py::test_x`, a family `test_x_*`) that no tests/ file
    defines (in that file, where it is named): a renamed test leaves the docs citing evidence that is gone."""
    every = set().union(*tests.values())
    missing = []
    for span in re.findall(r"`([^`\n]+)`", text):
        named = re.fullmatch(r"(?:tests/(test_\w+\.py)::)?(test_\w+?)(_?\*)?", span.strip())
        if named is None or named.group(2) in NOT_TESTS or f"{named.group(2)}.py" in tests:
            continue
        file, name, family = named.groups()
        pool = tests.get(file, set()) if file else every
        if not (any(t.startswith(name) for t in pool) if family else name in pool):
            missing.append(span.strip())
    return sorted(set(missing))


def unbacked_record_claims(text: str, base: pathlib.Path) -> List[str]:
    """Links into a results folder in a sentence that says it holds run records (the word "record", no "not",
    "never", "no ... records" or "without") where the folder, relative to ``base``, holds no run's summary.json: a
    page pointing readers at evidence that was never committed (seven sections did, found by an audit)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    sentences = re.split(r"(?<=[.;:])\s+(?=[A-Z(\[*`])|\n\n|\n\* |\n- ", text)
    claims = []
    for sentence in sentences:
        if "record" not in sentence or re.search(r"\bnot\b|\bnever\b|\bno (?:run )?records\b|\bwithout\b", sentence):
            continue
        for link in re.findall(r"\]\(((?:docs/)?results/[^)#]+)\)", sentence):
            folder = base / link
            if not folder.is_dir() and folder.name not in ("results.md", "leaderboard.md"):
                continue  # a plan, a figure: not a report folder
            folder = folder if folder.is_dir() else folder.parent
            if not any(folder.rglob("summary.json")):
                claims.append(link)
    return sorted(set(claims))


#: docs/results.md's tables that are not a report's rows copied as they are, by their header's first cells: why.
#: Every other table there must be copied, row for row, from one report under docs/results.
NOT_COPIED: Dict[str, str] = {
    "| paper claim / question | here | verdict |": "the summary of the sections below",
    "| variant | trainer.max_steps | val_every |": "the probe-v2 pilot: no folder (its runs predate publish)",
    "| code | how | `mod` L3 |": "the kernel investigation: one figure per run, from several summaries",
    "| entry | steps | val loss [95% CI] |": "the bounce tables: columns chosen from probe_bounce's report",
    "| entry | FLOPs L0 | L1 |": "the bounce grading: columns chosen from probe_bounce's report",
    "| entry (Intel Xeon) | steps | val loss [95% CI] |": "probe_bounce_narrow: columns chosen from its report",
    "| budget | variant | d |": "the old single-seed isoFLOP grid at 49c8c61: no folder (before publish)",
    "| budget | 2 x 4 | 2 x 8 |": "isoflop_pilot's losses as a budget x shape grid",
    "| model | params | val loss |": "the one-seed contribution table: no folder (before publish)",
    "| entry | decision | FLOPs L0 |": "probe_depth: columns chosen from its report",
}
SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")


def markdown_tables(text: str) -> List[tuple[int, List[str]]]:
    """(line number, lines) of each table in ``text``: a header line followed by a separator, then its rows."""
    lines = text.splitlines()
    tables = []
    i = 0
    while i < len(lines) - 1:
        if lines[i].startswith("|") and SEPARATOR.match(lines[i + 1]):
            end = i + 2
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            tables.append((i + 1, lines[i:end]))
            i = end
        else:
            i += 1
    return tables


def table_key(header: str) -> str:
    """A table's header up to its third cell: the key ``NOT_COPIED`` names it by."""
    return "| " + " | ".join(cell.strip() for cell in header.strip().strip("|").split("|")[:3]) + " |"


def uncopied_tables(text: str, reports: Dict[pathlib.Path, Set[str]], not_copied: Dict[str, str]) -> List[str]:
    """The tables of ``text`` that no one report (``reports``: each results/leaderboard page's set of lines) holds
    row for row, header included, and that ``not_copied`` does not name: a copied cell edited by hand, or a table
    typed rather than copied."""
    wrong = []
    for line, table in markdown_tables(text):
        if table_key(table[0]) in not_copied:
            continue
        if not any(all(row.rstrip() in held for row in table) for held in reports.values()):
            wrong.append(f"line {line}: {table[0][:80]}")
    return wrong


def published_reports(results: pathlib.Path) -> Dict[pathlib.Path, Set[str]]:
    """Each report page under ``results`` (run records' folders left out): its lines, right-stripped."""
    return {page: {line.rstrip() for line in page.read_text(encoding="utf-8").splitlines()}
            for page in results.rglob("*.md") if "runs" not in page.relative_to(results).parts}


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_says_a_results_folder_holds_run_records_it_does_not(path):
    assert unbacked_record_claims(path.read_text(encoding="utf-8"), path.parent) == []


def test_the_record_checker_finds_a_claim_without_records(tmp_path):
    (tmp_path / "results" / "kept" / "runs" / "a").mkdir(parents=True)
    (tmp_path / "results" / "kept" / "runs" / "a" / "summary.json").write_text("{}")
    (tmp_path / "results" / "bare").mkdir()
    text = ("Run records: [k](results/kept/). Report and run records in [b](results/bare/).\n\n"
            "The report is in [b](results/bare/) (run records not published). A table: [b](results/bare/x.md).")
    assert unbacked_record_claims(text, tmp_path) == ["results/bare/"]


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_test_the_docs_name_exists(path):
    assert unknown_tests(path.read_text(encoding="utf-8"), defined_tests()) == []


def test_the_test_checker_finds_renamed_tests():
    tests = {"test_a.py": {"test_one", "test_two_ways"}, "test_b.py": {"test_three"}}
    text = ("`test_one`, `tests/test_a.py::test_two_ways`, `test_two_*`, `test_a.py`, `test_settings`,\n"
            "`test_gone`, `tests/test_b.py::test_one`, `test_nine_*`, `not a test_one`")
    assert unknown_tests(text, tests) == ["test_gone", "test_nine_*", "tests/test_b.py::test_one"]


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_option_named_in_the_docs_is_accepted_by_a_cli(path):
    assert unknown_options(path.read_text(encoding="utf-8"), cli_options()) == []


def test_the_parsers_are_the_real_ones():
    """A capture that caught the wrong parser (or none) would make every option unknown or every one known."""
    options = cli_options()
    for expected in ("--model.mod.capacity", "--trainer.devices", "--task", "--variants", "--dry_run",
                     "--phase2_recipe", "--budget_s", "--group_by", "--no_reuse", "--recompile_steps"):
        assert expected in options, expected
    assert "--no_such_option" not in options


def test_github_slugs():
    assert github_slug("Paper / official code vs our default") == "paper--official-code-vs-our-default"
    assert github_slug("`--compile`") == "--compile"
    assert github_slug("Initialising from a vanilla model (`--init_from`)") == "initialising-from-a-vanilla-model---init_from"
    assert github_slug("Leaderboard: experiments.compare") == "leaderboard-experimentscompare"
    assert github_slug("`mom` (seed 000 and the official code gzhch/Mixture-of-Modules)") == \
        "mom-seed-000-and-the-official-code-gzhchmixture-of-modules"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## B") == {"a", "a-1", "b"}


def test_the_link_checker_finds_bad_links(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Known heading\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md) [ok anchor](other.md#known-heading) [own](#page) [web](https://example.com/x.md)\n"
        "[missing file](nowhere.md) [missing anchor](other.md#unknown-heading) [own missing](#nope)\n"
        "`[in code](ignored.md)`\n```\n[in a block](ignored.md)\n```\n", encoding="utf-8")
    problems = broken_links(page)
    assert len(problems) == 3, problems
    assert any("nowhere.md does not exist" in p for p in problems)
    assert any("#unknown-heading" in p for p in problems)
    assert any("#nope" in p for p in problems)


def test_the_option_checker_finds_unknown_options():
    options = {"--variant", "--model.mod.capacity", "--optim.lr", "--lr"}
    text = ("Use `--variant mod --model.mod.capacity 0.25` and `--optim.*` or `--model.<group>.<field>`.\n"
            "```bash\npython -m experiments.run --variant mod --model.mod.capcity 0.25 --phase2.lr 1 --phase1.X\n"
            "sbatch --nodes=2 x\n```\n"
            "Prose --not_in_code is not a named option; `--trainer.*` is a family nobody has.\n")
    assert named_options(text) >= {"--variant", "--model.mod.capacity", "--optim.", "--model.", "--nodes"}
    assert "--not_in_code" not in named_options(text)
    assert unknown_options(text, options) == ["--model.mod.capcity", "--trainer."]
    assert unknown_options("`--phase1.no_such 3`", options) == ["--phase1.no_such"]


def test_readme_is_a_front_door_with_the_two_commands():
    """Issue 21: at most ~300 lines; the two commands (main job, tests) stay in README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    _, code = split_code(text.split("## The two commands", 1)[1].split("\n## ", 1)[0])
    setup = 'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[dev]"'
    commands = [c for c in code if c.startswith("python3 -m venv")]
    assert commands == [f"{setup} && python -m experiments.run", f"{setup} && python -m pytest -q -n auto tests"]


def test_every_results_table_is_copied_from_its_report_row_for_row():
    """docs/results.md's tables are the tools' output: each is held row for row by one report page under
    docs/results, but for the ones ``NOT_COPIED`` names (reformatted or older than publish), each still present."""
    text = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert uncopied_tables(text, published_reports(ROOT / "docs" / "results"), NOT_COPIED) == []
    keys = collections.Counter(table_key(table[0]) for _, table in markdown_tables(text))
    assert all(keys[key] == 1 for key in NOT_COPIED)  # each excuses one table; one whose table is gone goes too
    assert sum(keys.values()) >= 40  # 42 tables when this was written


def test_the_table_checker_finds_an_edited_cell_and_a_typed_table(tmp_path):
    page = tmp_path / "results" / "a" / "results.md"
    page.parent.mkdir(parents=True)
    page.write_text("# A\n\n| entry | loss |\n|---|---|\n| mod | 0.9425 |\n| vanilla | 0.9471 |\n")
    reports = published_reports(tmp_path / "results")
    copied = "Text.\n\n| entry | loss |\n|---|---|\n| mod | 0.9425 |\n\nMore |s - x| text.\n"
    assert uncopied_tables(copied, reports, {}) == []
    edited = copied.replace("0.9425", "0.9420")
    assert uncopied_tables(edited, reports, {}) == ["line 3: | entry | loss |"]
    assert uncopied_tables(edited, reports, {"| entry | loss |": "reformatted"}) == []
    split = "| entry | loss |\n|---|---|\n| mod | 0.9425 |\n| vanilla | 0.9471 |\n"
    other = tmp_path / "results" / "b" / "results.md"
    other.parent.mkdir()
    other.write_text("| entry | loss |\n|---|---|\n| vanilla | 0.9471 |\n")
    page.write_text("| entry | loss |\n|---|---|\n| mod | 0.9425 |\n")  # rows from two reports: not one's copy
    assert uncopied_tables(split, published_reports(tmp_path / "results"), {}) == ["line 1: | entry | loss |"]
