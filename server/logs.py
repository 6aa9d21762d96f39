"""One-line JSON log records, so every request's lines can be grepped by its request_id.

`log_event(logger, event, **fields)` emits {"ts", "level", "logger", "event", ...fields}; a traceback
(`exc_info=`) goes into the same object as "exception", so every line of the log is one JSON object.
`configure_logging` (what `tilevox serve` calls) sends every logger's records, uvicorn's and
Python's warnings included, through the one JSON formatter on stderr.
"""

from __future__ import annotations

import json
import logging
import time

__all__ = ["JsonFormatter", "configure_logging", "log_event"]


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        payload.update(getattr(record, "fields", {}))
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


def configure_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)  # other libraries: warnings and errors only
    logging.getLogger("tilevox").setLevel(level)
    logging.getLogger("tilevox").handlers.clear()
    logging.getLogger("tilevox").propagate = True
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "grpc"):  # no handlers of their own
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    logging.captureWarnings(True)


def log_event(
    logger: logging.Logger, event: str, *, level: int = logging.INFO, exc_info: BaseException | None = None, **fields
) -> None:
    logger.log(level, event, exc_info=exc_info, extra={"fields": fields})
