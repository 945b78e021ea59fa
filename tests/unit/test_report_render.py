"""Reports a newcomer can read: a summary first, and HTML without Markdown leaking through."""

from __future__ import annotations

import re

from quantkit.api import quantize
from quantkit.report.build import render_html, render_markdown
from tests.conftest import image_batches, tiny_cnn


def test_summary_first_and_html_without_markdown_syntax() -> None:
    res = quantize(tiny_cnn(), image_batches(4), {"version": 1, "target": {"isa": "x86-vnni"},
                                                  "report": {"latency": {"enabled": False}}},
                   evaluation_data=image_batches(2, seed=3), progress=False)
    md = render_markdown(res.report)
    heads = re.findall(r"^## (.+)$", md, flags=re.M)
    assert heads[0] == "Summary"
    summary = md.split("## Summary")[1].split("##")[0]
    for must in ("quantized:", "fidelity", "size:", "CPU: built for `x86-vnni`"):
        assert must in summary
    html = render_html(res.report)
    text = re.sub(r"<[^>]+>", "", html)
    assert "`" not in text and "**" not in text  # inline marks became <code>/<strong>
    assert "<p>- " not in html and "<li>" in html  # bullets are a list
    assert html.index("Summary") < html.index("Environment")
    # a '|' inside a table cell (|q0+q1|) stays inside its cell
    for row in re.findall(r"<tr>(.*?)</tr>", html):
        if "x86-avx2" in row and "pairs" in row:
            assert row.count("<td>") == 3
