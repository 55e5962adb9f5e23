"""When a stored file expires: OpenAI's `expires_after` ({"anchor": "created_at", "seconds": N}), taken
on an upload (`expires_after`, as the form fields `expires_after[anchor]` and `expires_after[seconds]`)
and on a batch for the output and error files it writes (`output_expires_after`). The retention sweep
(core/retention.py) removes a file once its `expires_at` has passed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.errors import invalid

ANCHOR = "created_at"  # the only anchor OpenAI takes
MIN_S = 3600  # OpenAI's bounds: 1 hour to 30 days
MAX_S = 30 * 86400
# Without one: kept 30 days, as OpenAI keeps `purpose=batch` files (uploads and batch results alike).
DEFAULT_S = 30 * 86400


def _anchor(param: str, anchor: object) -> None:
    if anchor != ANCHOR:
        raise invalid(f"{param}.anchor", f"{param}.anchor must be '{ANCHOR}'.", "invalid_value")


def _seconds(param: str, seconds: object) -> int:
    if not isinstance(seconds, int) or isinstance(seconds, bool) or not MIN_S <= seconds <= MAX_S:
        raise invalid(
            f"{param}.seconds",
            f"{param}.seconds must be an integer from {MIN_S} (1 hour) to {MAX_S} (30 days).",
            "invalid_value",
        )
    return seconds


def seconds_of(value: Any, param: str) -> int | None:
    """The seconds of a JSON `expires_after` object (None: not given); a 400 naming the field otherwise."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != {"anchor", "seconds"}:
        raise invalid(param, f"{param} must be an object {{'anchor': '{ANCHOR}', 'seconds': N}}.", "invalid_value")
    _anchor(param, value["anchor"])
    return _seconds(param, value["seconds"])


def form_seconds(fields: Mapping[str, str], param: str = "expires_after", partial: bool = False) -> int | None:
    """The seconds of `expires_after` sent as form fields (None: not given); a 400 naming the field
    otherwise. `partial`: the form is still arriving, so a part not yet seen is not missing."""
    anchor, seconds = fields.get(f"{param}[anchor]"), fields.get(f"{param}[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor is not None:
        _anchor(param, anchor)
    if seconds is not None:
        # Form values are text: digits only (no sign, blanks or exponent), then the same bounds.
        _seconds(param, int(seconds) if seconds.isascii() and seconds.isdigit() and len(seconds) < 12 else None)
    if partial:
        return None
    if anchor is None or seconds is None:
        missing = f"{param}[anchor]" if anchor is None else f"{param}[seconds]"
        raise invalid(
            missing, f"{param} needs both {param}[anchor] and {param}[seconds].", "missing_required_parameter"
        )
    return int(seconds)
