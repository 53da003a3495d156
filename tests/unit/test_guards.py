"""Guards before the class gate (DESIGN §2, §3.3, §5.1): path normalisation, forbidden targets,
sessions and signal independence."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from improved.core.guards import (
    DEFAULT_FORBIDDEN,
    EscapingPath,
    UncanonicalPath,
    canonical_path,
    diff_paths,
    forbidden_match,
    self_confirmed,
    session_of,
    touched_paths,
    uncanonical,
)
from improved.protocol.model import Origin

UUID = "3f0c2a4e-9b1d-4c57-8a2e-5d6f7a8b9c0d"
WINDOW = 3_600_000

# -- canonical_path ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("a/../constitution.md", "constitution.md"),
        ("$COSMIX/_spec/CHANGELOG.md", "_spec/CHANGELOG.md"),
        ("${COSMIX}/src/Cargo.toml", "src/Cargo.toml"),
        ("./a//b/./c", "a/b/c"),
        ("//etc/systemd/system/x", "/etc/systemd/system/x"),
        ("a\\b\\c.md", "a/b/c.md"),
        ("  _doc/x.md  ", "_doc/x.md"),
    ],
)
def test_canonical_path(raw, norm):
    assert canonical_path(raw) == norm.casefold()


@pytest.mark.parametrize("raw", ["../x", "..", "a/../../x", "$COSMIX/../x"])
def test_canonical_path_refuses_escaping_paths(raw):
    with pytest.raises(EscapingPath):
        canonical_path(raw)


# -- forbidden_match ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "_spec/2026-04-20-00-constitution.md",
        "x/../_spec/2026-04-20-00-constitution.md",
        "$COSMIX/_doc/2026-04-20-declaration.md",
        "/home/u/cosmix/_spec/CHANGELOG.md",
        "src/crates/cosmix-mcp/src/main.rs",
        "src/crates/cosmix-noded/deep/er/lib.rs",
        "/srv/cosmix/src/crates/cosmix-indexd/Cargo.toml",
        "/etc/systemd/system/cosmix-foo.service",
        "/etc/systemd/system/cosmix-foo.timer",
        "/etc/systemd/system/cosmix-foo-wake.service",
        "~/.config/systemd/user/cosmix-bar.service",
        "~/.config/cosmix/harness.toml",
        "src/Cargo.toml",
    ],
)
def test_forbidden_paths_match(path):
    assert forbidden_match([path], DEFAULT_FORBIDDEN) is not None


def test_match_reports_the_normalised_path():
    hit = forbidden_match(["_doc/ok.md", "x/../_spec/2026-04-20-00-constitution.md"],
                          DEFAULT_FORBIDDEN)
    assert hit == "_spec/2026-04-20-00-constitution.md"


def test_escaping_path_fails_closed():
    assert forbidden_match(["../../etc/passwd"], DEFAULT_FORBIDDEN) == "../../etc/passwd"
    # even with no pattern at all, an escaping path counts as a match
    assert forbidden_match(["_doc/ok.md", "../x"], ()) == "../x"


@pytest.mark.parametrize(
    "path",
    [
        "_doc/notes.md",
        "src/crates/cosmix-other/x.rs",
        "src/crates/cosmix-mcpx/main.rs",
        "_spec/CHANGELOG.md.bak",
        "/etc/systemd/system/other.service",
        "~/.config/cosmix/sub/harness.toml",  # `*` does not cross directories
        "/etc/cosmix/harness.toml",
        "src/Cargo.lock",
    ],
)
def test_allowed_paths_do_not_match(path):
    assert forbidden_match([path], DEFAULT_FORBIDDEN) is None


def test_no_paths_no_match():
    assert forbidden_match([], DEFAULT_FORBIDDEN) is None


def test_custom_patterns():
    patterns = ("docs/private/**", "/opt/*.conf", "secret?.txt")
    assert forbidden_match(["docs/private/a/b.md"], patterns) == "docs/private/a/b.md"
    assert forbidden_match(["/opt/app.conf"], patterns) == "/opt/app.conf"
    assert forbidden_match(["/opt/sub/app.conf"], patterns) is None
    assert forbidden_match(["deep/secret1.txt"], patterns) == "deep/secret1.txt"
    assert forbidden_match(["secret12.txt"], patterns) is None


@pytest.mark.parametrize("path", ["$COSMIX/src/crates/cosmix-mcp/", "src/crates/cosmix-noded"])
def test_forbidden_crate_directory_itself_matches(path):
    assert forbidden_match([path], DEFAULT_FORBIDDEN) is not None


def test_double_star_crosses_any_character():
    assert forbidden_match(["src/crates/cosmix-mcp/a\nb.rs"], DEFAULT_FORBIDDEN) is not None


def test_touched_paths_are_every_path_a_change_names():
    from improved.protocol.model import ProposalEdit
    from tests.builders import make_proposal

    edit = ProposalEdit(format="unified", base_digest="sha256:" + "0" * 64,
                        diff="--- a/_doc/x.md\n+++ b/_doc/y.md\n@@ -1 +1 @@\n-a\n+b\n")
    p = make_proposal(target_ref="doc:_doc/x.md", target_files=["a.md"], proposal_data=None,
                      proposal_edit=edit)
    assert touched_paths(p) == ["a.md", "_doc/x.md", "_doc/x.md", "_doc/y.md"]
    # whatever the scheme, the target's rest is checked too
    assert touched_paths(make_proposal(target_ref="rank:search/top")) == ["search/top"]
    for ref in ("doc:x/../_spec/2026-04-20-00-constitution.md", "rank:_spec/CHANGELOG.md",
                "grain:_spec/2026-04-20-00-constitution.md"):
        assert forbidden_match(touched_paths(make_proposal(target_ref=ref)),
                               DEFAULT_FORBIDDEN) is not None, ref


# -- sessions ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("actor", "session"),
    [
        (f"mcp:{UUID}:42", f"mcp:{UUID}"),
        (f"mcp:{UUID}:0", f"mcp:{UUID}"),
        (f"mcp:{UUID}", f"mcp:{UUID}"),
        ("svc:uuid", "svc:uuid"),
        ("operator:alice", "operator:alice"),
        ("skills", "skills"),
        (f"mcp:{UUID}:4x", f"mcp:{UUID}:4x"),  # not a sequence
    ],
)
def test_session_of(actor, session):
    assert session_of(actor) == session


runtime = st.from_regex(r"\A[a-z][a-z0-9_-]{0,10}\Z")
uuid_ish = st.uuids().map(str)
seq = st.integers(min_value=0, max_value=10**9).map(str)
actor_ids = st.one_of(
    runtime,                                                              # <svc>
    st.tuples(runtime, uuid_ish).map(":".join),                           # <svc>:<uuid>
    st.tuples(runtime, uuid_ish, seq).map(":".join),                      # <rt>:<uuid>:<seq>
    st.from_regex(r"\A[a-z][a-z0-9._-]{0,12}\Z").map("operator:".__add__),  # operator:<p>
)


@settings(max_examples=300)
@given(actor=actor_ids)
def test_session_of_is_idempotent(actor):
    once = session_of(actor)
    assert session_of(once) == once
    assert actor.startswith(once)


@settings(max_examples=200)
@given(runtime=runtime, uuid=uuid_ish, a=seq, b=seq)
def test_calls_of_one_session_share_it(runtime, uuid, a, b):
    assert session_of(f"{runtime}:{uuid}:{a}") == session_of(f"{runtime}:{uuid}:{b}")


@settings(max_examples=300)
@given(actor=st.text(alphabet="ab1:", min_size=1, max_size=12))
@example(actor="mcp:aaa:1:2")
def test_session_of_is_idempotent_on_every_actor_the_wire_accepts(actor):
    """Actors with more than one call sequence are refused at the wire, so the session of any
    accepted actor is stable: `mcp:aaa:1:2` can never pose as a session of its own."""
    try:
        msgspec.json.decode(msgspec.json.encode({"actor": actor, "service": "svc"}),
                            type=Origin)
    except msgspec.ValidationError:
        return
    once = session_of(actor)
    assert session_of(once) == once


# -- feedback collapse (independence itself: tests/unit/test_identity.py) ------------------


def test_self_confirmed():
    assert self_confirmed(positives=2, independent_positives=0)
    assert not self_confirmed(positives=2, independent_positives=1)
    assert not self_confirmed(positives=0, independent_positives=0)


# -- the canonical form: disguises of a forbidden path -------------------------------------------

CONSTITUTION = "_spec/2026-04-20-00-constitution.md"
DISGUISES = [
    "%5Fspec/2026-04-20-00-constitution.md",            # percent-encoded
    "_spec%2F2026-04-20-00-constitution.md",            # an encoded slash
    "%255Fspec/2026-04-20-00-constitution.md",          # encoded twice
    "_SPEC/2026-04-20-00-Constitution.MD",              # case
    "＿spec/２０２６-04-20-00-constitution.md",          # full-width forms (NFKC)
    "_spec/./2026-04-20-00-constitution.md",
    "notes/../_spec/2026-04-20-00-constitution.md",
    "_spec\\2026-04-20-00-constitution.md",
    "$COSMIX/_spec/2026-04-20-00-constitution.md",
    "file:///srv/cosmix/_spec/2026-04-20-00-constitution.md",
    "node-1:/srv/cosmix/_spec/2026-04-20-00-constitution.md",
    "$HOME/.config/cosmix/harness.toml",
    "~alice/.config/cosmix/harness.toml",
    "/home/alice/.config/cosmix/harness.toml",
]


@pytest.mark.parametrize("path", DISGUISES)
def test_every_disguise_of_a_forbidden_path_is_matched(path):
    assert forbidden_match([path], DEFAULT_FORBIDDEN) is not None


@pytest.mark.parametrize("path", [
    "_spec/2026-04-20-00-constitution.md\x00.txt",     # NUL
    "_spec/2026-04-20-00-constitution.md%00",           # an encoded NUL
    "_spec/2026-04-20-00-\u200dconstitution.md",       # a zero-width joiner
    "_spec/2026-04-20-00-constitution.md\n",           # a newline
    "%C3%28.md",                                        # an encoding that is not UTF-8
    "%2525252525",                                       # an encoding that does not settle
])
def test_a_path_without_a_canonical_form_is_refused(path):
    with pytest.raises(UncanonicalPath):
        canonical_path(path)
    assert uncanonical([path]) is not None
    assert forbidden_match([path], ()) == path  # and the guard fails closed on its own


def test_diff_paths_name_old_new_renamed_and_copied_files():
    diff = ("diff --git a/x.md b/y.md\nrename from x.md\nrename to y.md\n"
            "--- a/old.md\t2026-01-01\n+++ b/new.md\n--- /dev/null\n+++ b/added.md\n"
            "copy from c.md\ncopy to d.md\n")
    assert set(diff_paths(diff)) == {"x.md", "y.md", "old.md", "new.md", "added.md", "c.md",
                                     "d.md"}
