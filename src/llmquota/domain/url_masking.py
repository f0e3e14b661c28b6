"""Masking the credentials a URL carries, before the URL is shown.

Pure. A webhook URL may embed a credential: in its userinfo
(`https://user:secret@host/`) or in a query parameter (`?token=...`,
`?api_key=...`, `?sig=...`), as many receivers (Slack-style hooks, signed
URLs) expect. Listing webhooks must not hand those out to whoever holds the
admin key today, nor to logs and screenshots. So the password of the
userinfo becomes `***` (a user alone, with no password, is masked whole:
`https://TOKEN@host/` is a common way to pass a token), and so does the value
of every query or fragment parameter whose name looks like a credential.
Everything else is kept byte for byte (no re-encoding), so the URL still
tells the operator which receiver it is.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_plus, urlsplit, urlunsplit

MASK = "***"
# Parameter names that look like a credential: any name containing one of
# these (case-insensitive), e.g. token, access_token, api_key, apikey,
# client_secret, password, auth, X-Amz-Signature, sig, credential.
_CREDENTIAL_NAME = re.compile(r"token|secret|key|pass|pwd|auth|sig|credential", re.IGNORECASE)


def _masked_pairs(text: str) -> str:
    """`a=1&token=x` with the values of credential-like names masked."""
    pairs = []
    for pair in text.split("&"):
        name, equals, value = pair.partition("=")
        secret = equals and value and _CREDENTIAL_NAME.search(unquote_plus(name))
        pairs.append(f"{name}={MASK}" if secret else pair)
    return "&".join(pairs)


def mask_url(url: str) -> str:
    """The URL with its embedded credentials replaced by `***`."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK  # not a URL we can take apart: show none of it
    netloc = parts.netloc
    userinfo, at, host = netloc.rpartition("@")
    if at:
        user, colon, _password = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if colon else f"{MASK}@{host}"
    return urlunsplit(
        (
            parts.scheme,
            netloc,
            parts.path,
            _masked_pairs(parts.query),
            _masked_pairs(parts.fragment),
        )
    )
