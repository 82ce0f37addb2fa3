"""Structured logs: one ``key=value`` (logfmt) or JSON line per event."""

from __future__ import annotations

import json
import logging
import sys
import time


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = f"ts={ts}.{int(record.msecs):03d}Z level={record.levelname.lower()} logger={record.name} "
        message = record.getMessage()
        line += f"msg={json.dumps(message)}" if "\n" in message else message  # one event, one line
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, then the message's ``key=value`` pairs.

    Values quoted by :func:`q` are JSON strings and are decoded as such, so quotes, ``=``
    and spaces inside a value survive. Words without ``=`` (messages from other
    libraries) are kept, in order, under ``msg``.
    """

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        data: dict[str, object] = {"ts": f"{ts}.{int(record.msecs):03d}Z", "level": record.levelname.lower(),
                                   "logger": record.name}
        loose: list[str] = []
        for key, value in parse_logfmt(record.getMessage()):
            if key is None:
                loose.append(value)
            elif key in data:
                data[f"field_{key}"] = value
            else:
                data[key] = value
        if loose:
            data["msg"] = " ".join(loose)
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=False)


def parse_logfmt(text: str) -> list[tuple[str | None, str]]:
    """Split ``a=1 b="x y" word`` into ``[("a", "1"), ("b", "x y"), (None, "word")]``.

    A quoted value is a JSON string (what :func:`q` writes), escapes included.
    """
    out: list[tuple[str | None, str]] = []
    decoder = json.JSONDecoder()
    i, n = 0, len(text)
    while i < n:
        if text[i] == " ":
            i += 1
            continue
        j = i
        while j < n and text[j] not in ' ="':
            j += 1
        if j < n and text[j] == "=" and j > i:
            key = text[i:j]
            j += 1
            if j < n and text[j] == '"':
                try:
                    value, end = decoder.raw_decode(text, j)
                    out.append((key, str(value)))
                    i = end
                    continue
                except ValueError:
                    pass
            k = j
            while k < n and text[k] != " ":
                k += 1
            out.append((key, text[j:k]))
            i = k
        else:
            k = i
            if text[k] == '"':
                try:
                    value, end = decoder.raw_decode(text, k)
                    out.append((None, str(value)))
                    i = end
                    continue
                except ValueError:
                    pass
            while k < n and text[k] != " ":
                k += 1
            out.append((None, text[i:k] if k > i else text[i]))
            i = max(k, i + 1)
    return out


def q(value: object) -> str:
    """Quote a logfmt value when it has spaces or quotes."""
    text = str(value)
    if not text or any(c in text for c in ' "='):
        return json.dumps(text)
    return text


def setup(level: str = "info", fmt: str = "logfmt") -> None:
    """Log to stderr, one line per event, in ``fmt``; libraries' warnings use the same format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    # Everything goes through the root logger's one handler, so a warning from asyncio
    # or another library is a line in the same format (parseable as JSON in json mode).
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    ours = logging.getLogger("kvxferd")
    ours.handlers[:] = []
    ours.setLevel(level.upper())
    ours.propagate = True
    logging.captureWarnings(True)
