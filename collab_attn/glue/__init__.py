"""GLUE: task data and metrics (``tasks``), a job read once into a frozen typed object and its identity (``jobs``),
calibration texts from a file or a task (``calibrate``), the pipeline as functions (``pipeline``), sweep summaries,
and training from scratch on a GLUE task (``scratch``)."""
