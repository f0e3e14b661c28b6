"""The pure rules of quotas and webhooks: globs, zones, SSRF, signatures."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from llmquota.domain.alerts import (
    check_webhook_url,
    signature,
    verify_signature,
)
from llmquota.domain.destinations import (
    DestinationRules,
    address_problem,
    connect_problem,
    is_loopback_name,
    is_own_address,
    parse_networks,
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


def test_alert_fractions_are_in_zero_one_and_stored_increasing() -> None:
    assert [str(a) for a in check_alerts([0.25, 1])] == ["0.25", "1"]
    # A set of thresholds (no schema can ask for "increasing"): sorted, each once.
    assert [str(a) for a in check_alerts([1, 0.5, 0.25, 0.5])] == ["0.25", "0.5", "1"]
    for bad in ([1.01], [-0.1], [True], [float("nan")]):
        with pytest.raises(InvalidRequest, match="alerts"):
            check_alerts(bad)


@pytest.mark.parametrize(
    ("address", "rule"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("::127.0.0.1", "loopback"),  # IPv4-compatible
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("10.1.2.3", "private"),
        ("192.168.0.1", "private"),
        ("fd12:3456::1", "private"),  # unique-local
        ("64:ff9b::a00:1", "private"),  # NAT64 of 10.0.0.1
        ("100.64.0.1", "not globally routable"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("::ffff:169.254.1.1", "link-local"),
        ("::169.254.169.254", "link-local"),
        ("64:ff9b::a9fe:a9fe", "link-local"),  # NAT64 of the metadata address
        ("2001:0:4136:e378:8000:63bf:5601:5afe", "link-local"),  # Teredo of 169.254.x
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
    ],
)
def test_every_form_of_a_non_public_address_is_refused(address: str, rule: str) -> None:
    problem = address_problem(address, DestinationRules())
    assert problem is not None and rule in problem


def test_public_addresses_pass_and_the_allow_list_opens_private_ones_only() -> None:
    for public in ("93.184.216.34", "2606:2800:220:1::1", "64:ff9b::808:808"):
        assert address_problem(public, DestinationRules()) is None
    allowed = DestinationRules(parse_networks("127.0.0.0/8, 10.0.0.0/8"))
    assert address_problem("127.0.0.1", allowed) is None
    assert address_problem("::ffff:10.9.9.9", allowed) is None  # judged by the IPv4 inside
    assert address_problem("192.168.0.1", allowed) is not None
    assert address_problem("::1", allowed) is not None  # 127/8 says nothing of IPv6
    for never in ("169.254.169.254", "0.0.0.0", "224.0.0.1"):
        assert "never" in (address_problem(never, allowed) or "")
    with pytest.raises(InvalidRequest, match="CIDR"):
        parse_networks("10.0.0.0/8, not-a-network")


def test_names_for_this_machine_and_own_addresses_in_any_spelling() -> None:
    for name in (
        "localhost",
        "LOCALHOST.",
        "localhost..",
        "api.localhost",
        "localhost.localdomain",
    ):
        assert is_loopback_name(name), name
    assert not is_loopback_name("localhost.example.com")
    own = [("0.0.0.0", 8080)]
    for host in ("127.0.0.1", "localhost", "localhost.", "::ffff:127.0.0.1", "[::1]", "0.0.0.0"):
        assert is_own_address(host, 8080, own), host
    assert not is_own_address("127.0.0.1", 8081, own)
    rules = DestinationRules(parse_networks("127.0.0.0/8"), (("127.0.0.1", 8080),))
    assert check_webhook_url("http://127.0.0.1:8081/hook", rules) == "http://127.0.0.1:8081/hook"
    for url in (
        "http://localhost:8080/hook",
        "http://[::ffff:127.0.0.1]:8080/",
        "http://localhost.:8080/",
    ):
        with pytest.raises(InvalidRequest, match="own listening address"):
            check_webhook_url(url, rules)
    with pytest.raises(InvalidRequest, match="loopback"):
        check_webhook_url("http://localhost.:9/hook")  # no allow-list: loopback refused


def test_a_name_is_refused_when_any_address_it_resolves_to_is() -> None:
    rules = DestinationRules()
    assert connect_problem("hooks.example", 443, ["93.184.216.34"], rules) is None
    problem = connect_problem("hooks.example", 443, ["93.184.216.34", "10.0.0.1"], rules)
    assert problem is not None and "private" in problem
    assert "does not resolve" in (connect_problem("hooks.example", 443, [], rules) or "")


def test_the_signature_is_hmac_sha256_of_timestamp_dot_body() -> None:
    body = b'{"id":"x"}'
    header = signature("s" * 16, 1_700_000_000, body)
    mac = hmac.new(b"s" * 16, b"1700000000." + body, hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={mac}"
    assert verify_signature("s" * 16, header, body)
    assert not verify_signature("s" * 16, header, body + b" ")
    assert not verify_signature("s" * 16, "garbage", body)
