"""``Content-Disposition: attachment`` for any file name (RFC 6266, with RFC 5987's ``filename*``).

A header value must be Latin-1 (Starlette encodes it so), and a run's name may be any Unicode;
the name travels percent-encoded as UTF-8 in ``filename*``, which clients prefer, with an ASCII
``filename`` beside it for the few that do not read ``filename*``.
"""

from __future__ import annotations

import re
from urllib.parse import quote


def attachment(filename: str) -> str:
    """The header value for downloading ``filename``; backslashes and double quotes are dropped from it."""
    name = filename.replace("\\", "").replace('"', "")
    fallback = re.sub(r"[^\x20-\x7e]", "_", name)  # printable ASCII; quotes and backslashes are gone already
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(name, safe='')}"
