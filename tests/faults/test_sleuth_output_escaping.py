"""Strings from a run or from code reach every sink escaped: terminal, report.md, fix.yaml, JSON (issue 22: F7, F8, F14).

A run directory is hostile data even when no code runs: its run.json name, a checkpoint directory's name, a
config value and a probe's answer can hold terminal escapes (CSI, OSC, C1), bidi overrides, invisible format
characters, newlines followed by a line that imitates sleuth's summary, markdown and HTML. Cases are generated:
one representative of every Unicode general category, the code points an outside campaign found kept
(U+061C, U+200B, U+FEFF, U+00AD, U+2028), markdown metacharacters, HTML, a 5000-character string. sleuth runs as a
real process with pipes for stdout/stderr (as CI and `| less` see it), and each output is checked with an
independent reader: a strict JSON parser, yaml.safe_load, and markdown-it (CommonMark + tables) for report.md.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import yaml
from sleuth_helpers import write_run

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

UNSAFE_CATEGORIES = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}
INVISIBLE_LETTERS = "\u034f\u115f\u1160\u17b4\u17b5\u3164\uffa0"
SUMMARY = "sleuth diagnose v5: 0 mismatch(es), 0 unknown, 22 match"


def category_representatives() -> str:
    """The first code point of every Unicode general category (NUL for Cc, U+0378 for Cn, ...)."""
    first: dict[str, str] = {}
    for code in range(0x110000):
        first.setdefault(unicodedata.category(chr(code)), chr(code))
    assert len(first) == 30, sorted(first)
    return "".join(first[category] for category in sorted(first))


HOSTILE = (
    "v5\x1b[1G\x1b[2K\x1b[32m" + SUMMARY + "\x1b[0m\x1b[8m\u202e"  # erase the line, redraw a clean one, conceal
    "\x1b]0;title\x1b\\\x1b]8;;http://x.test/\x07link\x1b]8;;\x07\x9b2J\x85"  # OSC title, OSC 8 link, C1 CSI, NEL
    "\u061c\u200b\ufeff\u00ad\u2028\u2066\u2069" + INVISIBLE_LETTERS + category_representatives()
    + "\n\n" + SUMMARY + "\n## All invariants match <img src=x onerror=alert(1)> [fix](javascript:alert(1))"
    " ![i](http://x.test/i.png) <script>alert(1)</script> &lt;b&gt; | forged | cell |\n> quote\n- item\n1. one\n"
    "```\nfence\n``` `code` **bold** _em_ $x$ ~~gone~~ [^1] <http://x.test> \\\\ \\`\n# heading\n"
    + "L" * 5000
)
NEIGHBOUR_MARK = "neighbour\x1b[2J"
BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # every line break str.splitlines() knows


def is_unsafe(ch: str) -> bool:
    return unicodedata.category(ch) in UNSAFE_CATEGORIES or ch in INVISIBLE_LETTERS


def naive_terminal(text: str) -> str:
    """What the terminal escaping must produce, written out independently: each unsafe code point as
    \\xNN / \\uNNNN / \\UNNNNNNNN (a lone surrogate DC80-DCFF, a non-UTF-8 name's byte, as that byte)."""
    out = []
    for ch in text:
        code = ord(ch)
        if not is_unsafe(ch):
            out.append(ch)
        elif 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        else:
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def env(tmp_path: Path) -> dict[str, str]:
    environment = dict(os.environ)
    environment.update({
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]), "SLEUTH_CACHE_DIR": str(tmp_path / "cache"),
        "SLEUTH_CONFIG_FILE": str(tmp_path / "no-config.yaml"), "HOME": str(tmp_path / "home"),
        "OMP_NUM_THREADS": "1", "COLUMNS": "80", "PYTHONDONTWRITEBYTECODE": "1",
    })
    for name in ("SLEUTH_DEBUG", "SLEUTH_SPECULATORS_PATH", "GITHUB_TOKEN", "NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE"):
        environment.pop(name, None)
    return environment


def rename(run: Path, name: str) -> None:
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "name": name}))


def diagnose(run: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "sleuth.cli", "diagnose", "--run", str(run), "--offline",
                           "--no-probe", "--out", str(out)], env=env(tmp_path), cwd=tmp_path, capture_output=True,
                          text=True, encoding="utf-8", timeout=180)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr[-2000:]
    return done, out


def strict_json(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")
    return json.loads(text, parse_constant=refuse)


def assert_terminal_safe(stream: str, where: str) -> None:
    for number, line in enumerate(stream.split("\n"), start=1):
        bad = sorted({f"U+{ord(ch):04X}" for ch in line if is_unsafe(ch)})
        assert not bad, f"{where} line {number} holds {bad}: {line[:200]!r}"


MD_HEADINGS = {"h2": {"Summary", "Regression", "Findings, ranked by expected impact", "Probes", "Reference", "Inputs",
                      "Trace"}}


def assert_markdown_inert(text: str) -> None:
    """report.md read by markdown-it: only sleuth's own structure (its headings, lists, tables); nothing a
    value could create (HTML, links, images, quotes, code blocks, other headings)."""
    from markdown_it import MarkdownIt

    assert_terminal_safe(text, "report.md")
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    flat = [child for token in tokens for child in [token, *(token.children or [])]]
    images = [t for t in flat if t.type == "image"]
    assert all(t.attrs.get("src") == "chart.png" for t in images), [t.attrs for t in images]  # sleuth's own chart
    created = sorted({t.type for t in flat} & {"html_inline", "html_block", "link_open", "blockquote_open", "fence",
                                               "code_block", "hr"})
    assert not created, f"report.md has {created}"
    headings = [(t.tag, tokens[i + 1].content) for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert [tag for tag, _ in headings].count("h1") == 1, headings
    for tag, content in headings:
        assert tag in ("h1", "h2", "h3"), (tag, content)
        if tag == "h2":
            assert content in MD_HEADINGS["h2"], content
        if tag == "h3":
            assert content.split(". ", 1)[0].isdigit(), content
    # every row of a table has as many cell separators as its header: no value split a cell or started a row
    table: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            widths = {len(re.findall(r"(?<!\\)\|", row)) for row in table}
            assert len(widths) == 1, table
        table = []


@pytest.mark.parametrize("whose", ["hostile run", "hostile neighbour"])
def test_names_from_runs_are_escaped_in_every_sink(tmp_path: Path, whose: str) -> None:
    """The hostile run's own diagnosis, and the diagnosis of the user's run with the hostile one beside it
    (its name reaches the regression line). On main: raw ESC on stdout (the line erased and redrawn as
    "0 mismatch(es)"), a real `## All invariants match` heading and <img> tag in report.md, an unparseable fix.yaml."""
    runs = tmp_path / "runs"
    mine = write_run(runs, "mine", created="2026-11-02T10:00:00+00:00")
    neighbour = write_run(runs, "other", created="2026-10-01T10:00:00+00:00")
    if whose == "hostile run":
        rename(mine, HOSTILE)
        # a checkpoint directory named with escapes and a newline (no `latest`: sleuth says which it used)
        (mine / "checkpoints" / "latest").unlink()
        (mine / "checkpoints" / "step-300").rename(mine / "checkpoints" / f"step-300\x1b[2J\n{SUMMARY}\u202e")
        config = json.loads((mine / "config.json").read_text())
        (mine / "config.json").write_text(json.dumps({**config, "target_layer_ids": HOSTILE[:400]}))
    rename(neighbour, NEIGHBOUR_MARK + HOSTILE)
    done, out = diagnose(mine, tmp_path)

    for stream, where in ((done.stdout, "stdout"), (done.stderr, "stderr")):
        assert_terminal_safe(stream, where)
    summary_lines = [line for line in done.stdout.splitlines() if line.startswith("sleuth diagnose")]
    assert len(summary_lines) == 1 and not summary_lines[0].startswith(SUMMARY), done.stdout
    assert not any(line.lstrip().startswith(SUMMARY) for line in done.stdout.splitlines()), done.stdout
    regression = [line for line in done.stdout.splitlines() if line.startswith("regression:")]
    assert len(regression) == 1 and naive_terminal(NEIGHBOUR_MARK) in regression[0], done.stdout

    report = strict_json((out / "report.json").read_text(encoding="utf-8"))
    # the data itself, unchanged (but a lone surrogate, which no UTF-8 file can hold: spelled \\ud800 as ever)
    assert report["run"]["name"] == (HOSTILE.replace("\ud800", "\\ud800") if whose == "hostile run" else "mine")
    strict_json((out / "report.sarif").read_text(encoding="utf-8"))
    for line in (out / "trace.jsonl").read_text(encoding="utf-8").splitlines():
        strict_json(line)
    for name in ("report.json", "report.sarif", "trace.jsonl"):
        assert_terminal_safe((out / name).read_text(encoding="utf-8"), name)

    assert_markdown_inert((out / "report.md").read_text(encoding="utf-8"))

    fix_text = (out / "fix.yaml").read_text(encoding="utf-8")
    assert_terminal_safe(fix_text, "fix.yaml")
    fix = yaml.safe_load(fix_text)
    # one line per top-level value (a long name is not folded onto lines of its own), comments only sleuth's
    top = [line.split(":", 1)[0] for line in fix_text.splitlines() if line and not line[0].isspace()
           and not line.startswith("#")]
    assert top == list(fix), top
    assert all(line.startswith("# sleuth diagnosis of") or line.startswith("# mismatches") or
               line.startswith("# needs a code change") for line in fix_text.splitlines() if line.startswith("#"))
    assert set(fix) == {"diagnosed_run", "diagnosed_run_path", "diagnosed_config_sha256", "report", "config_patch",
                        "code_changes"}, fix
    assert fix["diagnosed_run"] == naive_terminal(HOSTILE if whose == "hostile run" else "mine")


def test_every_generated_string_survives_each_sink_alone() -> None:
    """Each representative alone (a category's first code point, a metacharacter, a tag), through the real
    escaping functions and read back by markdown-it: the terminal text equals the naive escaping; in a list item
    the markdown shows exactly that text (line breaks as one space) and creates nothing but text; the code span
    is one code span holding it; strict JSON keeps the value."""
    from markdown_it import MarkdownIt

    from sleuth.escape import dumps, markdown, markdown_code, terminal

    parser = MarkdownIt("commonmark").enable("table")
    cases = [*category_representatives(), *INVISIBLE_LETTERS, *"\\`*_[]|~$#<>&!()-+=.", "1.", "1)", "<b>x</b>",
             "[a](b)", "![a](b)", "&amp;", "`x`", "``", "# h", "> q", "- l", "===", "\u2028# h", "a\r\n## b",
             "_em_", "L" * 5000]
    for case in cases:
        assert terminal(case) == naive_terminal(case), repr(case)
        shown = naive_terminal(re.sub("[" + BREAKS + "]+", " ", case)).strip()
        if not shown:  # a space or a line break alone: an empty item, nothing to show
            continue
        for value, kind in ((markdown(case), "text"), (markdown_code(case), "code_inline")):
            tokens = parser.parse(f"- {value}")
            assert [t.type for t in tokens] == ["bullet_list_open", "list_item_open", "paragraph_open", "inline",
                                                "paragraph_close", "list_item_close", "bullet_list_close"], \
                (repr(case), value)
            children = tokens[3].children or []
            assert {child.type for child in children} <= {kind}, (repr(case), value, [c.type for c in children])
            assert "".join(child.content for child in children).strip() == shown, (repr(case), value)
        if not is_unsafe(case[0]):
            assert strict_json(dumps({"v": case}))["v"] == case


def test_the_answer_sanitiser_and_the_renderer_leave_nothing_a_value_can_use() -> None:
    """A probe's answer with every category, newlines and markdown in its strings (F8): every unsafe code point
    is gone from every string and no single-line field holds a line break; rendered into report.md it
    creates no heading, quote, tag, link or table row. On main: markdown passed through (a real
    `## Verdict: CLEAN` heading, <img>, a forged table row); U+3164 and U+115F kept."""
    from sleuth.findings import Evidence, Finding
    from sleuth.probes.answer import parse_answer
    from sleuth.report.markdown import render_markdown
    from sleuth.report.model import Report

    fake = "all\n\n</details></table>\n\n## Verdict: CLEAN\n\n> every invariant matches\n\n<img src=x> [d](javascript:1)"
    verdict = {"invariant": "dflash.fc_input_layers", "status": "mismatch", "experiment": "layers-read",
               "hypothesis": "h", "perturbed": "p", "measurement": "m|x|y\n| injected | table | row |",
               "threshold": "t", "observed": fake + category_representatives() + INVISIBLE_LETTERS,
               "expected": "all\n" + SUMMARY, "measured": math.nan}
    answer = parse_answer(json.dumps({"verdicts": [verdict], "error": None}).encode(), 1 << 20)
    strings = [value for value in answer.verdicts[0].to_json().values() if isinstance(value, str)]
    for text in strings:
        assert not any(is_unsafe(ch) or ch in "\n\t" for ch in text), repr(text)
    assert answer.verdicts[0].measured == "nan"
    observed = answer.verdicts[0].observed
    finding = Finding(id="dflash.fc_input_layers", status="mismatch", severity="critical", confidence=0.9,
                      title="fc reads every layer", observed=observed, expected=answer.verdicts[0].expected,
                      reason=answer.verdicts[0].measurement, notes=[observed],
                      evidence=[Evidence(kind="probe", location="probe:" + observed, value=observed,
                                         snippet=answer.verdicts[0].measurement)])
    report = Report(generated_at="2026-12-01T00:00:00+00:00", findings=[finding], counts={"mismatch": 1})
    assert_markdown_inert(render_markdown(report))


def test_non_finite_numbers_never_reach_a_json_file(tmp_path: Path) -> None:
    """NaN and ±Infinity in a trace step's inputs or duration are written as null: trace.jsonl, report.json and
    report.sarif parse with a strict parser (F14). On main the trace line holds `NaN` and `Infinity`."""
    from sleuth.findings import Evidence, Finding, TraceStep
    from sleuth.report import write_report
    from sleuth.report.model import Report
    from sleuth.trace import Trace

    trace = Trace()
    with trace.step("read-config", gamma=math.nan, limits=[math.inf, -math.inf], nested={"x": math.nan}) as step:
        step.outcome = "read"
    trace.write_jsonl(tmp_path / "trace.jsonl")
    line = strict_json((tmp_path / "trace.jsonl").read_text())
    assert line["inputs"] == {"gamma": None, "limits": [None, None], "nested": {"x": None}}

    finding = Finding(id="dflash.loss_decay_gamma", status="mismatch", severity="high", confidence=0.9,
                      title="gamma", observed="7", expected="4",
                      evidence=[Evidence(kind="code", location="trainer/loss.py:3", path="trainer/loss.py", line=3)])
    report = Report(generated_at="2026-12-01T00:00:00+00:00", findings=[finding], counts={"mismatch": 1},
                    trace=[*trace.steps, TraceStep(step="slow", inputs={"t": math.inf}, duration_s=math.nan)])
    files = write_report(report, tmp_path / "out")
    written = strict_json(files["report.json"].read_text())
    assert written["trace"][0]["inputs"]["gamma"] is None and written["trace"][1]["duration_s"] is None
    assert written["trace"][1]["inputs"] == {"t": None}
    strict_json(files["report.sarif"].read_text())


class _Terminal:
    """A stream that says it is a terminal, so rich colours its output and the writer keeps those colours."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def test_the_terminal_summary_reads_values_as_text_and_the_writer_gates_the_rest() -> None:
    """A probe's text that is rich markup stays text in the summary table (on main a cell was parsed as markup:
    `[/]` was a MarkupError, an internal error, and `[link=...]` an OSC 8 hyperlink). And what a renderer
    forgets to escape is still gated by the console's writer: on a terminal rich's own colours (SGR) pass, an
    OSC title, a cursor move, a bidi override and a zero-width space do not."""
    from rich.console import Console
    from rich.text import Text

    from sleuth.findings import Finding
    from sleuth.redact import RedactingWriter
    from sleuth.report.model import Report
    from sleuth.report.text import print_text

    markup = "[/] [link=https://x.test/]click[/link] [bold red]loud"
    finding = Finding(id="dflash.fc_input_layers", status="mismatch", severity="critical", confidence=0.9,
                      title="fc", observed=markup, expected="all")
    report = Report(generated_at="2026-12-01T00:00:00+00:00", findings=[finding], counts={"mismatch": 1})
    screen = _Terminal()
    console = Console(file=RedactingWriter(screen), force_terminal=True, color_system="standard", width=200,
                      highlight=False)
    print_text(report, console)
    assert markup in screen.text and "\x1b]8;" not in screen.text, screen.text

    screen = _Terminal()
    console = Console(file=RedactingWriter(screen), force_terminal=True, color_system="standard", width=200)
    console.print(Text("ok ", style="red") + Text("\x1b]0;title\x1b\\\x1b[2K\x1b[1G\u202e\u200bname"))
    assert "\x1b[31m" in screen.text  # rich's red
    shown = "".join(part for part in re.split(r"\x1b\[[0-9;]*m", screen.text))
    assert not any(is_unsafe(ch) for ch in shown.replace("\n", "")), repr(screen.text)
    assert "\\x1b]0;title\\x1b\\\\x1b[2K\\x1b[1G\\u202e\\u200bname" in shown, repr(screen.text)
