"""The torch releases zeropp supports, and what to tell a user outside them: read by the package at
import from the installed metadata, before (and without) importing torch."""

# The torch releases zeropp supports, first and last (pyproject.toml's requirement; CI tests both).
SUPPORTED_TORCH = ((2, 13), (2, 15))


def unsupported_torch_warning(version: str) -> str | None:
    """What to tell a user running torch `version` outside SUPPORTED_TORCH; None inside it. The one
    place a version string is read: the range is a promise about releases, not a feature check."""
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    (first, last) = SUPPORTED_TORCH
    if first <= release <= last:
        return None
    return (f"zeropp supports torch {first[0]}.{first[1]} to {last[0]}.{last[1]}; this is torch {version}, on which "
            f"its passes may fail or, worse, change silently. Install a supported release: "
            f"pip install \"torch>={first[0]}.{first[1]},<{last[0]}.{last[1] + 1}\"")
