"""The console's pure parts: the verdict's word an operator reads, a host path never shown,
a hostile retained state rendered inert on the front page, and one full verify at a time whose
progress the audit page shows while it runs."""

from __future__ import annotations

import threading
import time

from improved.cli.console_pages import audit_page, proposals_page
from improved.cli.console_reads import Filters, Verified, hidden, listed, verdict_of
from improved.cli.console_verify import FullVerify
from improved.protocol.model import ProposalState


def state(pid: str, updated_at: int, summary: str = "s") -> ProposalState:
    return ProposalState(proposal_id=pid * 64, service="svc", target_ref="rank:k",
                         change_class="L0", gate_class="L0", scope="service",
                         dedup_key="d", stage="apply", status="applied",
                         summary_text=summary, updated_at=updated_at)


def test_the_verdict_words():
    assert verdict_of(0, anchored=True) == "VERIFIED"
    assert verdict_of(0, anchored=False) == "UNVERIFIED"  # nothing to check writers against
    assert verdict_of(3, anchored=True) == "UNVERIFIED"
    assert verdict_of(1, anchored=True) == verdict_of(1, anchored=False) == "BROKEN"
    assert verdict_of(2, anchored=True) == "NOT RUN"


def test_a_host_path_is_never_shown():
    paths = [("/srv/improved", "the data directory"), ("/srv", "x"), ("/", "never")]
    assert hidden("checkpoint file /srv/improved/last-checkpoint.json holds", paths) == \
        "checkpoint file the data directory/last-checkpoint.json holds"


def test_the_front_page_pages_newest_first_and_shows_markup_as_text():
    states = [state("a", 1), state("b", 3, "<script>alert(1)</script>"), state("c", 2)]
    first = listed(states, Filters(per_page=2))
    assert [s.proposal_id[0] for s in first.rows] == ["b", "c"] and first.older
    second = listed(states, Filters(page=2, per_page=2))
    assert [s.proposal_id[0] for s in second.rows] == ["a"] and not second.older
    html = proposals_page(first, "", "read-only")
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert 'href="/?page=2&amp;n=2" id=older' in html and "id=newer" not in html


def test_one_full_verify_at_a_time_its_progress_shown_while_it_runs():
    release = threading.Event()

    def run(say, watch) -> int:
        watch(500)
        release.wait(10)
        say("3/3 chains verified, 700 trailers")
        return 0

    job = FullVerify(run, anchored=True, paths=[])
    since = Verified("VERIFIED", 0, [])
    assert job.start() and not job.start()  # the second asks while the first runs
    deadline = time.monotonic() + 5
    while job.state().read != 500 and time.monotonic() < deadline:
        time.sleep(0.01)
    running = audit_page(since, job.state(), "token", "read-only")
    assert "<span id=full-read>500</span> trailers read so far" in running
    assert "http-equiv=refresh" in running and "id=full-verify" not in running
    release.set()
    while job.state().running and time.monotonic() < deadline:
        time.sleep(0.01)
    done = audit_page(since, job.state(), "token", "read-only")
    assert '<p id=full class="verdict ok">VERIFIED</p>' in done and "700 trailers" in done
    assert "http-equiv=refresh" not in done and "id=full-verify" in done
