"""deploy/grafana/jax-serve.json: every query of the dashboard names series that /metrics exports
(the app's own /metrics after a served request, a refused one and an unknown route)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.serving_helpers import app_in_process

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "jax-serve.json"
METRIC = re.compile(r"\b(?:vllm|jax_serve):[A-Za-z0-9_:]+")


def queries(dashboard: dict) -> list[str]:
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    return exprs + [var["query"]["query"] for var in dashboard["templating"]["list"] if var["type"] == "query"]


@pytest.fixture(scope="module")
def scraped(llama_dir) -> list:
    """The samples of /metrics after a served request, a refused one and an unknown route."""
    with app_in_process(llama_dir, "tiny", engine_cls="tests.support.fake_engine:FakeEngine", max_num_seqs=4) as (_, http, _):
        served = http.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3})
        assert served.status_code == 200
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": ""}).status_code == 400
        assert http.get("/v1/nowhere").status_code == 404
        text = http.get("/metrics").text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


@pytest.fixture(scope="module")
def exported(scraped) -> dict[str, set[str]]:
    """{sample name: the label names it carries}."""
    names: dict[str, set[str]] = {}
    for sample in scraped:
        names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_every_query_names_exported_series_with_the_labels_it_uses(exported):
    dashboard = json.loads(DASHBOARD.read_text())
    for expr in queries(dashboard):
        metrics = METRIC.findall(expr)
        assert metrics, f"query names none of our metrics: {expr}"
        for metric in metrics:
            assert metric in exported, f"{metric} (in {expr!r}) is not exported; /metrics has {sorted(exported)}"
        used = set(re.findall(r"by \(([^)]*)\)", expr))
        for labels in used:
            for label in (name.strip() for name in labels.split(",")):
                assert label == "le" or any(label in exported[m] for m in metrics), (label, expr)


def test_the_ingress_counts_responses_by_route_and_status(scraped):
    """The three answers before the scrape (the scrape itself is counted after it answers)."""
    counts = {(s.labels["route"], s.labels["status"], s.labels["ingress"]): s.value for s in scraped
              if s.name == "jax_serve:http_responses_total"}
    assert counts == {("/v1/completions", "200", "local"): 1.0, ("/v1/completions", "400", "local"): 1.0,
                      ("unmatched", "404", "local"): 1.0}


def test_panels_have_unique_ids_and_each_target_its_own_ref_id():
    dashboard = json.loads(DASHBOARD.read_text())
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in dashboard["panels"]:
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]
