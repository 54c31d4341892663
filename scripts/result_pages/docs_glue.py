"""The claims of docs/glue.md (the GLUE pipeline's guide): no measured numbers left, strict so that none is added
without its run files."""

from __future__ import annotations

from result_pages.engine import strict


def claims_docs_glue() -> None:
    """docs/glue.md: strict on the whole page. Its one measurement (1 process against 2 on SST-2, commit dbdc4a8) had
    no committed result files and was taken off the page (issue 88)."""
    strict("docs/glue.md")
