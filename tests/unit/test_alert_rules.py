"""The pure rules of quotas and webhooks: globs, zones, SSRF, signatures."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from llmquota.domain.alerts import (
    check_webhook_url,
    forbidden_address,
    is_own_address,
    signature,
    verify_signature,
)
from llmquota.domain.errors import InvalidRequest
from llmquota.domain.quotas import check_alerts, check_amount, check_timezone, glob_to_like


def test_globs_become_like_patterns_with_like_characters_escaped() -> None:
    assert glob_to_like("gpt-4o*") == "gpt-4o%"
    assert glob_to_like("o1_mini") == "o1\\_mini"
    assert glob_to_like("100%*") == "100\\%%"
    assert glob_to_like("a\\b") == "a\\\\b"


def test_zones_are_iana_names_only() -> None:
    assert check_timezone("America/New_York") == "America/New_York"
    for bad in ("localtime", "posixrules", "../../etc/passwd", "/UTC", "Nowhere/Place", ""):
        with pytest.raises(InvalidRequest, match="timezone"):
            check_timezone(bad)


def test_amounts_are_positive_decimal_strings() -> None:
    assert str(check_amount("amount", "0.000000000001")) == "1E-12"
    for bad in ("-1", "1e3", " 1", "1.", ".5", "NaN", "Infinity", "0"):
        with pytest.raises(InvalidRequest, match="amount"):
            check_amount("amount", bad)


def test_alert_fractions_are_in_zero_one_and_increasing() -> None:
    assert [str(a) for a in check_alerts([0.25, 1])] == ["0.25", "1"]
    for bad in ([0.5, 0.5], [1.01], [-0.1], [True], [float("nan")]):
        with pytest.raises(InvalidRequest, match="alerts"):
            check_alerts(bad)


def test_link_local_and_own_addresses_are_refused_loopback_and_private_allowed() -> None:
    assert forbidden_address("169.254.169.254") is not None
    assert forbidden_address("fe80::1%eth0") is not None
    assert forbidden_address("::ffff:169.254.1.1") is not None
    assert forbidden_address("10.0.0.1") is None
    assert forbidden_address("receiver.internal") is None
    own = [("0.0.0.0", 8080)]
    assert is_own_address("127.0.0.1", 8080, own)
    assert is_own_address("localhost", 8080, own)
    assert not is_own_address("127.0.0.1", 8081, own)
    assert check_webhook_url("http://127.0.0.1:8081/hook", own) == "http://127.0.0.1:8081/hook"
    with pytest.raises(InvalidRequest, match="own listening address"):
        check_webhook_url("http://localhost:8080/hook", own)


def test_the_signature_is_hmac_sha256_of_timestamp_dot_body() -> None:
    body = b'{"id":"x"}'
    header = signature("s" * 16, 1_700_000_000, body)
    mac = hmac.new(b"s" * 16, b"1700000000." + body, hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={mac}"
    assert verify_signature("s" * 16, header, body)
    assert not verify_signature("s" * 16, header, body + b" ")
    assert not verify_signature("s" * 16, "garbage", body)
