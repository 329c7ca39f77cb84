"""PDF text for ``/qa`` uploads: off the event loop, within pages, characters and time.

A PDF is a program for a parser: it may hold ten thousand pages, a compressed stream that
inflates to gigabytes, objects nested until the parser's recursion gives out, or just bytes that
are no PDF. :func:`pdf_text` runs pypdf on a worker thread (``anyio.to_thread``), so the event
loop answers ``/health`` and streams other answers meanwhile, and bounds the work:

- ``--max-pdf-pages`` pages (413 before any text is extracted);
- ``--max-pdf-chars`` characters of text, and never more than a document of
  ``--max-document-tokens`` tokens could hold (:data:`CHARS_PER_TOKEN` a token: real text runs
  3-5, layout whitespace more), so extraction stops at the page that passes it and the 413 comes
  before the text is tokenised;
- ``--pdf-timeout`` seconds: the request is answered 422 at the deadline, and the thread stops
  at its next page (a thread cannot be killed mid-page; one page's work is what is left).

Every failure of the parser is the client's file, never the server: pypdf's
``LimitReachedError`` (its own decompression and size limits) is 413, a ``RecursionError``
(nesting too deep) and any other exception 422, all naming ``file``.
"""

from __future__ import annotations

import io
import threading

import anyio
import anyio.to_thread

from app.errors import ApiError
from app.settings import ServeSettings

CHARS_PER_TOKEN = 32  # more characters than this per token cannot fit the token limit


def char_limit(settings: ServeSettings) -> tuple[int, str]:
    """The most characters a PDF's text may have, and the setting that sets it."""
    by_tokens = settings.max_document_tokens * CHARS_PER_TOKEN
    if by_tokens < settings.max_pdf_chars:
        return by_tokens, f"{settings.max_document_tokens} tokens (--max-document-tokens)"
    return settings.max_pdf_chars, f"{settings.max_pdf_chars} characters (--max-pdf-chars)"


def extract(data: bytes, max_pages: int, max_chars: tuple[int, str], stop: threading.Event) -> str:
    """The text of every page (blocking: run it on a thread); errors are ApiErrors."""
    from pypdf import PdfReader
    from pypdf.errors import LimitReachedError

    try:
        reader = PdfReader(io.BytesIO(data))
        pages = len(reader.pages)
        if pages > max_pages:
            msg = f"the PDF has {pages} pages; the limit is {max_pages} pages (--max-pdf-pages)"
            raise ApiError(413, msg, "file")
        limit, owner = max_chars
        parts, total = [], 0
        for i, page in enumerate(reader.pages):
            if stop.is_set():  # the request timed out or left: nobody waits for the rest
                return ""
            parts.append(page.extract_text() or "")
            total += len(parts[-1]) + 2 * (i > 0)
            if total > limit:
                msg = f"the PDF's text passes {limit} characters by page {i + 1}: more than {owner}"
                raise ApiError(413, msg, "file")
        return "\n\n".join(parts)
    except ApiError:
        raise
    except LimitReachedError as exc:
        raise ApiError(413, f"the PDF passes a parser limit: {exc}", "file") from exc
    except RecursionError as exc:
        raise ApiError(422, "the PDF file cannot be read: nested too deeply", "file") from exc
    except Exception as exc:
        reason = str(exc)[:200] or type(exc).__name__
        raise ApiError(422, f"the PDF file cannot be read: {reason}", "file") from exc


async def pdf_text(data: bytes, settings: ServeSettings) -> str:
    """:func:`extract` on a worker thread within ``settings.pdf_timeout`` (422 past it)."""
    stop = threading.Event()
    try:
        with anyio.fail_after(settings.pdf_timeout):
            return await anyio.to_thread.run_sync(
                extract,
                data,
                settings.max_pdf_pages,
                char_limit(settings),
                stop,
                abandon_on_cancel=True,
            )
    except TimeoutError:
        msg = f"the PDF cannot be read within {settings.pdf_timeout:g} s (--pdf-timeout)"
        raise ApiError(422, msg, "file") from None
    finally:
        stop.set()
