"""Security scanners over the deploy artefacts, offline: trivy and checkov check every rendered value
set of the Helm chart (``VALUE_SETS`` in tests/chart.py) and both Dockerfiles, and every failed
check must be accepted, with its reason, in the "Scanner findings accepted" table of docs/deploy.md.
A row that no longer matches any finding fails too, so the table lists only what is still true.

Both tools come from the test set-up (``tests/tools.py``: trivy from a pinned PyPI wheel, checkov in
a virtualenv of its own) and each runs once for everything, since starting them costs more than
scanning (checkov takes about 5 s to import).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import platform
import re
import subprocess
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import tools
import yaml

# Fixtures: pytest finds them here under these names (``rendered`` needs ``helm``).

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = ("Dockerfile", "Dockerfile.gpu")
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
SECTION = "## Scanner findings accepted"


@dataclass(frozen=True)
class Finding:
    tool: str
    check: str
    resource: str  # Kind/name of a rendered manifest, or the Dockerfile's name
    source: str  # the value set the manifest was rendered from, or the Dockerfile's name
    title: str  # what the scanner says is wrong, for the reader of a failure


@dataclass(frozen=True)
class Accepted:
    tool: str
    check: str
    resource: str  # a glob (fnmatch) over Finding.resource
    reason: str

    def covers(self, finding: Finding) -> bool:
        return (finding.tool, finding.check) == (self.tool, self.check) and fnmatch.fnmatchcase(
            finding.resource, self.resource)


# --- the scanned folder and the tools ----------------------------------------------------------


Sources = dict[Path, list[tuple[str, str]]]
"""Each scanned file → the (source, resource) of every place it stands for."""


def write_scan_folders(manifests: dict[str, list[dict]], work: Path) -> Sources:
    """Writes what checkov scans, ``checkov/<value set>/<Kind>-<name>.yaml`` and
    ``checkov/dockerfiles/``, and what trivy scans, ``trivy/``: every distinct document once (most
    are the same in every value set, and trivy's time grows with its files) and the Dockerfiles.
    One document a file because trivy reports some findings without a line: the file is what ties
    a finding to its resource. One folder a value set for checkov because its graph checks (a pod
    without a NetworkPolicy, say) join the documents of a folder, and value sets must not cover for
    each other; trivy's checks look at one document at a time."""
    sources: Sources = defaultdict(list)

    def put(path: Path, text: str, source: str, resource: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        sources[path].append((source, resource))

    for name, docs in manifests.items():
        for doc in docs:
            resource = f"{doc['kind']}/{doc['metadata']['name']}"
            stem, text = resource.replace("/", "-"), yaml.safe_dump(doc, sort_keys=False)
            per_set = work / "checkov" / name / f"{stem}.yaml"
            assert per_set not in sources, f"{name} renders {resource} twice"
            put(per_set, text, name, resource)
            put(work / "trivy" / f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.yaml", text, name, resource)
    for dockerfile in DOCKERFILES:
        text = (ROOT / dockerfile).read_text()
        put(work / "checkov" / "dockerfiles" / dockerfile, text, dockerfile, dockerfile)
        put(work / "trivy" / dockerfile, text, dockerfile, dockerfile)
    return dict(sources)  # a lookup of a file not written here is an error, not an empty list


def offline_env(work: Path) -> dict[str, str]:
    """HOME, TMPDIR and XDG_CACHE_HOME inside the test's folder, so neither tool writes outside it
    (checkov leaves a parser cache in TMPDIR); checkov's PyPI version check, which it runs on import
    whatever its flags, off."""
    home = work / "home"
    home.mkdir()
    return {**os.environ, "HOME": str(home), "TMPDIR": str(home), "XDG_CACHE_HOME": str(home / ".cache"),
            "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true"}


def tool_binary(path: Path, ready: bool, what: str) -> Path:
    """A fetched tool, or a skip off linux-amd64 (what the pins are for), or a failure naming the set-up."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the pinned {what} is for linux-amd64, not {platform.machine()}")
    if not ready:
        pytest.fail(f"{what} is not at {path}: the test set-up fetches it "
                    "(bash scripts/test.sh, or .venv/bin/python tests/tools.py)")
    return path


def run_trivy(sources: Sources, work: Path, env: dict[str, str]) -> list[Finding]:
    """`trivy config` over ``work/trivy`` with the checks built into the binary (--skip-check-update),
    no version notice, no telemetry, no trivy.yaml or .trivyignore from the working folder, and its
    cache in ``work``."""
    binary = tool_binary(tools.trivy_path(), tools.trivy_ready(tools.trivy_path()), f"trivy {tools.TRIVY_VERSION}")
    folder, report_path = work / "trivy", work / "trivy.json"
    result = subprocess.run(
        [str(binary), "config", "--quiet", "--skip-check-update", "--skip-version-check", "--disable-telemetry",
         "--cache-dir", str(work / "trivy-cache"), "--module-dir", str(work / "trivy-modules"),
         "--config", "", "--ignorefile", "", "--misconfig-scanners", "kubernetes,dockerfile",
         "--format", "json", "--output", str(report_path), str(folder)],
        capture_output=True, text=True, env=env, cwd=work, timeout=300)
    assert result.returncode == 0, f"trivy failed:\n{result.stderr}"
    results = {folder / r["Target"]: r for r in json.loads(report_path.read_text()).get("Results", [])}
    unscanned = {p.name for p in sources if p.parent == folder} - {p.name for p in results}
    assert not unscanned, f"trivy did not recognise {sorted(unscanned)} as configuration"
    return [Finding("trivy", m["ID"], resource, source, f"{m['Title']}: {m['Message']} ({m['Resolution']})")
            for path, r in results.items() for m in r.get("Misconfigurations") or [] if m["Status"] == "FAIL"
            for source, resource in sources[path]]


def json_documents(text: str) -> list:
    """checkov -o json prints one JSON document per -d folder, one after the other."""
    decoder, docs, text, at = json.JSONDecoder(), [], text.strip(), 0
    while at < len(text):
        doc, end = decoder.raw_decode(text, at)
        docs.append(doc)
        at = len(text) - len(text[end:].lstrip())
    return docs


def run_checkov(sources: Sources, work: Path, env: dict[str, str]) -> list[Finding]:
    """One checkov process, one -d per folder of ``work/checkov``: each is scanned with a graph of its
    own, and the report printed after each repeats the earlier folders' findings, hence the set.
    Absolute folders: only then is file_abs_path right for manifests and Dockerfiles alike.
    --compact: no code in the reports (they repeat: it halves the time). --skip-download: no
    policies, guidelines or suppressions from the Prisma Cloud platform."""
    binary = tool_binary(tools.checkov_path(), tools.checkov_ready(), f"checkov {tools.CHECKOV_VERSION}")
    folders = [arg for folder in sorted((work / "checkov").iterdir()) for arg in ("-d", str(folder))]
    result = subprocess.run(
        [str(binary), *folders, "--framework", "kubernetes", "dockerfile", "--output", "json", "--quiet",
         "--compact", "--skip-download"],
        capture_output=True, text=True, env=env, cwd=work, timeout=300)
    # 1: some check failed; 2: a scanner crashed, and the folders after it went unscanned.
    assert result.returncode in (0, 1), f"checkov exited {result.returncode}:\n{result.stderr}"
    try:
        reports = [r for doc in json_documents(result.stdout) for r in (doc if isinstance(doc, list) else [doc])]
    except json.JSONDecodeError:
        pytest.fail(f"checkov printed no JSON report:\n{result.stdout}\n{result.stderr}")
    assert reports, f"checkov printed no report:\n{result.stderr}"
    findings = set()
    for report in reports:
        assert report.get("summary", report).get("parsing_errors", 0) == 0, f"checkov could not parse: {report}"
        for check in report.get("results", {}).get("failed_checks", []):
            findings.update(Finding("checkov", check["check_id"], resource, source, check["check_name"])
                            for source, resource in sources[Path(check["file_abs_path"])])
    return sorted(findings, key=lambda f: (f.check, f.resource, f.source))


# --- the accepted-findings table ---------------------------------------------------------------


def accepted_rows(markdown: str) -> list[Accepted]:
    """The rows of the table under SECTION: | tool | check | resource | reason |, backticks ignored."""
    assert SECTION in markdown, f"docs/deploy.md has no '{SECTION}' section"
    section = re.split(r"\n## ", markdown.split(SECTION, 1)[1])[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) != 4 or cells[0] == "tool" or set(cells[0]) <= set("-: "):
            continue
        assert cells[3], f"docs/deploy.md: accepted finding without a reason: {line}"
        rows.append(Accepted(*cells))
    assert rows, f"docs/deploy.md: no table rows under '{SECTION}'"
    return rows


def describe(findings: list[Finding]) -> str:
    """One line per (tool, check, resource, message), with the value sets or Dockerfiles it came from."""
    where = defaultdict(set)
    for f in findings:
        where[f.tool, f.check, f.resource, f.title].add(f.source)
    return "\n".join(f"  {tool} {check} {resource} [{', '.join(sorted(sources))}]: {title}"
                     for (tool, check, resource, title), sources in sorted(where.items()))


@pytest.fixture(scope="module")
def findings(request, tmp_path_factory) -> list[Finding]:
    """Every failed check of both scanners over every value set and both Dockerfiles."""
    work = tmp_path_factory.mktemp("scanners").resolve()  # resolved: checkov reports resolved paths
    sources = write_scan_folders(request.getfixturevalue("rendered"), work)
    env = offline_env(work)
    return run_trivy(sources, work, env) + run_checkov(sources, work, env)


def test_every_failed_check_is_accepted(findings):
    rows = accepted_rows(DEPLOY_DOC.read_text())
    unaccepted = [f for f in findings if not any(row.covers(f) for row in rows)]
    assert not unaccepted, (
        "failed scanner checks that docs/deploy.md does not accept: fix the chart or Dockerfile, or add a row "
        f"| tool | check | resource | reason | under '{SECTION}':\n{describe(unaccepted)}")


def test_every_accepted_row_still_matches_a_finding(findings):
    stale = [row for row in accepted_rows(DEPLOY_DOC.read_text()) if not any(row.covers(f) for f in findings)]
    assert not stale, (f"rows of '{SECTION}' in docs/deploy.md that no scanner finding matches any more "
                       "(remove them): " + "; ".join(f"{r.tool} {r.check} {r.resource}" for r in stale))
