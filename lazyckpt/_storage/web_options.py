"""The `storage_options` of a URL over HTTP(S): `headers` and a `token` (sent as
`Authorization: Bearer TOKEN`) of its own, for `lazyckpt._storage.web`.

They go to the URL's own origin only, never to a redirect target elsewhere (a signed
CDN address), as the Hub's token does (`lazyckpt._storage.ranges`). They are checked
before any request, and errors name the bad key, never a value (it may be a secret).
A `WebFiles` takes its headers when it is made, at open, so a tree keeps sending its
own whatever a later open of the same folder passes.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator, Mapping
from typing import Any

from lazyckpt._errors import LazyTypeError
from lazyckpt._text import printable

ACCEPTED = ("headers", "token")
"""The `storage_options` keys an http(s):// URL takes."""

RESERVED = frozenset(
    {
        "accept-encoding",
        "connection",
        "content-length",
        "expect",
        "host",
        "if-match",
        "if-modified-since",
        "if-none-match",
        "if-range",
        "if-unmodified-since",
        "keep-alive",
        "proxy-connection",
        "range",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "user-agent",
    }
)
"""Headers lazyckpt sets itself (ranges, version checks, framing): a caller's would
break what a read checks, so they are refused."""

_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""A header name (RFC 9110's token)."""
_VALUE = re.compile(r"[\t\x20-\x7e]*")
"""A header value: visible ASCII, spaces and tabs; no CR or LF, which would end it."""
_BEARER = re.compile(r"[\x21-\x7e]+")

_OPTIONS: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "lazyckpt_web_options", default=None
)


@contextlib.contextmanager
def session(options: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Within: `options` apply to http(s):// URLs (an inner session without options
    keeps the outer one's)."""
    given = _OPTIONS.set(dict(options) if options else _OPTIONS.get())
    try:
        yield
    finally:
        _OPTIONS.reset(given)


def refuse_for(path: str, fix: str) -> None:
    """Refuse `headers` and `token` in the call in progress for `path`, which is no
    http(s):// URL (`fix` says where its credentials come from)."""
    options = _OPTIONS.get() or {}
    given = [key for key in ACCEPTED if key in options]
    if given:
        raise LazyTypeError(f"{path}: storage_options {given} are for https:// URLs; {fix}")


def headers(url: str) -> dict[str, str]:
    """What requests for `url` send to its origin, from the `storage_options` of the
    call in progress; options an http(s):// URL does not take are refused by name."""
    options = _OPTIONS.get() or {}
    unknown = sorted(str(key) for key in options if key not in ACCEPTED)
    if unknown:
        raise LazyTypeError(
            f"{url}: storage_options for an http(s):// URL take {list(ACCEPTED)}, not "
            f"{[printable(key) for key in unknown]}; endpoint, region, retries and tensorstore "
            "options are for s3:// and gs:// paths (deadlines and retries over HTTP are "
            "lazyckpt.network_options)"
        )
    found: dict[str, str] = {}
    extra = options.get("headers", {})
    if not isinstance(extra, Mapping):
        raise LazyTypeError(
            f"{url}: storage_options['headers'] takes a dict of header names to values, not "
            f"a {type(extra).__name__}; pass storage_options={{'headers': {{'X-Api-Key': '...'}}}}"
        )
    for name, value in extra.items():
        found[_checked(url, name, value)] = value
    if "token" in options:
        found["Authorization"] = f"Bearer {_token(url, options['token'], found)}"
    return found


def _checked(url: str, name: object, value: object) -> str:
    """`name`, where it and `value` make a header lazyckpt may send."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        shown = printable(name) if isinstance(name, str) else type(name).__name__
        raise LazyTypeError(
            f"{url}: storage_options['headers'] has a key {shown!r} that is no header name "
            "(letters, digits and !#$%&'*+-.^_`|~ only); remove it or spell the name"
        )
    if name.lower() in RESERVED:
        raise LazyTypeError(
            f"{url}: storage_options['headers'] sets {name!r}, which lazyckpt sets itself "
            "to read byte ranges and check versions; remove it"
        )
    if not isinstance(value, str) or not _VALUE.fullmatch(value):
        found = "text with a CR, LF or other control or non-ASCII character"
        raise LazyTypeError(
            f"{url}: storage_options['headers'][{name!r}] takes text of visible ASCII "
            f"characters, spaces and tabs, not "
            f"{found if isinstance(value, str) else 'a ' + type(value).__name__}; "
            "fix the value (it is not shown here)"
        )
    return name


def _token(url: str, token: object, found: Mapping[str, str]) -> str:
    if not isinstance(token, str) or not _BEARER.fullmatch(token):
        if not isinstance(token, str):
            kind = f"a {type(token).__name__}"
        else:
            kind = (
                "empty text" if not token else "text with a space, control or non-ASCII character"
            )
        raise LazyTypeError(
            f"{url}: storage_options['token'] takes a bearer token, non-empty visible ASCII "
            f"text, not {kind}; fix the token (it is not shown here)"
        )
    if any(name.lower() == "authorization" for name in found):
        raise LazyTypeError(
            f"{url}: storage_options has both a 'token' and an Authorization header; give "
            "one (the token is sent as 'Authorization: Bearer TOKEN')"
        )
    return token
