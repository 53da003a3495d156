"""`pulls.delivery` reads a JetStream delivery's reply subject as nats-py's `Msg.metadata`
does (the stream, the stream sequence, what is still pending), for both forms the server
writes, and says None of whatever is no delivery's, where nats-py raises."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError

from improved.client.pulls import Delivery, delivery

TOKEN = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126,
                                       blacklist_characters=".*>"), min_size=1, max_size=12)
NUMBER = st.integers(min_value=0, max_value=2**63 - 1)


@given(TOKEN, TOKEN, NUMBER, NUMBER, NUMBER, NUMBER, NUMBER)
def test_the_first_form_reads_as_nats_py_reads_it(stream, consumer, delivered, seq, cseq, ts,
                                                   pending):
    reply = f"$JS.ACK.{stream}.{consumer}.{delivered}.{seq}.{cseq}.{ts}.{pending}"
    meta = Msg.Metadata._from_reply(reply)
    assert delivery(reply) == Delivery(meta.stream, meta.sequence.stream, meta.num_pending) \
        == Delivery(stream, seq, pending)


@given(TOKEN, TOKEN, TOKEN, TOKEN, NUMBER, NUMBER, NUMBER, NUMBER, NUMBER, st.booleans())
def test_the_form_with_a_domain_reads_as_nats_py_reads_it(domain, account, stream, consumer,
                                                          delivered, seq, cseq, ts, pending,
                                                          token):
    reply = (f"$JS.ACK.{domain}.{account}.{stream}.{consumer}.{delivered}.{seq}.{cseq}.{ts}."
             f"{pending}" + (".abc" if token else ""))
    meta = Msg.Metadata._from_reply(reply)
    assert delivery(reply) == Delivery(meta.stream, meta.sequence.stream, meta.num_pending) \
        == Delivery(stream, seq, pending)


@pytest.mark.parametrize("reply", [
    None, "", "_INBOX.abc", "$JS.ACK", "$JS.ACK.S.c.1.2.3.4",  # too few tokens
    "$JS.ACK.S.c.1.x.3.4.5",  # a sequence that is no number
    "$JS.API.CONSUMER.MSG.NEXT.S.c.1.2.3", "$JS.ACKS.S.c.1.2.3.4.5",
])
def test_what_is_no_delivery_reads_as_none(reply):
    assert delivery(reply) is None
    with pytest.raises((NotJSMessageError, ValueError)):
        Msg.Metadata._from_reply(reply)
