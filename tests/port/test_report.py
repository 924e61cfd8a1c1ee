"""Report renderings: text for people, JSON for scripts, SARIF 2.1.0 for CI annotations."""

import json

import pytest

from tiletune.port.compile_check import CompileCheck, CompileResult, Diagnostic
from tiletune.port.hipify import run_hipify
from tiletune.errors import UserError
from tiletune.port.lint import lint_text
from tiletune.port.report import COMPILE_RULE_ID, explain, to_json, to_sarif, to_text, write_reports
from tiletune.port.rules import RULES

from port_corpus import CORPUS, build_of


@pytest.fixture(scope="module")
def report():
    report = run_hipify([str(CORPUS)], lint_only=True)
    report.compile = CompileCheck("gfx90a", compiler="hipcc 9.9 at /x", results=[
        CompileResult("k.cu", False, [Diagnostic("k.cu", 7, 3, "error", "use of undeclared identifier 'x'", "o/k.hip:8")])])
    return report


def test_sarif_is_a_valid_2_1_0_log_with_every_finding(report):
    log = json.loads(to_sarif(report))
    run, = log["runs"]
    assert log["version"] == "2.1.0" and log["$schema"].endswith("sarif-2.1.0.json")
    rule_ids = [rule["id"] for rule in run["tool"]["driver"]["rules"]]
    assert rule_ids == [rule.id for rule in RULES] + [COMPILE_RULE_ID]
    assert len(run["results"]) == len(report.findings) + 1
    for result in run["results"]:
        assert rule_ids[result["ruleIndex"]] == result["ruleId"]
        assert result["level"] in ("error", "warning", "note")
        region = result["locations"][0]["physicalLocation"]["region"]
        assert region["startLine"] >= 1 and region["startColumn"] >= 1
    assert run["results"][-1]["locations"][0]["physicalLocation"]["artifactLocation"] == {"uri": "k.cu", "uriBaseId": "%SRCROOT%"}


def test_json_has_findings_with_fixes_and_statistics(report):
    data = json.loads(to_json(report))
    assert len(data["findings"]) == len(report.findings)
    assert all(f["fix"] and f["breaks"] and f["rule"] for f in data["findings"])
    assert sum(data["stats"]["findings_by_rule"].values()) == len(report.findings)
    assert data["compile"]["results"][0]["diagnostics"][0]["line"] == 7
    assert data["strict_failures"][-1] == "1 unit(s) failed to compile"


def test_text_lists_findings_rules_fixes_and_compile_errors(report):
    text = to_text(report)
    assert "softmax_ballot.cu:21:24: error: 32-bit lane mask in a warp function [mask-32bit]" in text
    assert "fix:" in text and "breaks:" in text
    assert "k.cu:7:3: error: use of undeclared identifier 'x'  (hipcc: o/k.hip:8)" in text
    assert text.rstrip().endswith("(fails with --strict).")


def test_write_reports_writes_all_three_formats(report, tmp_path):
    written = write_reports(report, tmp_path / "reports")
    assert sorted(p.name for p in written) == ["hipify-report.json", "hipify-report.sarif", "hipify-report.txt"]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.id)
def test_explain_gives_the_pitfall_and_a_before_after_the_lint_agrees_with(rule):
    text = explain(rule.id)
    assert text.startswith(f"[{rule.id}] {rule.title}") and "on AMD:" in text and "fix:" in text
    assert "before (CUDA):" in text and "after (HIP):" in text
    assert rule.id in {f.rule for f in lint_text(rule.before, "before.cu", build=build_of(rule.before))}
    assert rule.id not in {f.rule for f in lint_text(rule.after, "after.cu", build=build_of(rule.before))}


def test_explain_an_unknown_rule_lists_the_rules():
    with pytest.raises(UserError, match=r"no rule 'warp32'; the rules are: warp-size-define, "):
        explain("warp32")
