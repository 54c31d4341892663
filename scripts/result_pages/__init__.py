"""The claims of each results page, one module per page, and the checker they use (``engine``): run by
scripts/check_results.py."""
