"""A job's kind when the caller names none: derived from its args' class as awa-pg derives it.

A job enqueued by awa-sa and by awa-pg from the same class must share a kind, or a worker
registered for one would never claim the other's jobs.
"""

from functools import lru_cache


@lru_cache(maxsize=1024)
def derive_kind(class_name: str) -> str:
    """awa-pg's kind for a class name: CamelCase to snake_case, acronyms kept whole.

    An upper-case letter starts a word after a lower-case letter or an ASCII digit, or after
    an upper-case one when a lower-case letter follows (``HTMLToPDF`` is ``html_to_pdf``).
    """
    out = []
    for n, char in enumerate(class_name):
        if _upper(char):
            before = class_name[n - 1] if n else ""
            after = class_name[n + 1] if n + 1 < len(class_name) else ""
            if n and (
                _lower(before)
                or before in "0123456789"
                or (_upper(before) and after != "" and _lower(after))
            ):
                out.append("_")
            out.append(char.lower()[0])
        else:
            out.append(char)
    return "".join(out)


def _upper(char: str) -> bool:
    return char.isupper()


def _lower(char: str) -> bool:
    return char.islower()
