"""The evidence boundary (core.boundary), pure: which answers are the service's own, which
count, and that no bytes anyone sends can make it raise."""

from __future__ import annotations

import base64

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from improved.core import boundary, signing
from improved.core.boundary import Attested, Conflict, Unattested
from improved.core.signing import TrustStore

SVC = "ranking"
SUBJECT = f"{SVC}.improve.measure"
INBOX = "_INBOX.abc.7"
OWN = Ed25519PrivateKey.generate()
AGENT = Ed25519PrivateKey.generate()
OTHER_SERVICE = Ed25519PrivateKey.generate()
STRANGER = Ed25519PrivateKey.generate()


def b64(key: Ed25519PrivateKey) -> str:
    return base64.b64encode(signing.raw_public(key.public_key())).decode()


SIGNERS = TrustStore.from_config({f"service:{SVC}": b64(OWN), f"agent:{SVC}:a": b64(AGENT),
                                  "service:search": b64(OTHER_SERVICE)})
BODY = b'{"value": 0.49}'


def attest(data: bytes, bound: bool = False, subject: str = SUBJECT, inbox: str = INBOX):
    return boundary.attest_reply(data, service=SVC, subject=subject, reply_to=inbox,
                                 signers=SIGNERS, bound=bound)


def test_the_services_own_signature_for_this_request_is_attested():
    said = attest(boundary.sign_reply(BODY, SUBJECT, INBOX, OWN))
    assert isinstance(said, Attested) and said.value == BODY
    assert (said.by, said.anchor) == (f"service:{SVC}", "signature")


def test_a_bare_answer_is_attested_only_where_subjects_are_bound():
    assert isinstance(attest(BODY), Unattested)
    assert attest(BODY).why == "unsigned, and the bus binds no service to its subjects"
    bound = attest(BODY, bound=True)
    assert isinstance(bound, Attested) and bound.anchor == "bound_subject"


def test_anyone_elses_signature_is_not_the_services():
    for key, who in ((AGENT, f"agent:{SVC}:a"), (OTHER_SERVICE, "service:search")):
        said = attest(boundary.sign_reply(BODY, SUBJECT, INBOX, key))
        assert isinstance(said, Unattested) and said.value == BODY
        assert said.why == f"signed by {who}, not service:{SVC}"
    unknown = attest(boundary.sign_reply(BODY, SUBJECT, INBOX, STRANGER))
    assert isinstance(unknown, Unattested) and "unknown_key" in unknown.why


def test_a_signed_answer_to_another_request_is_a_replay():
    old = boundary.sign_reply(BODY, SUBJECT, "_INBOX.abc.1", OWN)
    assert attest(old).why == "signed for another request (a replayed answer)"
    elsewhere = boundary.sign_reply(BODY, f"{SVC}.improve.apply", INBOX, OWN)
    assert isinstance(attest(elsewhere), Unattested)


def test_a_tampered_signed_answer_does_not_count():
    env = msgspec.json.decode(boundary.sign_reply(BODY, SUBJECT, INBOX, OWN))
    inner = msgspec.json.decode(base64.b64decode(env["payload"]))
    inner["body"] = {"value": 0.01}
    env["payload"] = base64.b64encode(msgspec.json.encode(inner)).decode()
    said = attest(msgspec.json.encode(env))
    assert isinstance(said, Unattested) and "bad_signature" in said.why
    assert said.value == b'{"value":0.01}'  # recorded for what it said, moving nothing


@given(st.binary(max_size=512))
def test_no_bytes_make_the_boundary_raise(data):
    assert isinstance(attest(data), Unattested)
    assert isinstance(boundary.attest_report(data, service=SVC, signers=SIGNERS, bound=False),
                      Unattested)


def text(most: int) -> st.SearchStrategy[str]:
    """Text JSON can carry (no lone surrogates, which UTF-8 cannot encode)."""
    return st.text(st.characters(exclude_categories=("Cs",)), max_size=most)


@given(st.dictionaries(st.sampled_from(["payloadType", "payload", "signatures", "x"]),
                       st.one_of(text(40), st.lists(st.dictionaries(
                           st.sampled_from(["keyid", "sig"]), text(20))))))
def test_no_envelope_shaped_junk_makes_it_raise(env):
    env.setdefault("payloadType", boundary.REPLY_TYPE)
    assert isinstance(attest(msgspec.json.encode(env)), Unattested)


def test_an_attested_answer_counts_over_an_earlier_unattested_one():
    first = Unattested(b"0.01", "unsigned")
    own = Attested(b"0.49", f"service:{SVC}", "signature")
    assert boundary.choose([first, own]) is own
    assert boundary.counting([first, own], attestable=True) is own
    assert boundary.settled([first]) is False and boundary.settled([first, own]) is True


def test_attested_answers_that_disagree_are_a_conflict_and_agreeing_ones_one_answer():
    a = Attested(b"0.49", f"service:{SVC}", "signature")
    b = Attested(b"0.01", f"service:{SVC}", "bound_subject")
    conflict = boundary.choose([a, b])
    assert isinstance(conflict, Conflict) and conflict.answers == (a, b)
    assert boundary.choose([a, Attested(b"0.49", f"service:{SVC}", "signature")]) is a


def test_with_nothing_attestable_the_first_answer_is_taken_and_recorded_unattested():
    first, second = Unattested(b"1", "unsigned"), Unattested(b"2", "unsigned")
    assert boundary.choose([first, second]) is first
    assert boundary.counting([first, second], attestable=False) is first
    assert boundary.counting([first, second], attestable=True) is None
    assert boundary.choose([]) is None and boundary.counting([], attestable=False) is None


def test_a_service_can_be_attested_by_a_key_bound_to_it_or_by_bound_subjects():
    assert boundary.can_attest(SVC, SIGNERS, bound=False)
    assert not boundary.can_attest("docs", SIGNERS, bound=False)  # an agent's key is no help
    assert boundary.can_attest("docs", SIGNERS, bound=True)


def test_a_report_counts_signed_by_its_service_or_on_a_bound_subject():
    report = b'{"proposal_id": "x", "service": "ranking", "ok": true}'
    signed = boundary.attest_report(boundary.sign_report(report, OWN), service=SVC,
                                    signers=SIGNERS, bound=False)
    assert isinstance(signed, Attested) and signed.value == report
    assert isinstance(boundary.attest_report(report, service=SVC, signers=SIGNERS,
                                             bound=False), Unattested)
    by_agent = boundary.attest_report(boundary.sign_report(report, AGENT), service=SVC,
                                      signers=SIGNERS, bound=False)
    assert isinstance(by_agent, Unattested) and by_agent.value == report
    assert isinstance(boundary.attest_report(report, service=SVC, signers=SIGNERS,
                                             bound=True), Attested)


def test_evidence_keeps_its_attribution_through_a_decode():
    said = Attested(b'{"value": 1}', f"service:{SVC}", "signature", "ed25519:x")
    decoded = said.map(msgspec.json.decode)
    assert decoded == Attested({"value": 1}, f"service:{SVC}", "signature", "ed25519:x")
    assert Unattested(b"1", "why").map(int) == Unattested(1, "why")
    assert boundary.present([said.map(lambda _: None), said]) == [said]
