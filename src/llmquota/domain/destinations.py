"""Where a webhook may be sent: the address rules of our SSRF defence.

Pure. A webhook URL is chosen by whoever holds an admin key, and the server
then POSTs to it from inside the network: a URL that reaches loopback, a
private network or the cloud metadata address turns alert delivery into a
request forger. So every address a delivery would connect to is checked
here, in every spelling an address has: IPv4, IPv6, and the IPv6 forms that
carry an IPv4 address inside (IPv4-mapped `::ffff:a.b.c.d`, IPv4-compatible
`::a.b.c.d`, NAT64 `64:ff9b::/96` and `64:ff9b:1::/48`, 6to4 `2002::/16`,
Teredo), each of which a kernel or a NAT64 gateway may route to the IPv4
address it embeds.

Receivers beside the service (on-premise) are allowed by naming their
networks (`LLMQUOTA_WEBHOOK_ALLOWED_NETWORKS`); link-local addresses (cloud
metadata), unspecified and multicast ones never are, and neither is the
service's own listening address.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from llmquota.domain.errors import InvalidRequest

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Cloud metadata lives at link-local addresses: never a receiver of ours.
_LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
# Names that mean this machine whatever a resolver says (RFC 6761).
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
_LOOPBACK_ADDRESSES = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))


@dataclass(frozen=True, slots=True)
class DestinationRules:
    """What a delivery may connect to: the allowed private networks and the
    (host, port) pairs where this service itself listens."""

    allowed_networks: tuple[IPNetwork, ...] = ()
    own: tuple[tuple[str, int], ...] = ()


def parse_networks(value: str) -> tuple[IPNetwork, ...]:
    """A comma-separated list of CIDR networks (`10.0.0.0/8, fd00::/8`)."""
    networks: list[IPNetwork] = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError as exc:
            raise InvalidRequest(f"not a network in CIDR form: {item!r}") from exc
    return tuple(networks)


def normalise_host(host: str) -> str:
    """A host as it is compared: lower case, no brackets, no zone, no trailing dots
    (`LOCALHOST.` and `localhost` are the same name to a resolver)."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    host = host.split("%", 1)[0]
    return host.rstrip(".")


def literal_address(host: str) -> IPAddress | None:
    """The IP address a host is, when it is written as one; None for a name."""
    try:
        return ipaddress.ip_address(normalise_host(host))
    except ValueError:
        return None


def is_loopback_name(host: str) -> bool:
    """`localhost` and its subdomains (RFC 6761), in any spelling."""
    name = normalise_host(host)
    return name in _LOOPBACK_NAMES or name.endswith(".localhost")


def embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries and may be routed to, if any."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    packed = int(address)
    if any(address in network for network in _NAT64):
        return ipaddress.IPv4Address(packed & 0xFFFFFFFF)
    # IPv4-compatible (deprecated, still routed by some stacks); :: and ::1 are
    # their own addresses, not 0.0.0.0 and 0.0.0.1.
    if address in _IPV4_COMPATIBLE and packed > 1:
        return ipaddress.IPv4Address(packed & 0xFFFFFFFF)
    return None


def _judged_form(address: IPAddress) -> IPAddress:
    """The form of an address its rules apply to: the IPv4 address an IPv6 one
    embeds (the wrapper ranges themselves say nothing about where it goes)."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = embedded_ipv4(address)
        if inner is not None:
            return inner
    return address


def _kind(address: IPAddress) -> str | None:
    """The rule a non-public address falls under, or None for a public one."""
    if any(address in network for network in _LINK_LOCAL):
        return "link-local (cloud metadata)"
    if address.is_unspecified:
        return "unspecified"
    if address.is_multicast:
        return "multicast"
    if address.is_loopback:
        return "loopback"
    if address.is_private:
        return "private"
    if not address.is_global:
        return "reserved (not globally routable)"
    return None


# Kinds no allow-list can open: nothing legitimate listens there.
_NEVER_ALLOWED = frozenset({"link-local (cloud metadata)", "unspecified", "multicast"})


def address_problem(address: IPAddress | str, rules: DestinationRules) -> str | None:
    """Why a delivery may not connect to `address`, or None when it may.

    An IPv6 address that embeds an IPv4 one is judged by the IPv4 address it
    carries. A non-public address passes only when it lies in an allowed
    network and is not of a kind that no allow-list opens.
    """
    if isinstance(address, str):
        parsed = literal_address(address)
        if parsed is None:
            return f"{address!r} is not an IP address"
        address = parsed
    form = _judged_form(address)
    shown = str(address) if form == address else f"{address} ({form})"
    kind = _kind(form)
    if kind is None:
        return None
    if kind in _NEVER_ALLOWED:
        return f"{shown}: {kind} address, never a webhook receiver"
    if any(
        form.version == network.version and form in network for network in rules.allowed_networks
    ):
        return None
    return (
        f"{shown}: {kind} address, not in LLMQUOTA_WEBHOOK_ALLOWED_NETWORKS "
        "(the setting that allows on-premise receivers)"
    )


def is_own_address(host: str, port: int, own: Iterable[tuple[str, int]]) -> bool:
    """Whether (host, port) is where this service listens: the same port at its
    own address, or at this machine when it listens there or on every address."""
    name = normalise_host(host)
    for own_host, own_port in own:
        if port != own_port:
            continue
        own_name = normalise_host(own_host)
        if name == own_name:
            return True
        if _means_this_machine(name) and (own_name == "" or _means_this_machine(own_name)):
            return True
    return False


def _means_this_machine(host: str) -> bool:
    """Loopback in any spelling, or the unspecified address (which connects to it)."""
    if is_loopback_name(host):
        return True
    address = literal_address(host)
    if address is None:
        return False
    form = _judged_form(address)
    return form.is_loopback or form.is_unspecified


def connect_problem(
    host: str, port: int, addresses: Iterable[IPAddress | str], rules: DestinationRules
) -> str | None:
    """Why a delivery to `host` may not connect to any of the addresses it resolved
    to, or None. A name that resolves to nothing is a problem too: the delivery
    is retried later."""
    checked = list(addresses)
    if is_loopback_name(host):
        checked = [*checked, *_LOOPBACK_ADDRESSES]
    if not checked:
        return f"{host} does not resolve"
    for address in checked:
        problem = address_problem(address, rules)
        if problem is not None:
            return problem
        if is_own_address(str(address), port, rules.own):
            return f"{address}:{port} is this service's own listening address"
    if is_own_address(host, port, rules.own):
        return f"{host}:{port} is this service's own listening address"
    return None
