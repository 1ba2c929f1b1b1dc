"""A run as CI reads it: JUnit XML (one testcase per judged item) and a short markdown summary.

Pure: both are built from a RunSide (analysis.run_compare) and returned as text.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

from analysis.run_compare import DRIFT, FAIL, PASS, Item, RunSide

UNJUDGED = "UNJUDGED"
# Characters XML 1.0 cannot hold at all (engine output may carry them): shown as \\xNN.
_BAD_XML = {c: f"\\x{c:02x}" for c in range(32) if chr(c) not in "\t\n\r"}


def _clean(text: Any) -> str:
    return str(text).translate(_BAD_XML)


def junit_xml(side: RunSide) -> str:
    """JUnit XML: one testsuite for the run, one testcase per item, and one for the run's own
    verdict (so that a run that failed with no item failing, e.g. a crashed engine, fails)."""
    suite = ET.Element("testsuite")
    suite.set("name", _clean(side.preset))
    props = ET.SubElement(suite, "properties")
    for name, value in (
        ("run_id", side.run_id),
        ("kind", side.kind),
        ("verdict", side.verdict or "NOT_FINISHED"),
        ("exit_code", "" if side.exit_code is None else str(side.exit_code)),
        ("path", side.path),
        *sorted(side.identity.items()),
    ):
        prop = ET.SubElement(props, "property")
        prop.set("name", _clean(name))
        prop.set("value", _clean(value))
    failures = errors = 0
    for item in side.items:
        case = _case(suite, side, item.klass, item.key)
        if item.tone == FAIL:
            tag = "error" if item.verdict == UNJUDGED else "failure"
            failures += tag == "failure"
            errors += tag == "error"
            node = ET.SubElement(case, tag)
            node.set("type", _clean(item.verdict))
            node.set("message", _clean(f"{item.verdict}: {item.first_fail or 'failed'}"))
            node.text = _clean(_detail(item))
        else:
            out = ET.SubElement(case, "system-out")
            out.text = _clean(_detail(item))
    # The run's own verdict: a failure only when no item carries it (a crashed engine, an
    # error outside every item), so each failing item is counted once.
    run_case = _case(suite, side, "run", "verdict")
    if side.tone not in (PASS, DRIFT) and not any(i.tone == FAIL for i in side.items):
        infra = side.exit_code is None or side.exit_code >= 2
        tag = "error" if infra else "failure"
        failures += tag == "failure"
        errors += tag == "error"
        node = ET.SubElement(run_case, tag)
        word = side.verdict or "NOT_FINISHED"
        node.set("type", _clean(word))
        why = "; ".join(side.problems[:5]) or word
        node.set("message", _clean(f"{word}: {why}"))
        node.text = _clean("\n".join(side.problems) or why)
    else:
        out = ET.SubElement(run_case, "system-out")
        out.text = _clean(f"run {side.run_id}: {side.verdict} (exit {side.exit_code})")
    suite.set("tests", str(len(side.items) + 1))
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    suite.set("skipped", "0")
    if side.started_at:
        suite.set("timestamp", side.started_at[:19])
    root = ET.Element("testsuites")
    root.set("name", "tracedeck")
    root.set("tests", suite.get("tests", "0"))
    root.set("failures", str(failures))
    root.set("errors", str(errors))
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, "unicode") + "\n"


def _case(suite: ET.Element, side: RunSide, klass: str, name: str) -> ET.Element:
    case = ET.SubElement(suite, "testcase")
    case.set("classname", _clean(f"{side.preset}.{klass}"))
    case.set("name", _clean(name))
    case.set("time", "0")
    return case


def _detail(item: Item) -> str:
    lines = [f"{item.klass} {item.key}: {item.verdict}"]
    if item.first_fail:
        lines.append(f"first fail: {item.first_fail}")
    if item.where:
        lines.append(f"at: {item.where}")
    for name, value in item.metrics.items():
        mark = "  (past its threshold)" if name in item.failing else ""
        lines.append(f"{name} = {value}{mark}")
    return "\n".join(lines)


def summary_markdown(side: RunSide) -> str:
    """A short markdown summary for a CI job page: verdict, counts, failing items, identity."""
    failing = [i for i in side.items if i.tone == FAIL]
    drift = sum(1 for i in side.items if i.tone == DRIFT)
    passed = sum(1 for i in side.items if i.tone == PASS)
    mark = {PASS: "✅", DRIFT: "🟡"}.get(side.tone or "", "❌")
    lines = [
        f"## {mark} {_md(side.preset)}: {_md(side.verdict or 'NOT_FINISHED')} "
        f"(exit {side.exit_code if side.exit_code is not None else '-'})",
        "",
        f"Run `{side.run_id}` ({side.kind}), started {side.started_at}: "
        f"{len(side.items)} item(s), {passed} passed, {drift} expected drift, "
        f"{len(failing)} failed.",
        "",
    ]
    if failing:
        lines += ["| item | verdict | first fail |", "| --- | --- | --- |"]
        for item in failing[:20]:
            lines.append(
                f"| {_md(item.klass)} {_md(item.key)} | {_md(item.verdict)} | "
                f"{_md(item.first_fail)} |"
            )
        if len(failing) > 20:
            lines.append(f"| … | | and {len(failing) - 20} more |")
        lines.append("")
    for problem in side.problems[:5]:
        lines.append(f"- {_md(problem)}")
    if side.problems:
        lines.append("")
    ident = [(k, v) for k, v in side.identity.items() if k != "engine command"]
    if ident:
        lines.append("<details><summary>engine and host</summary>")
        lines.append("")
        lines += [f"- {_md(k)}: `{_md(v)}`" for k, v in ident]
        lines += ["", "</details>", ""]
    return "\n".join(lines)


def _md(text: Any) -> str:
    return _clean(text).replace("|", "\\|").replace("\n", " ")
