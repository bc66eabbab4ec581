"""Secrets out of every string sleuth prints or writes: one function, `redact`, used where URLs enter
(git remotes, git's own error lines, HTTP failures, the reference model) and again at every sink (stdout,
stderr, report.md/json/sarif, fix.yaml, trace.jsonl, cache metadata).

What counts as a secret: the userinfo of any URL (`https://x-access-token:TOKEN@github.com/...`; a token
can be the user name alone), credential-like query parameters (`?access_token=`, `&sig=`, ...), bearer
headers, the well-known token shapes (GitHub's `ghp_`/`github_pat_`, GitLab's `glpat-`), private key blocks
(`-----BEGIN ... PRIVATE KEY-----`), and the value of any secret-looking variable of sleuth's own environment
(GITHUB_TOKEN, HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...: a name with TOKEN, SECRET, PASSWORD, API_KEY, ...)
wherever it appears. Hosts and paths are kept: they are what a reader needs to act.
"""

from __future__ import annotations

import io
import os
import re
from typing import TextIO

MASK = "***"

# scheme://userinfo@ -- userinfo cannot contain '/', '@' or whitespace; the host after '@' is kept.
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/@\s'\"<>]+)@")
_SECRET_QUERY = re.compile(
    r"(?P<key>[?&;](?:access_token|token|private_token|api_key|apikey|key|password|passwd|pwd|secret|"
    r"client_secret|sig|signature|x-amz-signature|x-amz-credential|x-amz-security-token|auth|code)=)"
    r"(?P<value>[^&#\s'\"<>]+)",
    re.IGNORECASE,
)
_BEARER = re.compile(
    r"(?P<key>(?:\bAuthorization:\s*(?:Bearer|Basic|token)\s+|\bBearer\s+))(?P<value>[A-Za-z0-9._~+/=\-]{8,})",
    re.IGNORECASE,
)
_TOKEN_SHAPES = re.compile(
    r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_\-]{20,})"
)
_PRIVATE_KEY = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.DOTALL)
_SECRET_ENV_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every secret replaced by ***; safe to call twice and on text without URLs."""
    if not text:
        return text
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    text = _SECRET_QUERY.sub(lambda m: f"{m['key']}{MASK}", text)
    text = _BEARER.sub(lambda m: f"{m['key']}{MASK}", text)
    text = _TOKEN_SHAPES.sub(MASK, text)
    text = _PRIVATE_KEY.sub(MASK, text)
    for name, value in os.environ.items():
        value = value.strip()
        if len(value) >= 8 and _SECRET_ENV_NAME.search(name):  # a short value would mask ordinary words
            text = text.replace(value, MASK)
    return text


def redact_data(value: object) -> object:
    """Every string inside a JSON-like value redacted (keys too); other values as they are."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact(str(k)) if isinstance(k, str) else k: redact_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_data(v) for v in value]
    return value


# The only escape sequence sleuth's own console output holds: rich's colours (SGR), when it colours.
_SGR = re.compile(r"\x1b\[[0-9;]*m")


class RedactingWriter(io.TextIOBase):
    """A text stream that redacts whatever is written through it: the terminal is a sink too.

    It is also the terminal's last gate: every field is escaped where it is rendered (sleuth.escape.terminal),
    and whatever still reaches the stream has its unsafe code points (controls, ESC, bidi, invisible format
    characters) escaped, newlines apart; where rich colours (a terminal, FORCE_COLOR) its colour sequences (SGR)
    pass, no other sequence does."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        from sleuth.codepoints import escape_unsafe

        redacted = redact(text)
        coloured = self._coloured()
        pieces = _SGR.split(redacted) if coloured else [redacted]
        colours = _SGR.findall(redacted) if coloured else []
        # newlines are the console's own line structure; a newline inside a field was escaped where it was rendered
        gated = ["\n".join(escape_unsafe(line) for line in piece.split("\n")) for piece in pieces]
        self._stream.write("".join(part for pair in zip(gated, [*colours, ""]) for part in pair))
        return len(text)

    def _coloured(self) -> bool:
        # When rich colours its output: on a terminal, or forced as rich itself reads the environment (CI logs)
        return self.isatty() or bool(os.environ.get("FORCE_COLOR")) or os.environ.get("TTY_COMPATIBLE") == "1"

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")
