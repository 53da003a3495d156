"""What the owning service's answers say: its reply to an ApplyOrder, an LKG check and a
MeasureRequest, read strictly, and why the answers to one attempt gave nothing to take.

Pure: the shell sends the request and hears the answers (`runtime.asking`); this module only
reads them, so that a malformed, hostile or error reply is a value here, never an exception.
"""

from __future__ import annotations

from typing import Any

import msgspec

from improved.core import apply as apply_stage
from improved.core import boundary, learnback, lkg
from improved.core.audit import REASON_LIMIT
from improved.protocol.model import ApplyResult, MeasureReply

apply_result_decoder = msgspec.json.Decoder(ApplyResult)
measure_reply_decoder = msgspec.json.Decoder(MeasureReply)


def unanswered(subject: str, heard: list[boundary.Evidence[bytes]],
                parsed: list[boundary.Evidence[Any]]) -> tuple[str, bool]:
    """Why the answers heard to one attempt gave nothing to take, and whether the service
    may have received the order all the same: a "not now" (an error reply) it may be
    trusted to have said refuses this attempt; anything else is as good as silence."""
    for raw, answer in zip(heard, parsed, strict=True):
        if answer.value is None and (isinstance(raw, boundary.Attested) or not any(
                isinstance(h, boundary.Attested) for h in heard)):
            return f"{subject} answered not now: {error_message(raw.value)}", False
    why = "; ".join(sorted({h.why for h in heard if isinstance(h, boundary.Unattested)}))
    return (f"{subject} was answered only by parties it cannot attribute to the service "
            f"({why})"), True


def parse_apply_reply(data: bytes) -> ApplyResult | None:
    """The service's ApplyResult (`ok: false` is final: the service refused); None for an
    error reply (DESIGN §3.1: the service could not process it now), which is retried; and
    anything else a failed result."""
    try:
        return apply_stage.recordable(apply_result_decoder.decode(data))
    except msgspec.MsgspecError as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    try:
        if isinstance(msgspec.json.decode(data).get("error"), dict):
            return None
    except (msgspec.MsgspecError, AttributeError):
        pass
    return ApplyResult(ok=False, error=(f"the service answered with something that is not an "
                                        f"ApplyResult: {why}")[:REASON_LIMIT])


def parse_lkg_reply(data: bytes) -> lkg.LkgReport | None:
    """The service's LKG report; None for an error reply (retried); anything else a report
    that confirms nothing."""
    try:
        return lkg.report_decoder.decode(data)
    except msgspec.MsgspecError:
        pass
    if parse_apply_reply(data) is None:  # an error reply: not now
        return None
    return lkg.LkgReport(ok=False, error="the service answered something that is not an LKG "
                         "report")


def parse_measure_reply(data: bytes) -> learnback.Reading:
    """The service's answer to a MeasureRequest, strictly: `{"value": number}` is a reading;
    an error reply, or anything else, is none, with the cause (never an exception)."""
    try:
        return learnback.Reading(value=measure_reply_decoder.decode(data).value)
    except msgspec.MsgspecError as exc:
        problem = str(exc)
    try:
        if isinstance(msgspec.json.decode(data).get("error"), dict):
            return learnback.Reading(cause=f"the service could not measure: "
                                     f"{error_message(data)}")
    except (msgspec.MsgspecError, AttributeError):
        pass
    return learnback.Reading(cause=f"the service answered a malformed reply: {problem}"[:300])


def error_message(data: bytes) -> str:
    try:
        err = msgspec.json.decode(data)["error"]
        return str(err.get("message") or err.get("code"))[:300]
    except (msgspec.MsgspecError, KeyError, TypeError, AttributeError):
        return "error reply"
