"""Paths shown as the user gave them, in every message lazyckpt makes.

An `hf://ORG/NAME` path is read from the place it resolves to (`lazyckpt._storage.hub`):
`https://ENDPOINT/ORG/NAME/resolve/COMMIT`, or a snapshot folder of the Hugging Face
cache. Neither is what the user wrote, and the text of errors, warnings and reports
is made far below the verb that knows what that was. So the resolver registers each
place with the name to show for it (`hf://ORG/NAME@1a2b3c4`, the commit's first 7
hex digits), and `as_given` puts that name where the place appears in a text: a file
inside it keeps its path (`hf://ORG/NAME@1a2b3c4/sub/model.safetensors`).

`as_given` also hides what a URL may carry as a credential: the query string (a
signature, `?X-Amz-Signature=...`, `?token=...`; a signed CDN address) and fragment
are shown as `?...`, and a user name and password as `...@`. The rest of the URL
stays, so that a message still says which file it is about.

`LazyckptError` and `warn` (`lazyckpt._errors`) pass their messages through
`as_given`, the command line its output: messages made anywhere are covered. This
module imports the standard library only (the command line's parser imports it).
"""

from __future__ import annotations

import re
import threading

_SHORT = 7
"""Hex digits of a commit shown, as `git log --oneline` shows them."""

_NAMES: dict[str, str] = {}
_LOCK = threading.Lock()
_PLACES: re.Pattern[str] | None = None
"""Every registered place, longest first, where it is not part of a longer path or
name (the commit folder `abc` is not a prefix of `abcd`); None where none is."""

# A URL: its scheme; its user name and password; its host and path; then its query
# string or fragment, up to a space (a quote, '|' or '<' may be part of a secret).
# An http(s) URL's user name and password are everything up to its last '@' before
# another URL that a host may follow (not a space, quote or closing punctuation): a
# password holding a raw '@', '/', '?', '#', a space, a quote, even a newline is
# hidden whole, at the cost of hiding more where text after the URL holds such an
# '@' (`lazyckpt._storage.web_options` refuses a URL with an '@' after its host, but
# a summary's title is any text). Other schemes carry no credentials lazyckpt
# sends: their user is what comes before an '@' inside the host part, and an
# `hf://ORG/NAME@REV/...` path keeps its revision.
_URL = re.compile(
    r"(?:(?P<web>\b(?i:https?)://)(?P<secret>(?:(?!://)[\s\S])*@(?![\s\"'`)\]},;!]))?"
    r"|(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^\s/?#\"<>\\^`{|}]*@)?)"
    r"(?P<rest>[^\s?#]*)"
    r"(?P<query>[?#]\S*)?"
)
_AFTER = re.compile(r"[\"')\],.;:!]*\Z")
"""Punctuation that ends a query as the message's own (`'URL?x=1', which ...`)."""


def register(place: str, shown: str) -> None:
    """Show `place` (a URL or a local folder, without a trailing '/') as `shown`
    wherever it appears in a message."""
    global _PLACES
    with _LOCK:
        _NAMES[place.rstrip("/")] = shown
        ordered = sorted(_NAMES, key=len, reverse=True)
        places = "|".join(map(re.escape, ordered))
        # Whole places only: not the tail of a longer path (`/backup/root/...`, a URL
        # inside another one's path), nor the head of a longer name (`abc` in `abcd`
        # or `abc.bak`; a sentence's full stop ends it).
        _PLACES = re.compile(f"(?<![\\w./~%+-])(?:{places})(?![\\w~%+-]|\\.[\\w~%+-])")


def hub_name(kind: str, repo_id: str, commit: str) -> str:
    """How a Hub repository at `commit` is shown: `hf://ORG/NAME@1a2b3c4` (`kind`:
    `""`, `"datasets/"` or `"spaces/"`)."""
    return f"hf://{kind}{repo_id}@{commit[:_SHORT]}"


def as_given(text: str) -> str:
    """`text` with each registered place shown by its name, and URLs without their
    query string, fragment or password.

    >>> register("https://hub.test/org/m/resolve/c0ffee", "hf://org/m@c0ffee0")
    >>> as_given("https://hub.test/org/m/resolve/c0ffee/w.safetensors: gone")
    'hf://org/m@c0ffee0/w.safetensors: gone'
    >>> as_given("https://mirror.example/https://hub.test/org/m/resolve/c0ffee/w")
    'https://mirror.example/https://hub.test/org/m/resolve/c0ffee/w'
    >>> as_given("'https://u:pw@cdn.example/x.bin?X-Amz-Signature=secret', which failed")
    "'https://...@cdn.example/x.bin?...', which failed"
    >>> as_given("http://user:p@ss@host/m: refused")
    'http://...@host/m: refused'
    >>> register("https://cdn.example/x.bin", "https://cdn.example/x.bin?...")
    >>> as_given(as_given("https://cdn.example/x.bin: gone"))
    'https://cdn.example/x.bin?...: gone'
    """
    places = _PLACES
    if places is not None:
        text = places.sub(lambda match: _named(match, text), text)
    return _URL.sub(_plain, text) if "://" in text else text


def url_shown(url: str) -> str:
    """How a URL given whole (to `open`, not inside a text) is shown: without what
    `as_given` hides, its user name and password up to its last '@' and its query
    string or fragment up to its end, whatever they hold.

    >>> url_shown("http://user:se/cr3t@host/m?sig=a b")
    'http://...@host/m?...'
    """
    scheme, sep, rest = url.partition("://")
    _, at, rest = rest.rpartition("@")
    place = re.split("[?#]", rest, maxsplit=1)[0]
    query = rest[len(place) :]
    hidden = f"{query[0]}..." if len(query) > 1 else query
    return f"{scheme}{sep}{'...@' if at else ''}{place}{hidden}"


def _named(match: re.Match[str], text: str) -> str:
    """The name of the place `match` found in `text`; the place as it stands where its
    name only adds what follows it there already (a pre-signed file's `?...`, in a
    text shown once before)."""
    place = match[0]
    name = _NAMES[place]
    added = name.removeprefix(place) if name.startswith(place) else ""
    return place if added and text.startswith(added, match.end()) else name


def given_repr(value: object) -> str:
    """`repr` of a path as `as_given` shows it: for the `repr=` of an attrs field."""
    return repr(as_given(value)) if isinstance(value, str) else repr(value)


def _plain(match: re.Match[str]) -> str:
    scheme, user = match["web"] or match["scheme"], match["secret"] or match["user"]
    query = match["query"] or ""
    after = _AFTER.search(query)
    kept = after[0] if after is not None else ""
    hidden = query[: len(query) - len(kept)]
    if len(hidden) > 1:  # (a bare '?' hides nothing: `?...` stays as it is)
        query = f"{hidden[0]}...{kept}"
    return f"{scheme}{'...@' if user else ''}{match['rest']}{query}"
