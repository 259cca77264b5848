"""What requests for a URL over HTTP(S) send besides its place, for
`lazyckpt._storage.http.web`: the `storage_options` of the call (`headers`, and a `token`
sent as `Authorization: Bearer TOKEN`), and what the URL itself carried (`given`): a
user name and password, sent as HTTP Basic auth, and a query string (a pre-signed
file's signature, `?X-Amz-Signature=...`), sent with each request for that file.

Headers and credentials go to the URL's own origin only, never to a redirect target
elsewhere (a signed CDN address), as the Hub's token does (`lazyckpt._storage.http.range_reads`).
They are checked before any request, and errors name the bad key, never a value (it
may be a secret); nor is a URL's password or query ever shown (`lazyckpt._display`).
A `WebFiles` takes its headers and queries when it is made, at open, so a tree keeps
sending its own whatever a later open of the same folder passes.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import re
import urllib.parse
from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from lazyckpt import _display
from lazyckpt._errors import CheckpointNotFoundError, LazyTypeError, StorageAccessError
from lazyckpt._storage.folders import SINGLE_FILES
from lazyckpt._storage.http.transport import host
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
_HOST_ENDS = re.compile(r"[/?#\\]")
"""What ends a URL's host and the user name and password before it (`given`)."""
_UNSENDABLE = re.compile(r"[^\x21-\x7e]")
"""What a query string cannot send as it is: a space, a control character (one that
`urllib.parse` would drop, a tab or newline, too) or a non-ASCII character."""

_OPTIONS: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "lazyckpt_web_options", default=None
)


@attrs.frozen
class _Carried:
    """What the URLs given in a call carried besides their places (`given`)."""

    authorization: dict[tuple[str, str], str] = attrs.field(factory=dict)
    """`Authorization: Basic ...` from a URL's user name and password, by origin."""
    queries: dict[str, str] = attrs.field(factory=dict)
    """A URL's query string, by its place: sent with the requests for it alone."""


_CARRIED: contextvars.ContextVar[_Carried | None] = contextvars.ContextVar(
    "lazyckpt_carried", default=None
)


@contextlib.contextmanager
def session(options: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Within: `options` apply to http(s):// URLs (an inner session without options
    keeps the outer one's), and so does what the URLs given in it carried (an inner
    session sees the outer one's, the outer none of the inner one's)."""
    given = _OPTIONS.set(dict(options) if options else _OPTIONS.get())
    outer = _CARRIED.get() or _Carried()
    carried = _CARRIED.set(_Carried(dict(outer.authorization), dict(outer.queries)))
    try:
        yield
    finally:
        _CARRIED.reset(carried)
        _OPTIONS.reset(given)


def given(url: str) -> str:
    """The place an http(s):// URL names (its scheme, host, port and path) without
    what it carries besides, which the call in progress sends and no message shows
    (`lazyckpt._display` shows the place as `https://...@HOST/PATH?...`):

    - a user name and password (before the last '@' of the host, as the URL standard
      and requests read it), sent percent-decoded as HTTP Basic auth to the URL's
      origin, as requests and curl send them (a user name alone with an empty
      password, as curl and httpx do);
    - a query string, sent with every request for that URL alone: a pre-signed
      file's (`https://HOST/x.safetensors?X-Amz-Signature=...`), whose format its
      path names (a folder's URL with a query is refused: its files' URLs would
      lack it);
    - a fragment, which no client sends.

    Also checks the call's `storage_options` for the place, before any request.

    The host ends at the first '/', '?', '#' or '\\' (as the URL standard, requests
    and curl read it): a URL with an '@' after that is refused, since its user name
    and password would be read as the host, and part of them as its path, sent
    elsewhere and shown. Messages show the URL as `_display.url_shown` does."""
    shown = _display.url_shown(url)
    after_host = _HOST_ENDS.search(url.partition("://")[2])
    if after_host is not None and "@" in after_host.string[after_host.start() :]:
        raise StorageAccessError(
            f"{shown}: not a URL lazyckpt can ask for: it holds an '@' after the first '/', "
            "'?', '#' or '\\', where its host ends, so a password before that '@' would be "
            "read as the host; percent-encode these in a password ('/' as %2F, '?' as %3F, "
            "'#' as %23, '\\' as %5C, '@' as %40), and an '@' in a path or query as %40"
        )
    raw_query = url.partition("#")[0].partition("?")[2]  # (no '?' before it: see above)
    unsendable = _UNSENDABLE.search(raw_query)
    if unsendable is not None:
        raise StorageAccessError(
            f"{shown}: not a URL lazyckpt can ask for: its query string holds "
            f"{unsendable[0]!a} (a space, control or non-ASCII character), which no "
            "request sends as it is; percent-encode it (a space as %20, a newline as %0A), "
            "or copy the URL again whole (its query is a secret: it is not shown here)"
        )
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:  # (whose message may repeat the password)
        raise StorageAccessError(
            f"{shown}: not a URL lazyckpt can ask for: its host or port is malformed (a port "
            "is a number up to 65535, an IPv6 host goes in brackets, as [::1]:8080); "
            "percent-encode a password's '/', '?', '#', '@' and non-ASCII characters"
        ) from None
    if not parts.hostname:
        raise StorageAccessError(
            f"{shown}: not a URL lazyckpt can ask for: it names no host (https://HOST/PATH)"
        )
    origin = (parts.scheme, host(parts))
    place = f"{origin[0]}://{origin[1]}{parts.path}".rstrip("/")
    user, at, _ = parts.netloc.rpartition("@")
    if at or parts.query:
        shown = f"{origin[0]}://{'...@' if at else ''}{origin[1]}{parts.path.rstrip('/')}"
        _display.register(place, shown + ("?..." if parts.query else ""))
    if parts.query:
        _display.hide(parts.query, query=True)  # (where a server's text quotes it)
    if parts.query and not place.endswith(SINGLE_FILES):
        raise CheckpointNotFoundError(
            f"{place}: a URL with a query string is read as one pre-signed file, the query "
            f"sent with the requests for it alone, but its path names no weight file "
            f"({', '.join(SINGLE_FILES)}); give a file's URL, or pass a folder's "
            "credentials as storage_options={'headers': ...} or {'token': ...}"
        )
    carried = _CARRIED.get()
    if carried is not None:
        name, _, password = user.partition(":")
        if name or password:  # (`http://@host/`, `http://:@host/`: none, as requests)
            pair = urllib.parse.unquote_to_bytes(name) + b":"
            pair += urllib.parse.unquote_to_bytes(password)
            carried.authorization[origin] = f"Basic {base64.b64encode(pair).decode()}"
            _display.hide(pair.decode("utf-8", "replace"))
        if parts.query:
            carried.queries[place] = parts.query
    headers(place)  # checked before any request
    return place


def query(url: str) -> str:
    """The query string that requests for `url` send (its signature), from the URLs
    given in the call in progress; empty where it had none."""
    carried = _CARRIED.get()
    return carried.queries.get(url.rstrip("/"), "") if carried is not None else ""


def signed_above(url: str) -> str | None:
    """The URL given in the call in progress with a query string (a pre-signed
    file's) that `url` lies under, if any: a format's probe for files inside it, as if
    it were a folder, which finds none without a request."""
    carried = _CARRIED.get()
    places = carried.queries if carried is not None else {}
    return next((place for place in places if url.startswith(place + "/")), None)


def queries(folder: str) -> dict[str, str]:
    """The query strings of the files directly in `folder` that requests send, by
    name (`query`)."""
    carried = _CARRIED.get()
    found: dict[str, str] = {}
    for place, sent in carried.queries.items() if carried is not None else ():
        parent, _, name = place.rpartition("/")
        if parent == folder.rstrip("/"):
            found[name] = sent
    return found


def refuse_for(path: str, fix: str) -> None:
    """Refuse `headers` and `token` in the call in progress for `path`, which is no
    http(s):// URL (`fix` says where its credentials come from)."""
    options = _OPTIONS.get() or {}
    given = [key for key in ACCEPTED if key in options]
    if given:
        raise LazyTypeError(f"{path}: storage_options {given} are for https:// URLs; {fix}")


def refuse_for_hub(path: str, repo: str) -> None:
    """Refuse a `revision` in the `storage_options` of the call in progress for `path`,
    an `hf://` path of the repository `repo` (`ORG/NAME`): the path names its revision,
    and one passed here would be ignored, `main` read instead. (Other keys pass, as for
    a bucket on the other side of a `convert`; `headers` and `token` are `refuse_for`'s.)"""
    revision = (_OPTIONS.get() or {}).get("revision")
    if revision is not None:
        shown = urllib.parse.quote(revision, safe="") if isinstance(revision, str) else "REV"
        raise LazyTypeError(
            f"{path}: storage_options['revision'] is not read for hf:// paths; write the "
            f"revision in the path, hf://{repo}@{shown} (a branch, tag or commit)"
        )


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
    carried = _CARRIED.get()
    parts = urllib.parse.urlsplit(url)
    basic = carried.authorization.get((parts.scheme, host(parts))) if carried else None
    if basic is not None:
        if any(name.lower() == "authorization" for name in found):
            raise LazyTypeError(
                f"{url}: the URL carries a user name and password (sent as HTTP Basic "
                "auth) and storage_options a 'token' or an Authorization header; give one"
            )
        found["Authorization"] = basic
    for name, value in found.items():  # (credentials: hidden where a server's text quotes them)
        _display.hide_header(name, value)
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
