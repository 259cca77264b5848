"""Paths shown as the user gave them, in every message lazyckpt makes.

An `hf://ORG/NAME` path is read from the place it resolves to (`lazyckpt._storage.http.hub`):
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
`as_given`, the command line its output: messages made anywhere are covered. A
server's own text (an error's body, a header) and Python's errors about a URL quote
a query without its URL, where `as_given` cannot see it: what they quote passes
through `scrubbed`, which hides the credentials `hide` was given (a signed query
whole, the values of its parameters named as credentials, a token, a password).
Both registries keep the latest few hundred or thousand entries, and are searched
by plain substring tests: a process that opens thousands of pre-signed URLs stays
as fast and as small as one that opens one. This module imports the standard
library only (the command line's parser imports it).
"""

from __future__ import annotations

import html
import re
import threading
from urllib.parse import unquote_plus, unquote_to_bytes

_SHORT = 7
"""Hex digits of a commit shown, as `git log --oneline` shows them."""

_LOCK = threading.Lock()
_NAMES: dict[str, str] = {}
"""Each registered place and its name, oldest first; replaced whole by `register`, so
that `as_given` reads it without the lock."""
_MOST_PLACES = 4096
"""Places named at once: an older one is shown as it is (a URL, its query hidden)."""
_BEFORE_PLACE = re.compile(r"[\w./~%+-]")
"""What a place may not follow: it would be the tail of a longer path or URL."""
_AFTER_PLACE = re.compile(r"[\w~%+-]|\.[\w~%+-]")
"""What a place may not precede: it would be the head of a longer name (`abc` in
`abcd` or `abc.bak`; a sentence's full stop ends it)."""

# A URL: its scheme; its user name and password; its host and path; then its query
# string or fragment, up to an ASCII space (a quote, '|' or '<' may be part of a
# secret; so may the control characters and Unicode spaces that `\s` also takes).
# An http(s) URL's user name and password are everything up to its last '@' before
# another URL that a host may follow (not a space, quote or closing punctuation): a
# password holding a raw '@', '/', '?', '#', a space, a quote, even a newline is
# hidden whole, at the cost of hiding more where text after the URL holds such an
# '@' (`lazyckpt._storage.http.web_options` refuses a URL with an '@' after its host, but
# a summary's title is any text). Other schemes carry no credentials lazyckpt
# sends: their user is what comes before an '@' inside the host part, and an
# `hf://ORG/NAME@REV/...` path keeps its revision.
_URL = re.compile(
    r"(?:(?P<web>\b(?i:https?)://)(?P<secret>(?:(?!://)[\s\S])*@(?![\s\"'`)\]},;!]))?"
    r"|(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^\s/?#\"<>\\^`{|}]*@)?)"
    r"(?P<rest>[^\s?#]*)"
    r"(?P<query>[?#][^ \t\n\r\f\v]*)?"
)
_AFTER = re.compile(r"[\"')\],.;:!]*\Z")
"""Punctuation that ends a query as the message's own (`'URL?x=1', which ...`)."""

_SECRETS: dict[str, tuple[str, ...]] = {}
"""Each credential given to `hide` (by what it was given as), as `_forms` finds it
in a server's text; oldest first."""
_MOST_SECRETS = 256
"""Credentials hidden at once. An older one is hidden still in the errors about
its own requests (`scrubbed`'s `queries`: the query strings of the addresses asked)."""
_SHORTEST = 8
"""Characters a form needs to be hidden: a shorter value guards nothing, and hiding
it would cut up the server's own words."""
_CREDENTIAL = re.compile(
    r"sig(?:nature)?$|token|credential|key|policy|auth|pass(?:w|$)|pwd|secret|session"
    r"|cookie|hmac|hdnts|jwt",
    re.IGNORECASE,
)
"""The names of query parameters and headers whose values are credentials: S3's
`X-Amz-Signature`, `X-Amz-Credential`, `X-Amz-Security-Token`; GCS's
`X-Goog-Signature`, `Signature`; Azure SAS's `sig`; CloudFront's `Policy`,
`Signature`, `Key-Pair-Id`; `token`, `api_key`; `Authorization`, `Cookie`. Not
`X-Amz-SignedHeaders`, `X-Amz-Algorithm`, `X-Amz-Expires`, Azure's `sv`, `sp`,
`se`: what they hold is public, and common words (`AWS4-HMAC-SHA256`)."""
# One unit of a server's text, and what it stands for: a percent escape, a JSON or
# `repr` escape (`\/`, `\u002f`, `\x01`; any other backslash is dropped), an HTML
# entity (`&#x2F;`, `&amp;`), a run of other characters, or one character.
_UNIT = re.compile(
    r"%[0-9A-Fa-f]{2}|\\(?:u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|x[0-9A-Fa-f]{2}|[\s\S])"
    r"|&#?[0-9A-Za-z]{1,31};|[^%\\&\r\n]+|[\s\S]"
)
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t"}


def register(place: str, shown: str) -> None:
    """Show `place` (a URL or a local folder, without a trailing '/') as `shown`
    wherever it appears in a message."""
    global _NAMES
    with _LOCK:
        names = {name: named for name, named in _NAMES.items() if name != place.rstrip("/")}
        names[place.rstrip("/")] = shown
        _NAMES = dict(list(names.items())[-_MOST_PLACES:])


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
    text = _places_named(text, _NAMES)
    return _URL.sub(_plain, text) if "://" in text else text


def _places_named(text: str, names: dict[str, str]) -> str:
    """`text` with each of `names`' places that stands whole in it (not part of a
    longer path or name) shown by its name: left to right, the longest at each point."""
    found = []
    for place in names:
        for start in _found(text, place):
            end = start + len(place)
            inside = start > 0 and _BEFORE_PLACE.match(text, start - 1) is not None
            if not inside and _AFTER_PLACE.match(text, end) is None:
                found.append((start, -len(place), place))
    out, last = [], 0
    for start, length, place in sorted(found):
        if start >= last:
            out += [text[last:start], _named(place, names[place], text, start - length)]
            last = start - length
    return "".join([*out, text[last:]])


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


def hide(secret: str, *, query: bool = False) -> None:
    """Hide `secret`, a credential lazyckpt sends (with `query`, a pre-signed URL's
    query string: whole, and the values of its parameters named as credentials), in
    every text `scrubbed` shows, while it is among the latest `_MOST_SECRETS`."""
    key = ("?" if query else "=") + secret
    with _LOCK:
        known = _SECRETS.pop(key, None)
        if known is not None:  # (the latest again)
            _SECRETS[key] = known
            return
    forms = _query_forms(secret) if query else _forms(secret)
    if not forms:
        return
    with _LOCK:
        _SECRETS[key] = forms
        while len(_SECRETS) > _MOST_SECRETS:
            del _SECRETS[next(iter(_SECRETS))]


def hide_header(name: str, value: str) -> None:
    """Hide the value of a header lazyckpt sends where its name is a credential's
    (`Authorization`, `Cookie`, `X-Api-Key`): whole, without its scheme (`Bearer`),
    and each of a cookie's values; `Accept: application/json` is no secret."""
    if _CREDENTIAL.search(name):
        hide(value)
        hide(value.partition(" ")[2])
        if "cookie" in name.lower():
            for part in value.split(";"):
                hide(part.partition("=")[2].strip())


def scrubbed(text: str, *queries: str) -> str:
    r"""`text` quoted from a server (a body, a reason, a header) or from an error about
    a URL, with each credential given to `hide`, and the query strings `queries` (of
    the addresses asked: whole, and their credentials' values), shown as `...`: as
    sent or percent-decoded, in a text that quotes them percent-encoded (in letters
    of either case), escaped as JSON, `repr` or HTML escape them, or cut across lines.

    >>> scrubbed("GET /x.bin?sig=5ec2e7&exp=3600 HTTP/1.1", "sig=5ec2e7&exp=3600")
    'GET /x.bin?... HTTP/1.1'
    >>> scrubbed("<SignatureProvided>5EC2E7A9</SignatureProvided>", "sig=5ec2e7a9&exp=3600")
    '<SignatureProvided>...</SignatureProvided>'
    >>> scrubbed("can't contain control characters. '/x?sig=5e\\x01c2'", "sig=5e\x01c2")
    "can't contain control characters. '/x?...'"
    >>> scrubbed('{"error": "bad sig Zm9vYmFy\\/QUJD\\u002bZGVm"}', "sig=Zm9vYmFy%2FQUJD%2BZGVm")
    '{"error": "bad sig ..."}'
    """
    with _LOCK:
        hidden = [form for forms in _SECRETS.values() for form in forms]
    hidden += [form for query in queries for form in _query_forms(query)]
    if not hidden or not text:
        return text
    plain, starts, ends = _decoded(text)
    spans: list[list[int]] = []
    for start, end in sorted(
        (starts[at], ends[at + len(form) - 1]) for form in hidden for at in _found(plain, form)
    ):
        if spans and start <= spans[-1][1]:  # (overlapping or touching: one `...`)
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    out, last = [], 0
    for start, end in spans:
        out += [text[last:start], "..."]
        last = end
    return "".join([*out, text[last:]])


def _found(text: str, form: str) -> list[int]:
    """Where `form` begins in `text`, each time."""
    found, at = [], text.find(form)
    while at >= 0:
        found.append(at)
        at = text.find(form, at + 1)
    return found


def _query_forms(query: str) -> tuple[str, ...]:
    """The forms of a query string whole, and of the values of its parameters whose
    names are a credential's (`X-Amz-Signature`, `sig`; not `X-Amz-Algorithm`)."""
    found = list(_forms(query))
    for part in re.split("[&;]", query):
        name, equals, value = part.partition("=")
        if equals and _CREDENTIAL.search(unquote_plus(name)):
            found += _forms(value)
    return tuple(dict.fromkeys(found))


def _forms(secret: str) -> tuple[str, ...]:
    """`secret` as `_decoded` reads it in a text that quotes it: as sent, and
    percent-decoded (where it was sent encoded), each of 8 characters or more."""
    sent = _canonical(_bytes(secret))
    decoded = _canonical(unquote_to_bytes(secret).decode("latin-1"))
    return tuple(form for form in dict.fromkeys((sent, decoded)) if len(form) >= _SHORTEST)


def _canonical(text: str) -> str:
    """Bytes (as Latin-1 letters) compared without their case, a `+` as the space it
    may stand for, line breaks dropped."""
    return text.lower().replace("+", " ").replace("\r", "").replace("\n", "")


def _bytes(text: str) -> str:
    """`text`'s UTF-8 bytes, each as the Latin-1 letter of its value."""
    return text.encode("utf-8", "surrogatepass").decode("latin-1")


def _decoded(text: str) -> tuple[str, list[int], list[int]]:
    """`text` with each escape in it read once (`_UNIT`), as `_canonical` bytes, and
    for each of those the start and end in `text` of the unit it was read from."""
    pieces: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    for unit in _UNIT.finditer(text):
        found, (start, end) = unit[0], unit.span()
        if found[0] not in "%\\&\r\n" and found.isascii():  # (most of a text)
            pieces.append(found)
            starts += range(start, end)
            ends += range(start + 1, end + 1)
        elif found[0] not in "%\\&\r\n":  # letters beyond ASCII: each its bytes
            for at, letter in enumerate(found, start):
                read = _bytes(letter)
                pieces.append(read)
                starts += [at] * len(read)
                ends += [at + 1] * len(read)
        else:
            read = _canonical(_read(found))
            pieces.append(read)
            starts += [start] * len(read)
            ends += [end] * len(read)
    return _canonical("".join(pieces)), starts, ends


def _read(unit: str) -> str:
    """What one escape of `_UNIT` stands for, as bytes (Latin-1 letters)."""
    if unit[0] == "%" and len(unit) == 3:
        return chr(int(unit[1:], 16))
    if unit[0] == "\\" and len(unit) > 2:
        code = int(unit[2:], 16)
        return _bytes(chr(code)) if code <= 0x10FFFF else ""
    if unit[0] == "\\" and len(unit) == 2:
        return _bytes(_ESCAPES.get(unit[1], unit[1]))
    return _bytes(html.unescape(unit))


def _named(place: str, name: str, text: str, end: int) -> str:
    """The name of `place`, found in `text` up to `end`; the place as it stands where
    its name only adds what follows it there already (a pre-signed file's `?...`, in
    a text shown once before)."""
    added = name.removeprefix(place) if name.startswith(place) else ""
    return place if added and text.startswith(added, end) else name


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
