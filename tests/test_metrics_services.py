"""`--metrics` on real servers: a verifier and a drafter process serve /metrics, and a scrape after a
few requests shows exactly what the requests did (their own step stats are the reference).

The requests run through an Engine in this process wired to the two servers (a RemoteVerifier and a
RemoteDrafter, as `serve` wires them), so every StepStats is at hand. Ports: the servers bind port 0
and log the bound metrics port, which the test reads from their logs.
"""

from __future__ import annotations

import random
import re
import socket
import urllib.request

import pytest
import service_helpers as sh

from drafter_service.remote import DrafterClient
from orchestrator.engine import Engine
from orchestrator.policy import StaticPolicy
from specmesh import rpc
from specmesh.sampling import SamplingParams
from verifier_service.remote import VerifierClient

PROPOSERS = ("prompt_lookup", "copy")
METRICS_LINE = re.compile(r"Prometheus metrics at http://127\.0\.0\.1:(\d+)/metrics")
MODEL_LABEL = 'model_name="tiny"'
SAMPLE = re.compile(r"^(specmesh_[a-z_]+)(\{[^}]*\})? (\S+)$")


def model_free_drafter(*extra: str) -> sh.Service:
    argv = ["-m", "specmesh", "drafter", "--draft", "none", "--proposers", *PROPOSERS, *extra]
    return sh.Service(argv, None, "drafter")


def metrics_port(service: sh.Service) -> int:
    found = METRICS_LINE.search(service.log_text())
    assert found, service.log_text()
    return int(found.group(1))


def scrape(port: int) -> dict[str, float]:
    """specmesh_* samples as {'name{labels}': value}, without the ``model_name`` label, which every sample has
    (the servers' --model-name)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if (m := SAMPLE.match(line)) is not None:
            labels = re.findall(r'\w+="[^"]*"', m.group(2) or "")
            assert MODEL_LABEL in labels, line
            labels.remove(MODEL_LABEL)
            samples[m.group(1) + ("{" + ",".join(labels) + "}" if labels else "")] = float(m.group(3))
    return samples


@pytest.fixture(scope="module")
def servers():
    verifier = sh.verifier("--metrics", "127.0.0.1:0", "--no-cost-profile", "--model-name", "tiny")
    drafter = model_free_drafter("--metrics", "127.0.0.1:0", "--model-name", "tiny")
    try:
        sh.start_all(verifier, drafter)
        yield verifier, drafter
    finally:
        verifier.stop()
        drafter.stop()


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    out = []
    for n in (12, 30, 20, 45):
        pattern = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 6))]
        out.append((pattern * n)[:n] + [rng.randrange(3, vocab) for _ in range(4)])  # repeats: lookup drafts
    return out


def test_scrapes_equal_what_the_requests_did(servers):
    verifier, drafter = servers
    v_port, d_port = metrics_port(verifier), metrics_port(drafter)
    assert v_port not in (0, verifier.port) and d_port not in (0, drafter.port)
    security = rpc.Security()
    vclient, dclient = VerifierClient(verifier.address, security), DrafterClient(drafter.address, security)
    try:
        vocab = vclient.fetch_info(timeout=60).vocab_size
        runs = []  # (proposer, prompt, result)
        for i, prompt in enumerate(prompts(vocab)):
            proposer = PROPOSERS[i % 2]
            engine = Engine(vclient.bind(None), [(proposer, lambda p=proposer: dclient.drafter(p))],
                            StaticPolicy(8, 4), strict=True)
            result = engine.generate(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
            runs.append((proposer, prompt, result))
    finally:
        vclient.close()
        dclient.close()
    steps = [s for _, _, r in runs for s in r.stats.steps]
    assert sum(s.num_accepted for s in steps) > 0  # speculation really ran

    v = scrape(v_port)
    assert v["specmesh_verifier_verify_calls_total"] == len(steps)
    assert v["specmesh_verifier_verify_rows_total"] == sum(s.num_proposed + 1 for s in steps)
    assert v["specmesh_verifier_prefill_calls_total"] == len(runs)
    assert v["specmesh_verifier_prefill_tokens_total"] == sum(len(p) for _, p, _ in runs)
    assert v["specmesh_verifier_batch_sessions_count"] == v["specmesh_verifier_steps_total"]
    assert v["specmesh_verifier_num_sessions"] == 0 and v["specmesh_kv_cache_usage_perc"] == 0  # all released
    assert v["specmesh_verifier_kv_blocks"] > 0

    def drafter_counts_settled() -> bool:  # the close-time context sync and close run after the reply
        d = scrape(d_port)
        return all(d.get(f'specmesh_drafter_context_syncs_total{{proposer="{p}"}}') == 2 for p in PROPOSERS) and all(
            d.get(f'specmesh_drafter_num_sessions{{proposer="{p}"}}') == 0 for p in PROPOSERS)

    assert sh.wait_until(drafter_counts_settled, timeout=10), scrape(d_port)
    d = scrape(d_port)
    for proposer in PROPOSERS:
        mine = [s for p, _, r in runs if p == proposer for s in r.stats.steps]
        label = f'{{proposer="{proposer}"}}'
        drafted = [s for s in mine if s.budget[0] and s.budget[1]]  # sequential loop: one Propose per budget
        assert d["specmesh_drafter_proposals_total" + label] == len(drafted)
        assert d["specmesh_drafter_proposal_seconds_count" + label] == len(drafted)
        assert d["specmesh_drafter_proposed_nodes_total" + label] == sum(s.num_proposed for s in mine)
        assert d["specmesh_drafter_feedback_items_total" + label] == len(mine)  # top-k rows of every Verify


def test_metrics_port_in_use_is_a_one_line_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        service = model_free_drafter("--metrics", f"127.0.0.1:{port}")
        try:
            log = service.wait_exit(timeout=60)
        finally:
            service.stop()
    assert service.proc.returncode != 0
    assert f"cannot serve metrics at 127.0.0.1:{port}" in log and "Traceback" not in log
