"""ETags and If-Match for the policy resources (RFC 9110, strong comparison).

A policy's ETag is its policy_version in the database: every write takes the
next number of one sequence, so two workers show the same tag for the same
row and no two contents share one. The check against If-Match is made in the
write's own statement (sql/plans.sql, lq_policy_precondition), never here.
"""

from __future__ import annotations

from fastapi import Request, Response

from llmquota.domain.errors import InvalidRequest


def etag(version: int) -> str:
    """The header value of a policy version: a strong validator, quoted."""
    return f'"{version}"'


def set_etag(response: Response, version: int) -> None:
    response.headers["ETag"] = etag(version)


def if_match(request: Request) -> list[str] | None:
    """The versions If-Match accepts ("*": any existing), or None without the header.

    Weak tags (W/"...") never match under strong comparison, so they are
    dropped; a header of nothing else matches no version at all.
    """
    header = request.headers.get("if-match")
    if header is None:
        return None
    tags: list[str] = []
    for part in header.split(","):
        tag = part.strip()
        if tag == "*":
            tags.append("*")
        elif tag.startswith('"') and tag.endswith('"') and len(tag) >= 2:
            tags.append(tag[1:-1])
        elif not tag.startswith("W/"):
            raise InvalidRequest(f"If-Match: {tag!r} is not a quoted entity tag or *")
    return tags
