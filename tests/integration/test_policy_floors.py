"""Invariants are floors (DESIGN §9), at the daemon's start and through the real bus: the
constitution's forbidden list cannot be shrunk by the configuration, the L4 quorum starts only
under an approved constitution edit that permits it, and every change of the policy in force
is on its audit chain. (A minimum class below its floor is refused by `config.parse`, before
anything starts: `test_cli.py::test_improved_run_with_a_bad_config_says_one_line_and_exits`.)
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import msgspec
import pytest

from improved.client import connection
from improved.client.config import Policy, load
from improved.client.connection import ConfigError
from improved.client.sdk import MeshClient
from improved.core import audit
from improved.core import policy as P
from improved.core.trailers import refs_of
from improved.protocol import subjects as S
from improved.protocol.model import Trailer
from improved.runtime.daemon import Daemon
from tests.bus import amendment, approve, daemon_config, eventually, quorum_case, quorum_config
from tests.cli import improved
from tests.factories import rank_proposal, skill_proposal

pytestmark = pytest.mark.asyncio(loop_scope="session")


@asynccontextmanager
async def running(url: str, config):
    nc = await connection.connect(url, "floors")
    daemon = Daemon(nc, config)
    try:
        await daemon.start()
        yield nc, daemon
        await daemon.stop()
    finally:
        await connection.close(nc)


async def refused(url: str, config) -> str:
    """The one line a daemon that refuses to start says."""
    with pytest.raises(ConfigError) as caught:
        async with running(url, config):
            pass
    return str(caught.value)


async def policy_chain(url: str) -> list[Trailer]:
    nc = await connection.connect(url, "floors-reader")
    try:
        store = Daemon(nc, daemon_config()).store
        await store.bind()
        bodies = [b for _, b in await store.read_chain_at(S.policy_audit(P.POLICY_ID))]
    finally:
        await connection.close(nc)
    assert bodies == [] or audit.verify_chain(P.POLICY_ID, bodies) is None
    return [msgspec.convert(b, Trailer) for b in bodies]


# -- the forbidden list only grows ---------------------------------------------------------------


async def test_a_forbidden_list_of_one_pattern_still_forbids_the_constitutions_paths(
        own_server, tmp_path):
    toml = tmp_path / "improved.toml"
    toml.write_text('[policy]\nforbidden_targets = ["src/crates/cosmix-mcp/**", '
                    '"deploy/secrets/**"]\ndoc_allowlist = ["**"]\n')
    config = msgspec.structs.replace(daemon_config(), policy=load(toml).policy)
    async with running(own_server.url, config) as (nc, _):
        client = MeshClient(nc, "floors")
        cases = [
            rank_proposal("floors", target_ref="doc:_spec/CHANGELOG.md", change_class="L2"),
            rank_proposal("floors", target_ref="doc:_doc/2026-04-20-declaration.md",
                          change_class="L2"),
            rank_proposal("floors", target_ref="config:/etc/systemd/system/cosmix-noded.service",
                          change_class="L2", scope="operation"),
            rank_proposal("floors", target_files=["src/Cargo.toml"]),
            rank_proposal("floors", target_files=["src/crates/cosmix-indexd/src/lib.rs"]),
            rank_proposal("floors", target_files=["~/.config/cosmix/mesh.toml"]),
            # what the configuration names is forbidden too: its own, and the one it added
            rank_proposal("floors", target_files=["src/crates/cosmix-mcp/src/main.rs"]),
            rank_proposal("floors", target_ref="doc:deploy/secrets/token.md", change_class="L2"),
        ]
        for proposal in cases:
            pid = (await client.propose(proposal)).proposal_id
            d = await client.triage(pid)
            assert (d.verdict, d.cause) == ("reject", "forbidden_target"), proposal.target_ref
        # and what nothing forbids still passes
        pid = (await client.propose(rank_proposal("floors"))).proposal_id
        assert (await client.triage(pid)).verdict == "accept"


# -- the quorum needs an approved constitution edit ---------------------------------------------


async def test_quorum_without_an_amendment_does_not_start_even_when_built_in_code(own_server):
    config = msgspec.structs.replace(daemon_config(), policy=Policy(quorum=True))
    assert await refused(own_server.url, config) == (
        "config error: policy.quorum: true needs policy.quorum_amendment, the id of an approved "
        "constitution edit (a charter proposal) that permits the L4 quorum (SPEC 09 §6)")
    assert await policy_chain(own_server.url) == []  # nothing recorded for a refused start


async def test_quorum_under_no_such_proposal_does_not_start(own_server):
    missing = "e" * 64
    assert await refused(own_server.url, quorum_config(missing)) == (
        f"config error: policy.quorum_amendment: {missing} has no audit chain: no such "
        "proposal")


async def test_quorum_under_a_pending_amendment_does_not_start(own_server, tmp_path):
    pid = await amendment(own_server.url, approved=False)
    line = f"config error: policy.quorum_amendment: {pid} is pending, not approved"
    assert await refused(own_server.url, quorum_config(pid)) == line
    # the same from the command line: one line, exit 2, nothing served
    toml = tmp_path / "improved.toml"
    # the test daemons' key: the chain it names was written by them
    key = daemon_config().checkpoint_key
    toml.write_text(f'checkpoint_key = "{key}"\n[policy]\nquorum = true\n'
                    f'quorum_amendment = "{pid}"\n')
    done = await asyncio.to_thread(improved, "run", "--config", str(toml), "--nats",
                                   own_server.url)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == f"improved: {line}"


async def test_quorum_under_an_approved_amendment_of_something_else_does_not_start(own_server):
    pid = await amendment(own_server.url, amends="VII: IV.2 tiers")
    assert await refused(own_server.url, quorum_config(pid)) == (
        f"config error: policy.quorum_amendment: {pid} amends 'VII: IV.2 tiers', which does "
        "not name the quorum")


async def test_quorum_under_an_approved_proposal_that_is_no_charter_does_not_start(own_server):
    async with running(own_server.url, daemon_config()) as (nc, _):
        client = MeshClient(nc, "notcharter")
        pid = (await client.propose(skill_proposal("notcharter", name="quorum"))).proposal_id
        await approve(nc, client, "notcharter", pid)

        async def is_approved():
            state = await client.state(pid)
            return state is not None and state.status == "approved"

        await eventually(is_approved)
    assert await refused(own_server.url, quorum_config(pid)) == (
        f"config error: policy.quorum_amendment: {pid} is not a constitution edit (a charter "
        "proposal: scope charter, L4, with an amends clause)")


async def test_quorum_under_an_approved_amendment_starts_and_is_recorded(own_server):
    pid = await amendment(own_server.url)
    async with running(own_server.url, quorum_config(pid)) as (nc, daemon):
        store, _, _ = await quorum_case(nc, daemon, "quorumok")  # deferred awaiting_quorum
        await store.stop()
        spec = msgspec.json.decode((await nc.request(S.SPEC_GET, b"", timeout=5)).data)
        assert spec["quorum"] is True
    head = refs_of((await policy_chain(own_server.url))[-1])
    assert head["quorum"] == "true" and msgspec.json.decode(head["quorum_amendment"]) == pid


# -- every change of policy is on the audit trail ------------------------------------------------


async def test_the_policy_chain_gets_a_trailer_for_each_change_and_none_for_a_restart(
        own_server):
    url = own_server.url
    async with running(url, daemon_config()):
        pass
    first = await policy_chain(url)
    assert len(first) == 1
    assert (first[0].verdict, first[0].observer_type) == ("policy", "rec:system")
    assert refs_of(first[0]) == {"digest": P.digest(Policy())}
    assert "the defaults" in first[0].reason

    async with running(url, daemon_config()):  # unchanged: nothing new
        pass
    assert len(await policy_chain(url)) == 1

    raised = Policy(min_class={"rank": "L2"}, forbidden_targets=("deploy/**",))
    async with running(url, daemon_config(policy=raised)):
        pass
    chain = await policy_chain(url)
    assert len(chain) == 2
    refs = refs_of(chain[-1])
    assert refs["digest"] == P.digest(raised) != P.digest(Policy())
    assert msgspec.json.decode(refs["min_class"]) == {"rank": "L2"}
    assert msgspec.json.decode(refs["forbidden_targets"]) == ["deploy/**"]
    assert set(refs) == {"digest", "min_class", "forbidden_targets"}

    # the same policy in other words is no change; going back to the defaults is one
    same = Policy(min_class={"rank": "L2", "grain": "L2"},
                  forbidden_targets=("src/Cargo.toml", "deploy/**", "deploy/**"))
    async with running(url, daemon_config(policy=same)):
        pass
    assert len(await policy_chain(url)) == 2
    last = daemon_config()
    async with running(url, last):
        pass
    chain = await policy_chain(url)
    assert len(chain) == 3 and refs_of(chain[-1]) == {"digest": P.digest(Policy())}
    verified = await asyncio.to_thread(improved, "audit", "verify", "--nats", url,
                                       "--checkpoint",
                                       str(last.data_dir / "last-checkpoint.json"))
    assert verified.returncode == 0, verified.stdout + verified.stderr
