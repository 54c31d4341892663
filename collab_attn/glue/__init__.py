"""GLUE: task data and metrics (``tasks``), the pipeline as functions (``pipeline``), sweep summaries, and training
from scratch on a GLUE task (``scratch``)."""
