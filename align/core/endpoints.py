"""HTTP to an OpenAI-compatible endpoint (a pairwise judge's `base_url`): the checks `align validate` makes before
any stage starts (the URL, the key's variable, one probe of /models) and the rules every request follows (no
redirects: the key goes to base_url only; the key never in a message)."""

from __future__ import annotations

import http.client
import os
from urllib.parse import urlsplit


def url_problem(base_url: str) -> str | None:
    """Why `base_url` cannot be a judge's root URL (credentials in it are never echoed), or None."""
    url = base_url.rstrip("/")
    if not url.lower().startswith(("http://", "https://")):
        return (f"{url_without_credentials(base_url)!r} is not an http(s) URL; give the API's root with its scheme, "
                f"e.g. base_url: http://{url_without_credentials(url).split('://')[-1]}")
    if "@" in url.partition("://")[2]:  # before any parsing (a password may hold / or ?); an API root has no @
        return (f"{url_without_credentials(base_url)} carries credentials in the URL, which would be written to logs "
                "and manifests; give base_url without them and the key in the variable that key_env names")
    try:
        urlsplit(url).port  # noqa: B018 (raises ValueError for a port that is not a number)
    except ValueError as exc:
        return f"{base_url} is not a URL ({exc}); give the API's root, e.g. http://host:8000/v1"
    if urlsplit(url).query or urlsplit(url).fragment or url.endswith(("?", "#")):
        return (f"{url_without_credentials(base_url)} holds a query or fragment: align adds /chat/completions to "
                f"base_url, which would land after it; give the API's root alone, e.g. "
                f"{url_without_credentials(url).split('?')[0].split('#')[0]}")
    suffix = next((s for s in ("/chat/completions", "/completions", "/models") if url.endswith(s)), None)
    if suffix:
        return (f"{base_url} names an endpoint path; give the API's root (align adds /chat/completions): "
                f"base_url: {url[:-len(suffix)]}")
    return None


def url_without_credentials(url: str) -> str:
    """`url` with everything up to the last @ after its scheme shown as ***@ (a password may hold / or ?)."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}***@{rest.rpartition('@')[2]}" if sep and "@" in rest else url


def header_value_problem(variable: str) -> str | None:
    """Why the value of environment variable `variable` cannot go into an HTTP header (never the value itself)."""
    value = os.environ.get(variable, "")
    if any(ch.isspace() or not 32 <= ord(ch) < 127 for ch in value):  # http.client sends headers as Latin-1
        return (f"the value of {variable} holds whitespace, control or non-ASCII characters (a key file saved with CRLF line "
                f"ends leaves a trailing \\r); export it again without them, e.g. export {variable}=$(tr -d '\\r\\n' < "
                "FILE)")
    return None


def without_key(text: str, key: str) -> str:
    """`text` with `key` replaced by <key>, also as the http library quotes it inside bytes (a key with a \r shows as
    b'Bearer sk-...\\r' in its errors)."""
    return text.replace(key, "<key>").replace(repr(key.encode())[2:-1], "<key>") if key else text


def no_redirects(*handlers):
    """An opener for requests that carry a judge's key (with `handlers` besides): it follows no redirect (urllib's own
    rebuilds a redirected request with every header but the body's, the key included, for whatever host the server
    names); a 3xx reaches the caller as an HTTPError, whose Location `redirected` names."""
    import urllib.request

    class Refuse(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    return urllib.request.build_opener(Refuse, *handlers)


def redirected(exc) -> str | None:
    """What to say of an HTTPError that is a redirect (None for any other): where to, and the fix."""
    if not 300 <= exc.code < 400:
        return None
    where = (exc.headers.get("Location") if exc.headers else None) or "an address it does not name"
    return (f"the endpoint redirects (HTTP {exc.code}) to {where}: align sends the key to no other address than "
            "base_url; set base_url to where it redirects")


def endpoint_problem(base_url: str, key: str, timeout: float, model: str | None = None) -> str | None:
    """One probe of an OpenAI-compatible endpoint (GET {base_url}/models): None when it answers (and, when it lists
    its models, lists `model`); else why not (never the key: any text that may carry it is scrubbed)."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(base_url.rstrip("/") + "/models", headers={"Authorization": f"Bearer {key}"}
                                 if key else {})
    try:
        with no_redirects().open(req, timeout=timeout) as resp:
            listing = resp.read(1 << 20)
    except urllib.error.HTTPError as exc:
        if moved := redirected(exc):
            return moved
        if exc.code in (401, 403):
            return f"the endpoint refused the key (HTTP {exc.code}); check the key in the named variable"
        if exc.code == 404:  # an endpoint without /models may still answer chat completions: one of 1 token
            return _chat_problem(base_url, key, timeout, model)
        return f"the endpoint answered HTTP {exc.code} to a probe of /models"
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:  # BadStatusLine: not HTTP
        reason = without_key(str(getattr(exc, "reason", exc)), key)
        return f"not reachable ({reason}); check base_url, and that the server is running and reachable from here"
    try:
        ids = [m["id"] for m in json.loads(listing)["data"]]
    except (ValueError, KeyError, TypeError):
        return None  # not a listing we can read: the chat completions will tell
    if model and ids and model not in ids:
        return f"it serves no model {model!r} (its /models lists {', '.join(map(repr, ids[:8]))}); set model to one of them"
    return None


def _chat_problem(base_url: str, key: str, timeout: float, model: str | None) -> str | None:
    """An endpoint without /models: None when {base_url}/chat/completions exists (any answer but 404 to a request
    of one token), else why not, with the usual slip (/v1 left off the root) named."""
    import json
    import urllib.error
    import urllib.request

    body = json.dumps({"model": model or "", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1})
    req = urllib.request.Request(base_url.rstrip("/") + "/chat/completions", data=body.encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with no_redirects().open(req, timeout=timeout) as resp:
            resp.read(1 << 16)
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            return redirected(exc)  # a refusal of the probe itself (400, 429, ...): the path is there
        root = base_url.rstrip("/")
        hint = f"; did you mean base_url: {root}/v1?" if not root.endswith("/v1") else ""
        return f"neither {root}/models nor {root}/chat/completions exists there (HTTP 404){hint}"
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        return f"not reachable ({without_key(str(getattr(exc, 'reason', exc)), key)}); check base_url"
    return None
