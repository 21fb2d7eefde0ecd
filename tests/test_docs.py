"""The documentation is tested like the code: links resolve, the README's quick start runs against a live server,
and the configuration page is what the settings (and `python -m service --help`) say."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, ROOT / "benchmarks" / "README.md", *sorted(DOCS.glob("*.md"))]
REGENERATE_CONFIG = ".venv/bin/python -m service.config_doc > docs/configuration.md"

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (where a `[x](y)` or `# x` is no link or heading)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (word characters, '-' and spaces kept),
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"broken links in {page.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_source_paths_the_docs_name_exist(page):
    """Every repository file or module path a page names in code spans exists (so a moved file cannot leave the
    docs pointing at nothing): `model/engine/scheduler.py`, `python -m model.parallel.worker`."""
    text = page.read_text()
    missing = [p for p in re.findall(r"`((?:model|service|benchmarks|tests|deploy)/[\w./-]+)`", text)
               if not (ROOT / p).exists() and not p.startswith(("benchmarks/results/", "tests/artifacts/"))]  # outputs
    missing += [m for m in re.findall(r"python -m ((?:model|service|benchmarks)(?:\.\w+)+)", text)
                if not ((ROOT / m.replace(".", "/")).with_suffix(".py").exists() or (ROOT / m.replace(".", "/")).is_dir())]
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {sorted(set(missing))}"


def test_pages_speak_of_the_product():
    """No issue numbers, status logs or notes on how the work was organized: the docs describe what exists."""
    for page in PAGES:
        text = page.read_text()
        assert not re.search(r"\b[Ii]ssue\s*#?\d+", text), f"{page.relative_to(ROOT)} names an issue"
        assert not re.search(r"^#+\s*Status\b", text, re.M), f"{page.relative_to(ROOT)} has a status log"
        organised = re.search(r"\b(?:the issue that|this session|where the bars stand|the bars? (?:holds?|miss))\b", text, re.I)
        assert not organised, f"{page.relative_to(ROOT)} speaks of how the work was organised: {organised.group()!r}"


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: depth belongs in docs/"
    text = README.read_text()
    assert "make serve" in text and "make test" in text  # the two set-up commands (.ci/run calls `make test`)
    assert "docs/images/viewer.png" in text


# ---- the README's quick start, run as a reader would ----------------------------------------------------------


# The quick start asks "What is the capital of Japan?": the default model answers "The capital of Japan is Tokyo."
# at float32, int8 and int4 alike, each of its tokens ahead of the runner-up by at least 0.85 nats (greedy, Zen 2
# host), so the docs can promise the answer. ("What is the capital of France?" is a near-tie at its first token;
# "Name the largest planet in the solar system." leads clearly at its first token and then names Neptune.)
ANSWER = "Tokyo"


def readme_blocks(lang: str) -> list[str]:
    return [body for tag, body in FENCE.findall(README.read_text()) if tag == lang]


def readme_curl_commands() -> list[str]:
    commands = []
    for block in readme_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():  # backslash continuations joined
            if line.lstrip().startswith("curl "):
                commands.append(line.strip())
    return commands


def on(server, text: str) -> str:
    """The README's address (port 8000) replaced by the live test server's."""
    host = server.url.removeprefix("http://")
    return text.replace("localhost:8000", host).replace("127.0.0.1:8000", host)


def test_readme_curl_requests_run(server):
    commands = readme_curl_commands()
    assert any("/v1/chat/completions" in c for c in commands), "the README's curl completion was not found"
    for command in commands:
        run = subprocess.run(["bash", "-o", "pipefail", "-c", on(server, command)], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, f"{command}\nexit {run.returncode}: {run.stderr}"
        assert run.stdout.strip() and '"error"' not in run.stdout, f"{command}\n{run.stdout}"
        if "/v1/chat/completions" in command:
            choice = json.loads(run.stdout)["choices"][0]
            assert choice["finish_reason"] in ("stop", "length")
            assert ANSWER in choice["message"]["content"], choice  # every token of it leads clearly (above)


def test_readme_openai_example_runs(server):
    examples = [b for b in readme_blocks("python") if "from openai import OpenAI" in b]
    assert len(examples) == 1, "the README's `openai` example was not found"
    assert "http://127.0.0.1:8000/v1" in examples[0]
    run = subprocess.run([sys.executable, "-c", on(server, examples[0])], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert ANSWER in run.stdout, run.stdout


def test_viewer_docs_link_serves_the_inspection_page(server):
    r = httpx.get(server.url + "/inspect/ui/docs", timeout=30)
    assert r.status_code == 200 and r.text == (DOCS / "inspection.md").read_text()


# ---- the configuration page -----------------------------------------------------------------------------------


def test_configuration_page_is_generated_from_the_settings():
    from service.config_doc import render

    committed = (DOCS / "configuration.md").read_text()
    assert committed == render(), f"docs/configuration.md differs from the settings: regenerate with {REGENERATE_CONFIG}"


def nows(text: str) -> str:
    return "".join(text.split())  # argparse wraps help text (at spaces and after hyphens)


def help_entries(help_text: str) -> dict[str, str]:
    """`--flag` -> its help text, from argparse's "options:" section."""
    entries: dict[str, str] = {}
    current: list[str] = []
    for line in help_text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            head, _, rest = line.strip().partition("  ")
            current = re.findall(r"--[a-z0-9-]+", head)
            for f in current:
                entries[f] = rest.strip()
        elif current and line.strip():
            for f in current:
                entries[f] += " " + line.strip()
    return entries


def config_rows() -> list[list[str]]:
    """The server-flag table of docs/configuration.md: flag, environment variable, values, default, meaning."""
    text = (DOCS / "configuration.md").read_text().split("## Server flags", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        if line.startswith("| `--"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows.append(cells)
    return rows


def test_configuration_page_agrees_with_help():
    run = subprocess.run([sys.executable, "-m", "service", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    entries = help_entries(run.stdout)
    rows = config_rows()
    documented = {re.findall(r"--[a-z0-9-]+", row[0])[0] for row in rows}
    assert documented == set(entries) - {"--help"} - {f for f in entries if f.startswith("--no-")}
    for flag_cell, env, _values, default, meaning in rows:
        flag = re.findall(r"--[a-z0-9-]+", flag_cell)[0]
        shown = entries[flag]
        assert shown.count("(default:") == 1, f"{flag}: --help prints its default {shown.count('(default:')} times"
        expected = f"{meaning} (default: {default}) [{env.strip('`')}]"
        assert nows(shown) == nows(expected), f"{flag}: --help says {shown!r}, the page {expected!r}"


def test_every_environment_variable_is_documented():
    sources = [*ROOT.glob("model/**/*.py"), *ROOT.glob("service/**/*.py"), *ROOT.glob("benchmarks/**/*.py"),
               *ROOT.glob("tests/**/*.py"), *ROOT.glob("deploy/**/*"), ROOT / "Makefile", ROOT / "Dockerfile",
               ROOT / "docker-compose.yml", ROOT / ".ci" / "run"]
    used = set()
    for f in sources:
        if f.is_file():
            used |= set(re.findall(r"LLAMASCOPE_[A-Z0-9_]+", f.read_text(errors="replace")))
    page = (DOCS / "configuration.md").read_text()
    missing = sorted(v for v in used if f"`{v}`" not in page)
    assert not missing, f"read by the code but not on docs/configuration.md: {missing}"


# ---- figures: every one from a results JSON, on a named host, with no lab notebook around it ---------------------

RESULTS = ROOT / "benchmarks" / "results"
RESULT_LINK = re.compile(r"\]\((?:\.\./)?benchmarks/results/([\w.-]+\.json)\)")
FIGURE = re.compile(r"(?<![\w.,/-])(\d{1,3}(?:,\d{3})+|\d+)\.(\d+)(?![\d.])|(?<![\w.,/-])(\d+)(?:\.(\d+))?x\b")


def json_numbers(value) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in json_numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in json_numbers(v)]
    return []


def figures(text: str) -> list[tuple[str, float, int]]:
    """The decimal figures and ratios of a table row: (as written, value, decimals). Code spans (commands, file
    names) and links are not figures; whole numbers without an x are counts, not measurements."""
    text = re.sub(r"`[^`]*`|\]\([^)]*\)", "", text)
    out = []
    for m in FIGURE.finditer(text):
        if m.group(1) is not None:
            whole, frac = m.group(1).replace(",", ""), m.group(2)
        else:
            whole, frac = m.group(3), m.group(4) or ""
        out.append((m.group(0), float(f"{whole}.{frac or 0}"), len(frac)))
    return out


def held_by(value: float, decimals: int, numbers: list[float]) -> bool:
    """A figure printed with `decimals` decimals is held by a JSON number that rounds to it (or, for a percentage
    of a ratio, its hundredfold)."""
    tolerance = 0.5 * 10 ** -decimals + 1e-9
    return any(abs(n - value) <= tolerance or abs(100 * n - value) <= tolerance for n in numbers)


# Tables whose figures come from elsewhere than a benchmark, with the command that prints them: the model's own
# behaviour, not a speed (the README's ablation table: tests/service/test_interventions_api.py -k ablation).
NOT_BENCHMARK_FIGURES = {"| as it is |", "| set to 0 |", "| set to its mean over the six"}


@pytest.mark.parametrize("page", [README, DOCS / "performance.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_in_a_summary_table_is_held_by_its_results_json(page):
    """The README's figures and docs/performance.md's summary table come from benchmarks/results/: each table row
    links its JSON (or the text above the table does), and each decimal figure and ratio of the row is a number
    that JSON holds (rounded as printed). A figure typed from memory, or left behind when a result was rerun, fails
    here."""
    text = page.read_text()
    if page.name == "performance.md":  # its summary table; the sections below it explain
        text = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    problems, current = [], []
    for line in FENCE.sub("", text).splitlines():
        if line.startswith("#"):
            current = []  # a table's JSON is linked in its row, or in the text above it within its section
        if RESULT_LINK.search(line):
            current = RESULT_LINK.findall(line)
        if not (line.startswith("|") and figures(line)) or line.startswith(tuple(NOT_BENCHMARK_FIGURES)):
            continue
        if not current:
            problems.append(f"no benchmarks/results JSON linked: {line[:100]}")
            continue
        numbers = [n for name in current for n in json_numbers(json.loads((RESULTS / name).read_text()))]
        problems += [f"{shown} is in no number of {', '.join(current)}: {line[:80]}"
                     for shown, value, decimals in figures(line) if not held_by(value, decimals, numbers)]
    assert not problems, "\n".join(problems)


def test_the_figure_check_catches_a_figure_no_json_holds():
    numbers = json_numbers({"ratio": 1.686416, "ours": 108.00081, "rounds": [1.67, 1.74], "ok": True})
    assert [f[1:] for f in figures("| decode | 108.0 tok/s | 64 | **1.69x** | `gemm --rows 1.5` | [x](y.json) |")] \
        == [(108.0, 1), (1.69, 2)]  # counts, code spans and links are not figures
    assert held_by(108.0, 1, numbers) and held_by(1.69, 2, numbers) and held_by(1.7, 1, numbers)
    assert not held_by(1.68, 2, numbers) and not held_by(108.1, 1, numbers) and not held_by(2.39, 2, numbers)


def test_results_say_their_commit_date_and_host_class():
    """Each results JSON carries what measured it: the commit, the date and the host class (`recorded` for the files
    from before benchmarks/machine.py wrote them, `machine` since)."""
    missing = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        where = {**data.get("machine", {}), **data.get("recorded", {})} if isinstance(data, dict) else {}
        if not (where.get("commit") and where.get("date")):
            missing.append(path.name)
    assert not missing, missing


NOTEBOOK = {
    "a timestamp": re.compile(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d(?:-\d\d:\d\d)? UTC\b"),
    "a commit hash": re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w/-])"),
    "a /tmp path": re.compile(r"(?<![\w.])/tmp/"),
    "a development host": re.compile(r"\bdevelopment (?:host|machine|VM)\b|\btoday's host\b"),
}


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_are_documentation_not_a_lab_notebook(page):
    """No timestamps, commit hashes, /tmp scripts or development hosts in the docs: they describe what exists, on
    named host classes ("AMD Zen 3, AVX2, 2 cores"); when and at which commit a figure was measured is in its
    results JSON, and the history of runs is in git."""
    text = page.read_text()
    found = [f"{what}: {m.group()!r}" for what, p in NOTEBOOK.items() for m in p.finditer(text)]
    assert not found, found


def test_performance_page_is_short_and_opens_with_its_summary():
    text = (DOCS / "performance.md").read_text()
    assert len(text.splitlines()) <= 400
    headings = re.findall(r"^## (.+)$", FENCE.sub("", text), re.M)
    assert headings[0] == "Summary", headings


def test_readme_line_counts_are_the_trees():
    """The README's "about N lines of Python and M of C++" (model/ and service/), within 5% of a count of the tree
    and rounded to a hundred: a figure typed once and left to go stale fails here."""
    m = re.search(r"about\s+([\d,]+)\s+lines of Python and\s+([\d,]+)\s+of C\+\+", README.read_text())
    assert m, "the README's line counts were not found"
    python = sum(len(p.read_text().splitlines()) for d in ("model", "service") for p in (ROOT / d).rglob("*.py"))
    cpp = sum(len(p.read_text().splitlines()) for p in (ROOT / "model").rglob("*") if p.suffix in (".cpp", ".h"))
    for said, counted, what in ((m.group(1), python, "Python"), (m.group(2), cpp, "C++")):
        n = int(said.replace(",", ""))
        assert n % 100 == 0 and abs(n - counted) <= 0.05 * counted, \
            f"the README says {said} lines of {what}; the tree holds {counted}: write about {round(counted, -2):,}"


# ---- every shell command of the README: run here, or why it cannot be --------------------------------------------


def readme_shell_commands() -> list[str]:
    """Each command line of the README's ```bash blocks, continuations joined, its trailing comment dropped."""
    commands = []
    for block in readme_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line:
                commands.append(" ".join(line.split()))
    return commands


# A README command (by how it starts) -> the test that runs it as written (with a free port, and a file of this
# suite's for a path the reader fills in), or why no test here can.
README_COMMANDS_RUN = {
    "curl ": "tests/test_docs.py::test_readme_curl_requests_run",
    "make serve": "tests/test_docs.py::test_readme_serve_commands_run",
    ".venv/bin/llamascope serve": "tests/test_docs.py::test_readme_serve_commands_run",
    "make install && .venv/bin/pip install \".[ray]\"": "tests/deploy/test_fresh_clone.py",
    ".venv/bin/serve run deploy/ray/serve-local.yaml": "tests/deploy/test_fresh_clone.py",
}
README_COMMANDS_NOT_RUN = {
    "make test": "the whole suite, this test among it: CI runs it (.ci/run)",
    "make image image-test": "needs podman, runc, debootstrap and image builds: .ci/run runs it after the suite (CI=true)",
}


def readme_command_entry(command: str) -> tuple[str, str] | None:
    for table in (README_COMMANDS_NOT_RUN, README_COMMANDS_RUN):  # exact entries before prefixes
        if command in table:
            return command, table[command]
    for prefix, where in README_COMMANDS_RUN.items():
        if command.startswith(prefix):
            return prefix, where
    return None


def test_every_readme_shell_command_is_run_here_or_says_why_not():
    commands = readme_shell_commands()
    assert len(commands) >= 8, commands
    unaccounted = [c for c in commands if readme_command_entry(c) is None]
    assert not unaccounted, f"README commands no test runs and no reason excuses: {unaccounted}"
    for where in README_COMMANDS_RUN.values():
        path, _, name = where.partition("::")
        assert (ROOT / path).is_file() and (not name or f"def {name}(" in (ROOT / path).read_text()), where
    used = {readme_command_entry(c)[0] for c in commands}
    assert used == set(README_COMMANDS_RUN) | set(README_COMMANDS_NOT_RUN), "entries for commands the README lost"


def _serve(command: str, port: int, log: Path) -> None:
    """Run a README serve command (a shell line) until its /health says 200, ask it one completion, then SIGTERM it:
    exit 0."""
    import signal
    import time

    from live_server import wait_until_ready

    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(url, proc, log.read_text, timeout=300)
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
                       timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    finally:
        # SIGTERM to the server itself: `make serve`'s child (make then exits with the server's status), else the
        # command's own process
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            children = []
        for pid in children or [proc.pid]:
            os.kill(int(pid), signal.SIGTERM)
        try:
            code = proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        time.sleep(0.5)
    assert code == 0, log.read_text()[-3000:]


@pytest.mark.slow
def test_readme_serve_commands_run(tmp_path):
    """`make serve`, `llamascope serve <gguf>`, `make serve ARGS="--model <gguf> ..."` and `llamascope serve
    <hf-folder> --quantization int8` as the README writes them: the GGUF is this suite's default model file, the HF
    folder a tiny random one with its tokenizer, and each serves on a free port instead of 8000 or 9000."""
    from benchmarks.tiny_checkpoint import write_tiny_checkpoint
    from live_server import free_port
    from model.loaders import default_model_path

    if subprocess.run(["make", "-q", "install"], cwd=ROOT).returncode != 0:
        pytest.skip("make install is not up to date here (make test or make install first)")
    paths = {"/path/to/model.gguf": str(default_model_path()),
             "/path/to/hf-folder": str(write_tiny_checkpoint(tmp_path / "hf-folder"))}
    commands = [c for c in readme_shell_commands() if readme_command_entry(c)
                and readme_command_entry(c)[1].endswith("::test_readme_serve_commands_run")]
    assert len(commands) == 4, commands
    for i, command in enumerate(commands):
        port = free_port()
        for placeholder, path in paths.items():
            command = command.replace(placeholder, path)
        command = re.sub(r"--port \d+", f"--port {port}", command)
        if "--port" not in command:  # the bare `make serve`
            command += f' ARGS="--port {port}"' if command.startswith("make") else f" --port {port}"
        _serve(command, port, tmp_path / f"serve-{i}.log")
