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
        line += record.getMessage()
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data = {"ts": record.created, "level": record.levelname.lower(), "logger": record.name}
        for part in _split_logfmt(record.getMessage()):
            key, _, value = part.partition("=")
            data[key] = value
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data)


def _split_logfmt(text: str) -> list[str]:
    parts, current, quoted = [], "", False
    for ch in text:
        if ch == '"':
            quoted = not quoted
            continue
        if ch == " " and not quoted:
            if current:
                parts.append(current)
            current = ""
        else:
            current += ch
    if current:
        parts.append(current)
    return parts


def q(value: object) -> str:
    """Quote a logfmt value when it has spaces or quotes."""
    text = str(value)
    if not text or any(c in text for c in ' "='):
        return json.dumps(text)
    return text


def setup(level: str = "info", fmt: str = "logfmt") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger("kvxferd")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
