"""The policy principal for the namespace (OMS rule 8, issue 34): `[policy.principals]` maps
namespace globs to `policy:NAME`; an auto-apply runs under the principal of its proposal's
namespace, the global `policy_principal` where none matches. A bad table is one line naming
the key; the order the file lists globs in never changes who applies."""

from __future__ import annotations

import tomllib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.client.config import parse
from improved.client.connection import ConfigError
from improved.core import apply, policy
from improved.core.policy import Policy, principal_of
from improved.core.propose import identify, register
from improved.protocol import canonical
from improved.testing import rank_proposal


def parsed(text: str) -> Policy:
    return parse(tomllib.loads(text)).policy


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        parse(tomllib.loads(text))
    return str(caught.value)


def test_the_table_is_read_as_written():
    p = parsed('[policy]\npolicy_principal = "policy:auto"\n'
               '[policy.principals]\n"kb:*" = "policy:kb"\n"agent:recommendations" = '
               '"policy:recs"\n')
    assert p.principals == {"kb:*": "policy:kb", "agent:recommendations": "policy:recs"}
    assert parsed("").principals == {}


@pytest.mark.parametrize(("toml", "line"), [
    ('[policy.principals]\n"kb:*" = "operator:alice"',
     'config error: policy.principals."kb:*": expected a policy principal, policy:NAME (NAME '
     "of letters, digits and ._@+-), got 'operator:alice'"),
    ('[policy.principals]\n"kb:*" = "policy:"',
     'config error: policy.principals."kb:*": expected a policy principal, policy:NAME (NAME '
     "of letters, digits and ._@+-), got 'policy:'"),
    ('[policy.principals]\nkb = "policy:kb\\n"',
     "config error: policy.principals.kb: expected a policy principal, policy:NAME (NAME of "
     "letters, digits and ._@+-), got 'policy:kb\\n'"),
    ('[policy.principals]\n"kb:*" = 5',
     'config error: policy.principals."kb:*": expected str, got int'),
    ('[policy]\nprincipals = "policy:kb"',
     "config error: policy.principals: expected table, got str"),
    ('[policy.principals]\n"" = "policy:kb"',
     "config error: policy.principals: expected a namespace glob (* and ?), 1-256 characters, "
     "got {'': 'policy:kb'}"),
])
def test_a_bad_entry_is_one_line_naming_the_key(toml, line):
    said = error_of(toml)
    assert said == line and "\n" not in said


def test_the_namespaces_principal_and_the_global_one_elsewhere():
    table = {"kb:*": "policy:kb", "kb:private": "policy:private", "kb:pri*": "policy:pri"}
    assert principal_of(table, "policy:auto", "kb:prefs") == "policy:kb"
    assert principal_of(table, "policy:auto", "kb:private") == "policy:private"  # exact
    assert principal_of(table, "policy:auto", "kb:prize") == "policy:pri"  # longest glob
    for outside in ("kb", "KB:prefs", "xkb:prefs", " kb:prefs", "agent:recommendations"):
        assert principal_of(table, "policy:auto", outside) == "policy:auto", outside
    assert principal_of(table, "policy:auto", None) == "policy:auto"
    assert principal_of({"kb:?": "policy:one"}, "policy:auto", "kb:a") == "policy:one"
    assert principal_of({"kb:?": "policy:one"}, "policy:auto", "kb:ab") == "policy:auto"
    assert principal_of({"a.b": "policy:dot"}, "policy:auto", "axb") == "policy:auto"


globs = st.lists(st.from_regex(r"[a-z:*?]{1,6}", fullmatch=True), min_size=1, max_size=6,
                 unique=True)


@settings(max_examples=300, deadline=None)
@given(globs=globs, namespace=st.from_regex(r"[a-z:]{0,6}", fullmatch=True),
       order=st.randoms(use_true_random=False))
def test_the_order_the_file_lists_globs_in_never_changes_the_principal(globs, namespace,
                                                                        order):
    table = {g: f"policy:p{i}" for i, g in enumerate(globs)}
    shuffled = list(table.items())
    order.shuffle(shuffled)
    assert (principal_of(table, "policy:auto", namespace)
            == principal_of(dict(shuffled), "policy:auto", namespace))


def test_an_auto_apply_is_dispatched_under_its_namespaces_principal():
    """The authority the dispatch trailer records and the ApplyOrder carries."""
    pol = Policy(principals={"kb:*": "policy:kb"})
    for namespace, who in (("kb:prefs", "policy:kb"), ("other", "policy:auto"),
                           (None, "policy:auto")):
        p = rank_proposal("recs", namespace=namespace)
        pid, dedup = identify(p)
        record, _ = register(p, pid, dedup, pol, 0)
        assert apply.authority(record, pol) == who
        assert apply.order(record, pol, 1).authority == who
        assert f"authority:{who}" in apply.dispatch(record, pol, "improved:1").refs


def test_the_table_is_on_the_policy_chain_and_an_empty_one_changes_no_digest():
    pol = Policy(principals={"kb:*": "policy:kb"})
    assert policy.differences(pol) == {"principals": {"kb:*": "policy:kb"}}
    assert "principals" in " ".join(policy.draft(pol, "improved:1").refs)
    assert policy.digest(pol) != policy.digest(Policy())
    # the digest of a policy without the table is the one recorded before the table existed
    without = msgspec.to_builtins(policy.effective(Policy()))
    without.pop("principals")
    assert policy.digest(Policy()) == canonical.digest(without)
    assert policy.differences(Policy()) == {}
